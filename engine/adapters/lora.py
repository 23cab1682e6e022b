"""Multi-LoRA in one forward: each adapter's low-rank delta added only to the rows of its own questions."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.adapters.files import FUSED, FusedLora, LoraAdapter


@dataclass
class LoraBatch:
    """The adapters of one packed forward and the rows each owns; rows of no adapter get no delta.

    Per projection: one gather of every adapter row, grouped by adapter and padded to the largest
    group; two batched matmuls in which group g's rows meet only adapter g's weights; one scatter-add.
    A loop over groups would do the same arithmetic, but on CPU its cost is per-call overhead, which
    the batched form pays once per projection. Deterministic mode's TiledLoraBatch
    (engine/deterministic/lora.py) takes each adapter alone instead.
    """

    layers: list[dict[str, FusedLora]]  # the groups' weights, stacked (see LoraStacks)
    rows: torch.Tensor  # [groups, width]: the rows of each group; padding repeats the group's first row
    keep: torch.Tensor | None  # [groups, width, 1]: 0 on padding, so it adds exact zeros; None if unpadded

    @classmethod
    def build(cls, spans, device, stacks: "LoraStacks") -> "LoraBatch | None":
        """`spans`: (adapter or None, first row, rows) per chunk; None when no chunk has an adapter."""
        groups = group_rows(spans)
        if not groups:
            return None
        adapters = tuple(sorted(groups, key=lambda a: a.key))  # one order per mix: the stacks are reused
        width = max(map(len, groups.values()))
        rows = [groups[a] + [groups[a][0]] * (width - len(groups[a])) for a in adapters]
        keep = None
        if any(len(r) < width for r in groups.values()):
            keep = torch.tensor([[[float(i < len(groups[a]))] for i in range(width)] for a in adapters],
                                device=device, dtype=stacks.dtype)
        return cls(stacks.get(adapters), torch.tensor(rows, dtype=torch.long, device=device), keep)

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += each group's delta on x[rows], for its own rows only."""
        lora = self.layers[layer].get(projection)
        if lora is None:
            return
        shrunk = torch.bmm(x[self.rows], lora.shrink)
        if self.keep is not None:
            shrunk = shrunk * self.keep
        out.index_add_(0, self.rows.flatten(), torch.bmm(shrunk, lora.expand).flatten(0, 1))


def group_rows(spans) -> dict[LoraAdapter, list[int]]:
    """Each adapter's rows, from (adapter or None, first row, rows) per chunk."""
    groups: dict[LoraAdapter, list[int]] = {}
    for adapter, start, length in spans:
        if adapter is not None:
            groups.setdefault(adapter, []).extend(range(start, start + length))
    return groups


class LoraStacks:
    """Adapter weights stacked per mix of adapters, kept for the next steps: a mix changes rarely
    (when a question with a new adapter arrives or the last one of an adapter leaves). The few most
    recent mixes are kept; an older mix, and the adapters only it refers to, is dropped."""

    def __init__(self, dtype: torch.dtype, keep_mixes: int = 8):
        self.dtype = dtype
        self.keep_mixes = keep_mixes
        self._mixes: OrderedDict[tuple[LoraAdapter, ...], list[dict[str, FusedLora]]] = OrderedDict()

    def get(self, adapters: tuple[LoraAdapter, ...]) -> list[dict[str, FusedLora]]:
        if adapters not in self._mixes:
            self._mixes[adapters] = [_stack_layer([a.layers[i] for a in adapters])
                                     for i in range(len(adapters[0].layers))]
            while len(self._mixes) > self.keep_mixes:
                self._mixes.popitem(last=False)
        self._mixes.move_to_end(adapters)
        return self._mixes[adapters]


def _stack_layer(per_adapter: list[dict[str, FusedLora]]) -> dict[str, FusedLora]:
    stacked = {}
    for projection in FUSED:
        parts = [layer.get(projection) for layer in per_adapter]
        present = [p for p in parts if p is not None]
        if not present:
            continue
        rank = max(p.shrink.shape[1] for p in present)
        features_in, features_out = present[0].shrink.shape[0], present[0].expand.shape[1]
        like = present[0].shrink
        # Ranks differ between adapters, and some skip a projection: zero padding adds exact zeros.
        shrinks = [like.new_zeros(features_in, rank) if p is None else _pad(p.shrink, 1, rank) for p in parts]
        expands = [like.new_zeros(rank, features_out) if p is None else _pad(p.expand, 0, rank) for p in parts]
        stacked[projection] = FusedLora(torch.stack(shrinks), torch.stack(expands))
    return stacked


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim)
