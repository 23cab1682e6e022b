"""speculative.method draft_model: greedy drafts from a small model, or from the target's first N layers.

The drafter keeps its own KV cache (its own blocks, in a pool of its own), and per question the tokens
whose K/V it holds. It is only ever fed that question's own tokens: a question's prompt and verified
answer, then its own drafts. At each call the tokens it holds are compared with the question's tokens
now; the first that differ (a rejected draft) and everything after are dropped, so only verified
tokens stay, and the slots past them are overwritten before any row reads them (a row attends to
positions below its own only). All questions drafting in a step draft together: the first forward
catches each up on its new tokens and draws its first draft, each further forward feeds every
question still drafting its last draft. k drafts cost k forwards of the drafter.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from engine.kernels.attention import Segment, TorchAttention
from engine.kv.cache import KVCache
from engine.speculate.cost import StepCosts
from engine.speculate.probe import measure


class DraftModelRefused(ValueError):
    """The draft model cannot draft for this target (another tokenizer, too many layers)."""


@dataclass
class _Held:
    """What the drafter holds for one question: its blocks and the tokens whose K/V they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    kept: int = 0  # at its last draft: tokens whose K/V it still held from before (the rest it computed then)


@dataclass
class _Ask:
    held: _Held
    feed: list[int]  # tokens to feed at the next forward
    k: int
    drafts: list[int] = field(default_factory=list)


class DraftModel:
    method = "draft_model"  # the metrics' and the audit's name for it

    def __init__(self, weights, spec, device: torch.device, dtype: torch.dtype, max_draft_tokens: int,
                 capacity_tokens: int, block_size: int, name: str, kv_dtype: torch.dtype | None = None):
        self.weights = weights
        self.name = name
        self.device = device
        self.max_draft_tokens = max_draft_tokens
        self.block_size = block_size
        num_blocks = max(1, -(-capacity_tokens // block_size))
        self.kv = KVCache(spec, num_blocks, block_size, kv_dtype or dtype, device, compute_dtype=dtype)
        self.attention = TorchAttention(self.kv)
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest block first
        self.held: dict[str, _Held] = {}  # by question id, least recently drafted first
        self.costs: StepCosts | None = None  # policy auto: its forward against its rows (engine/speculate/setup.py)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    # -- drafting ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_batch(self, asks: list[tuple[str, list[int], int]]) -> list[tuple[int, ...]]:
        """Up to k greedy drafts per (question id, its tokens, k); () where its cache has no room."""
        batch = [self._prepare(qid, tokens, k, {q for q, _, _ in asks}) for qid, tokens, k in asks]
        for _ in range(max((k for _, _, k in asks), default=0)):
            drafting = [ask for ask in batch if ask is not None and len(ask.drafts) < ask.k]
            if not drafting:
                break
            for ask, token in zip(drafting, self._forward(drafting)):
                ask.drafts.append(token)
                ask.feed = [token]
        return [tuple(ask.drafts) if ask is not None else () for ask in batch]

    def _prepare(self, qid: str, tokens: list[int], k: int, drafting: set[str]) -> _Ask | None:
        held = self.held.pop(qid, None) or _Held()
        self.held[qid] = held  # most recently drafted last
        same = 0
        limit = min(len(held.tokens), len(tokens) - 1)  # the last token is always fed: its row draws draft 1
        while same < limit and held.tokens[same] == tokens[same]:
            same += 1
        del held.tokens[same:]  # rejected drafts, and anything after them, are forgotten
        held.kept = same
        # Room for its tokens and the drafts fed back (the last draft is drawn, never fed).
        if not self._grow(held, len(tokens) + k - 1, drafting):
            return None
        return _Ask(held, tokens[same:], k)

    def _forward(self, asks: list[_Ask]) -> list[int]:
        segments, ids, positions, row = [], [], [], 0
        for ask in asks:
            start = len(ask.held.tokens)
            segments.append(Segment(row, len(ask.feed), start + len(ask.feed), tuple(ask.held.blocks)))
            ids += ask.feed
            positions += range(start, start + len(ask.feed))
            ask.held.tokens += ask.feed
            row += len(ask.feed)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.weights.forward(ids_t, pos_t, self.attention.prepare(segments))
        last = torch.tensor([s.q_start + s.q_len - 1 for s in segments], device=self.device)
        return self.weights.logits(hidden[last]).argmax(dim=-1).tolist()

    # -- blocks -----------------------------------------------------------------------------------
    def _grow(self, held: _Held, num_tokens: int, drafting: set[str]) -> bool:
        needed = -(-num_tokens // self.block_size) - len(held.blocks)
        while needed > len(self.free):
            idle = next((qid for qid in self.held if qid not in drafting), None)
            if idle is None:
                return False
            self.forget(idle)  # a question not drafting now: its cache is rebuilt if it drafts again
        for _ in range(max(0, needed)):
            held.blocks.append(self.free.pop())
        return True

    def origin(self, question_id: str, context: int) -> dict:
        """For the audit: what its last draft for the question read (`context` of the question's own tokens,
        `kept` of them from K/V it already held) and the blocks of its own cache that hold them."""
        held = self.held.get(question_id) or _Held()
        return {"method": self.method, "context": context, "kept": held.kept, "blocks": list(held.blocks)}

    def forget(self, question_id: str) -> None:
        """The question ended (or its cache is needed elsewhere): its blocks go back."""
        held = self.held.pop(question_id, None)
        if held is not None:
            self.free.extend(reversed(held.blocks))

    @property
    def num_used_blocks(self) -> int:
        return sum(len(h.blocks) for h in self.held.values())

    # -- cost ---------------------------------------------------------------------------------------
    def measure(self, rows: tuple[int, ...], budget_s: float) -> StepCosts:
        """Its forward against rows (n single-token rows over one block each), before any question."""
        context = min(self.block_size, 16)

        def step(n: int) -> None:
            asks = []
            for i in range(n):
                held = _Held([i % self.kv.num_blocks], [0] * (context - 1))
                asks.append(_Ask(held, [0], 1))
            with torch.inference_mode():
                self._forward(asks)

        return measure(step, rows, self.device, budget_s)


def layer_view(weights, spec, layers: int):
    """The target's first `layers` layers, final norm and output head: the same tensors, no copy."""
    if not 1 <= layers < spec.num_layers:
        raise DraftModelRefused(f"speculative.draft_layers must be 1..{spec.num_layers - 1} for a model of "
                                f"{spec.num_layers} layers, got {layers}")
    view = copy.copy(weights)
    view.layers = weights.layers[:layers]
    view.stack = None  # the target's layer stack holds every layer: the view runs its forward in Python
    return view, dataclasses.replace(spec, num_layers=layers)


def check_tokenizer(target, draft, source: str) -> None:
    """A draft's token ids mean the target's tokens only if both use the same vocabulary."""
    mine, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        raise DraftModelRefused(
            f"speculative.draft_model {source!r} does not share the target's tokenizer ({len(theirs)} vs "
            f"{len(mine)} tokens, {differ} entries differ): drafts are token ids, so the draft model must "
            f"use the target's tokenizer")
