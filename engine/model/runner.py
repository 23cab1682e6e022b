"""Turns a StepPlan into one packed forward and the next token of every question that draws one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.adapters.lora import LoraStacks
from engine.constrain.masks import RowMasks
from engine.kernels.attention import Segment
from engine.kv.cache import KVCache
from engine.model.logprobs import Logprob, asking_rows, logprobs_of, raw_scores
from engine.model.sampler import Sampler, SampleRow
from engine.step_plan import Chunk, StepPlan


@dataclass
class StepOutput:
    sampled: list[int]  # one token per drawn row (plan.sample_row_chunks), in plan order
    segments: list[Segment]  # what the forward packed, for the isolation audit
    owners: list[Chunk]  # the chunk of each segment
    logprobs: list[Logprob | None] | None = None  # per drawn row, where its question asked; None: nobody did


def segments_of(plan: StepPlan) -> tuple[list[Segment], list[Chunk]]:
    """One segment per chunk, except a drafting chunk: one single-row segment per row, so each verify
    row takes the decode path a plain decode of that token would (deterministic mode: the same bits).
    Its rows still see each other causally: a step writes all its K/V before any row attends."""
    segments, owners, row = [], [], 0
    for chunk in plan.chunks:
        blocks = tuple(chunk.seq.block_ids)
        generated = chunk.start >= chunk.seq.num_prompt_tokens
        pieces = [(chunk.start + i, 1) for i in range(chunk.length)] if chunk.draft else [(chunk.start, chunk.length)]
        for start, length in pieces:
            segments.append(Segment(row, length, start + length, blocks, generated))
            owners.append(chunk)
            row += length
    return segments, owners


class ModelRunner:
    def __init__(self, model, kv: KVCache, attention=None, sampler: Sampler | None = None, weights=None):
        self.model = model
        self.weights = weights or model.weights
        self.kv = kv
        self.attention = attention or self.weights.mode.attention(kv)
        self.sampler = sampler or Sampler()
        self.device = model.device
        self.lora_stacks = LoraStacks(model.dtype)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, row_masks: Callable[[list], RowMasks | None] | None = None) -> StepOutput:
        """`row_masks(sampled_chunks)`: the response_format masks of the rows to draw, asked for after the
        forward (engine/constrain/: they are computed on another thread while it runs)."""
        segments, owners = segments_of(plan)
        token_ids, positions = [], []
        for chunk in plan.chunks:
            token_ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + chunk.length)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        attend = self.attention.prepare(segments)
        spans = [(c.seq.lora, s.q_start, s.q_len) for s, c in zip(segments, owners)]
        lora = self.weights.mode.lora_batch(spans, self.device, self.lora_stacks)
        # Without adapters the call is exactly the base one: no LoRA argument, no LoRA work.
        hidden = (self.weights.forward(ids, pos, attend) if lora is None
                  else self.weights.forward(ids, pos, attend, lora=lora))
        sample_rows = [s.q_start + s.q_len - 1 for s, c in zip(segments, owners) if c.sample]
        if not sample_rows:
            return StepOutput([], segments, owners)
        if len(sample_rows) < hidden.shape[0]:  # a pure decode step samples every row: no gather
            hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.weights.logits(hidden)
        rows = [row for c in plan.sampled_chunks for row in _sample_rows(c)]
        masks = row_masks(plan.sample_row_chunks) if row_masks is not None else None
        asking = asking_rows(rows)
        if not asking:
            return StepOutput(self.sampler.sample(logits, rows, masks), segments, owners)
        scores = raw_scores(logits, rows, asking)  # before the sampler, which may change logits in place
        tokens = self.sampler.sample(logits, rows, masks, processed=scores)
        return StepOutput(tokens, segments, owners, logprobs_of(scores, rows, tokens))


def _sample_rows(chunk: Chunk) -> list[SampleRow]:
    """A drafting chunk's row i draws the token after draft[:i]: the draw it would have, at the same
    position with the same seeded noise, had those drafts been its own tokens."""
    seq = chunk.seq
    if not chunk.draft:
        return [SampleRow(seq.params, seq.token_ids, seq.num_tokens)]
    return [SampleRow(seq.params, seq.token_ids + list(chunk.draft[:i]), seq.num_tokens + i)
            for i in range(len(chunk.draft) + 1)]
