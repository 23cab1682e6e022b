"""From sampled tokens to answers: detokenizing, answer events, and the handles async callers wait on."""
