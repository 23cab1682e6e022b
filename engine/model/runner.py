"""Turns a StepPlan into one packed forward and the next token of every question that draws one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.adapters.lora import LoraStacks
from engine.constrain.masks import RowMasks
from engine.kernels.attention import Segment
from engine.kv.cache import KVCache
from engine.model.sampler import Sampler, SampleRow
from engine.schedule.step_plan import StepPlan


@dataclass
class StepOutput:
    sampled: list[int]  # one token per sampled chunk, in plan order
    segments: list[Segment]  # what the forward packed, for the isolation audit


def segments_of(plan: StepPlan) -> list[Segment]:
    segments, row = [], 0
    for chunk in plan.chunks:
        generated = chunk.start >= chunk.seq.num_prompt_tokens
        segments.append(Segment(row, chunk.length, chunk.start + chunk.length, tuple(chunk.seq.block_ids), generated))
        row += chunk.length
    return segments


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
        segments = segments_of(plan)
        token_ids, positions = [], []
        for chunk in plan.chunks:
            token_ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + chunk.length)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        attend = self.attention.prepare(segments)
        spans = [(c.seq.lora, s.q_start, s.q_len) for s, c in zip(segments, plan.chunks)]
        lora = self.weights.mode.lora_batch(spans, self.device, self.lora_stacks)
        # Without adapters the call is exactly the base one: no LoRA argument, no LoRA work.
        hidden = (self.weights.forward(ids, pos, attend) if lora is None
                  else self.weights.forward(ids, pos, attend, lora=lora))
        sample_rows = [s.q_start + s.q_len - 1 for s, c in zip(segments, plan.chunks) if c.sample]
        if not sample_rows:
            return StepOutput([], segments)
        if len(sample_rows) < hidden.shape[0]:  # a pure decode step samples every row: no gather
            hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.weights.logits(hidden)
        rows = [SampleRow(c.seq.params, c.seq.token_ids, c.seq.num_tokens) for c in plan.sampled_chunks]
        masks = row_masks(plan.sampled_chunks) if row_masks is not None else None
        return StepOutput(self.sampler.sample(logits, rows, masks), segments)
