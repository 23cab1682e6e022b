"""From sampled tokens to answers: detokenizing with stop strings."""
