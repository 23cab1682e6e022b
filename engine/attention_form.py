"""How one layer's queries meet its keys: the score scale, a sliding window, a soft cap on the scores.

Llama-like layers use the plain form (1/sqrt(head_dim), every earlier key, no cap). Gemma scales by its
query_pre_attn_scalar, Gemma 2 caps its scores with tanh, and Mistral, Phi-3 and Gemma's sliding layers
see only the last `window` positions. Every attention backend reads the form of the layer it attends
(`LayerKV.form`), so each row's keys and arithmetic still depend on its own position alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionForm:
    scale: float  # multiplies each query-key dot product
    window: int | None = None  # a row at position p sees keys p - window + 1 .. p (transformers' sliding window)
    softcap: float | None = None  # scores become softcap * tanh(score / softcap) before the softmax

    @classmethod
    def plain(cls, head_dim: int) -> "AttentionForm":
        return cls(head_dim ** -0.5)

    def first_key(self, length: int) -> int:
        """The first position a row sees when it sees `length` keys (its own position + 1)."""
        return 0 if self.window is None else max(0, length - self.window)
