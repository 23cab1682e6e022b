"""Speculative decoding: drafts proposed from a question's own tokens, verified in the packed forward."""

from engine.speculate.ngram import NgramDrafter, ngram_draft

__all__ = ["NgramDrafter", "ngram_draft"]
