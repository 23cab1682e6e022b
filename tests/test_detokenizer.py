"""The detokenizer never stalls on bytes that do not make a character, and stays linear (issue 26, item 9).

A model can draw stray UTF-8 continuation bytes (SmolLM2's byte tokens "¡", "¢", ... decode to "\ufffd"
alone); the stream used to wait for a character that never came: no streamed text, and every push
decoded the whole growing tail again.
"""

import random

import pytest

from engine.output.detokenizer import MAX_PENDING_TOKENS, TextStream


class CountingTokenizer:
    """The real tokenizer, counting how many token ids it has been asked to decode in all."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def stray_bytes(smollm2_tokenizer):
    """Token ids that are one lone byte which never starts or ends a character by itself."""
    ids = [i for i in range(300) if smollm2_tokenizer.decode([i]) == "\ufffd"]
    assert len(ids) > 50
    return ids


def test_stray_bytes_are_shown_within_a_few_tokens(smollm2_tokenizer, stray_bytes):
    stream = TextStream(smollm2_tokenizer)
    shown = "".join(stream.push(i) for i in smollm2_tokenizer.encode("Hello there"))
    assert shown == "Hello there"
    pushed = 0
    while not shown.endswith("\ufffd"):
        shown += stream.push(stray_bytes[pushed % len(stray_bytes)])
        pushed += 1
        assert pushed <= MAX_PENDING_TOKENS, f"nothing shown after {pushed} stray bytes"
    shown += "".join(stream.push(i) for i in smollm2_tokenizer.encode(" and after"))
    shown += stream.finish()
    assert shown == stream.text
    assert shown.startswith("Hello there\ufffd") and shown.endswith(" and after")


def test_a_long_run_of_stray_bytes_decodes_in_linear_time(smollm2_tokenizer, stray_bytes):
    tokenizer = CountingTokenizer(smollm2_tokenizer)
    stream = TextStream(tokenizer)
    rng = random.Random(7)
    tokens = 3000
    silent = longest_silence = 0
    for _ in range(tokens):
        silent = 0 if stream.push(rng.choice(stray_bytes)) else silent + 1
        longest_silence = max(longest_silence, silent)
    assert longest_silence < MAX_PENDING_TOKENS  # streamed all along, never held back for long
    # Each push decodes a bounded window (context + pending, twice); re-decoding the tail would be ~n²/2.
    assert tokenizer.decoded <= 2 * tokens * (MAX_PENDING_TOKENS + 6)


@pytest.mark.parametrize("text", ["a😀b", "中文字符测试", "Ünïcödé — “quotes” 🎉🎉 done", "日本語のテキスト。漢字"])
def test_characters_split_across_tokens_still_come_out_whole(smollm2_tokenizer, text):
    stream = TextStream(smollm2_tokenizer)
    shown = "".join(stream.push(i) for i in smollm2_tokenizer.encode(text)) + stream.finish()
    assert shown == text and "\ufffd" not in shown
