"""The wire form of an answer's logprobs: each token's text beside its id, decoded once per token id."""

from __future__ import annotations

from schemas import TokenLogprob, TopLogprob


class TokenTexts:
    """Token id -> its text decoded alone (special tokens as written), remembered: a vocabulary's worth at most."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def wire(self, entries) -> tuple[TokenLogprob, ...]:
        """engine.model.logprobs.Logprob entries as the answer's TokenLogprob."""
        return tuple(TokenLogprob(self.text(e.token_id), e.token_id, e.logprob,
                                  tuple(TopLogprob(self.text(i), i, lp) for i, lp in e.top))
                     for e in entries)
