"""One question's constraint: its own matcher, and the mask of tokens that may come next.

The mask is llguidance's bitmask (int32 words, bit t = token t allowed) with the question's stop tokens
set exactly when the grammar accepts what was written so far: the answer can end only where it parses.
On CPU the worker also turns it into an additive bias row (0 allowed, BLOCKED not), so the device
thread only adds it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.constrain.grammars import CompiledGrammar

# Added to a blocked token's logit. Not -inf: bf16 holds it, and `-inf * 0` style NaNs cannot arise;
# a blocked token's score stays below every allowed one's by ~1e38, far past any logit.
BLOCKED = 1e38


class Constraint:
    def __init__(self, compiled: CompiledGrammar, stop_token_ids: tuple[int, ...], width: int, bias: bool):
        self.spec = compiled.spec
        self.matcher = compiled.matcher.deep_copy()
        self.stop_token_ids = tuple(t for t in stop_token_ids if t < compiled.first_mask.numel() * 32)
        self.width = width  # the model's logits width: the bias row is cut or padded to it
        self.want_bias = bias
        self.bits = compiled.first_mask.clone()
        self.bias: torch.Tensor | None = None
        self.consumed = 0  # output tokens fed to the matcher
        self.mask_at = -1  # `consumed` when `bits` was last computed; -1 = never
        self.failed: str | None = None  # why the answer broke its grammar (a token it refused)
        # What was written so far is a complete answer in the grammar. Kept here, updated as tokens are
        # consumed: the answer reads it on the device thread while the worker may hold the matcher.
        self.accepting = self.matcher.is_accepting()
        self._finish_mask()  # the first mask came with the compiled grammar

    @property
    def ready(self) -> bool:
        """The mask is for the next token."""
        return self.mask_at == self.consumed

    def fill(self) -> None:
        """Compute the mask for the next token (drops the GIL: runs on the mask worker beside the forward)."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        self._finish_mask()

    def consume(self, token: int) -> bool:
        """Feed the drawn token to the grammar; False (and `failed` set) if the grammar refuses it."""
        if token in self.stop_token_ids:
            return True  # the question ends on it: nothing follows to constrain
        self.consumed += 1
        if self.matcher.consume_token(token):
            self.accepting = self.matcher.is_accepting()
            return True
        self.failed = (f"token {token} does not continue the {self.spec.kind} at output token {self.consumed}: "
                       f"{self.matcher.get_error() or 'refused'}")
        return False

    def _finish_mask(self) -> None:
        bits = self.bits.numpy().view(np.uint32)
        for token in self.stop_token_ids:
            word, bit = divmod(token, 32)
            if self.accepting:
                bits[word] |= np.uint32(1 << bit)
            else:
                bits[word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)
        if self.want_bias:
            self.bias = bias_row(self.bits, self.width)
        self.mask_at = self.consumed


def bias_row(bits: torch.Tensor, width: int) -> torch.Tensor:
    """0.0 where the bit is set, -BLOCKED elsewhere, as `width` floats (tokens past the mask: blocked).

    numpy, not torch: on the worker thread torch would run these 49k-element ops on its intra-op pool,
    which the forward is using (measured: 12 ms instead of 6 us per row on a busy 2-core machine)."""
    allowed = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")
    if allowed.size < width:
        allowed = np.concatenate([allowed, np.zeros(width - allowed.size, dtype=np.uint8)])
    bias = allowed[:width].astype(np.float32)
    bias -= 1.0
    bias *= np.float32(BLOCKED)
    return torch.from_numpy(bias)


def bias_rows(bits: torch.Tensor, width: int) -> torch.Tensor:
    """`bias_row` for a stack of masks [rows, words], on the masks' device (the GPU path: no host unpack)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).reshape(bits.shape[0], -1)
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    return allowed[:, :width].float().sub_(1.0).mul_(BLOCKED)
