"""A stop string cuts the answer's token_ids and completion_tokens where it cuts the text (review finding)."""

import pytest

from engine.output.detokenizer import TextStream



def test_text_stream_keeps_only_the_tokens_of_the_kept_text(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The sea is calm. STOP here and then more words follow.")
    stream = TextStream(smollm2_tokenizer, stop=("STOP",))
    for token in ids:
        stream.push(token)
        if stream.stopped:
            break
    assert stream.text == "The sea is calm. "
    kept = ids[:stream.kept_tokens]
    # Every kept token's text is in the answer; " STOP" straddles the cut (its space is kept), so it goes.
    assert smollm2_tokenizer.decode(kept) == "The sea is calm."
    assert "STOP" not in smollm2_tokenizer.decode(kept)
    assert stream.kept_tokens < len(stream.ids)  # the stop string's token(s) were pushed, and are dropped
    nothing = TextStream(smollm2_tokenizer, stop=("The",))
    nothing.push(ids[0])
    assert nothing.stopped and nothing.text == "" and nothing.kept_tokens == 0


@pytest.mark.slow
def test_a_stopped_answer_counts_only_its_kept_tokens(smollm2):
    from engine import IsolatedBatchPipeline

    pipeline = IsolatedBatchPipeline(smollm2, max_batch_size=4, kv_slot_capacity=256)
    prompt = "Write a haiku about autumn."
    full = pipeline.run([prompt], max_new_tokens=40, temperature=0.0)[0]
    words = [w for w in full.text.split() if len(w) >= 3]
    stop = next(w for w in words[len(words) // 2:] if full.text.find(w) > 0)
    answer = pipeline.run([{"prompt": prompt, "params": {"stop": [stop]}}], max_new_tokens=40, temperature=0.0)[0]
    assert answer.finish_reason == "stop"
    assert answer.text == full.text[: full.text.find(stop)]
    tokenizer = smollm2.tokenizer
    assert answer.usage.completion_tokens == len(answer.token_ids)
    assert tuple(answer.token_ids) == tuple(full.token_ids[: len(answer.token_ids)])  # a prefix of the same run
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    assert answer.text.startswith(decode(answer.token_ids))  # no token past the cut
    assert len(decode(full.token_ids[: len(answer.token_ids) + 1])) > len(answer.text)  # and none short of it
    # Before the fix, the answer ran to the token that completed the stop string; those tokens are gone now.
    completed = next(k for k in range(1, len(full.token_ids) + 1) if stop in decode(full.token_ids[:k]))
    assert len(answer.token_ids) < completed
