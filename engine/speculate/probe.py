"""policy auto's cost table: a forward's seconds against its rows, timed once when the engine starts.

Each probe step is n decode rows (one token each, a short context, every row drawn greedily) through
the engine's own runner, so it prices what a verify row costs: the forward, the output layer and the
draw. Run before any question holds a block: the rows write into free blocks, which no question has
read and whose slots a question's own tokens overwrite before it reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.sequence import SamplingParams, Sequence
from engine.step_plan import Chunk, StepPlan
from engine.speculate.cost import StepCosts

PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)
REPEATS = 2  # the fastest of these counts: a shared machine only ever adds time
BUDGET_S = 2.0  # past it no bigger size is started; the table extends the last measured slope


def measure(step: Callable[[int], None], rows: tuple[int, ...], device: torch.device,
            budget_s: float = BUDGET_S) -> StepCosts:
    """`step(n)` runs one forward of n rows. Each size runs once to warm up (sizes go up while the
    probe has run under `budget_s`, the first two always), then REPEATS rounds over all the sizes
    warmed, keeping each size's fastest: a stall of a shared machine hits one round, not one size."""
    started, sizes = time.perf_counter(), []
    for n in rows:
        if len(sizes) >= 2 and time.perf_counter() - started > budget_s:
            break
        step(n)  # first-call allocations and kernel choices for this shape
        sizes.append(n)
    best = [float("inf")] * len(sizes)
    for _ in range(REPEATS):
        for i, n in enumerate(sizes):
            began = time.perf_counter()
            step(n)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], time.perf_counter() - began)
    return StepCosts(tuple(sizes), tuple(best))


def probe_rows(max_tokens_per_step: int) -> tuple[int, ...]:
    """PROBE_ROWS up to the step's token budget (beyond it the table extends its last slope)."""
    return tuple(n for n in PROBE_ROWS if n <= max_tokens_per_step) or (1,)


def target_step(runner, num_blocks: int, block_size: int) -> Callable[[int], None]:
    """n decode rows through the engine's runner, row i in block i (wrapping round a small pool)."""
    context = min(block_size, 16)
    params = SamplingParams(max_new_tokens=2, temperature=0.0)

    def step(n: int) -> None:
        chunks = []
        for i in range(n):
            seq = Sequence(f"probe-{i}", [0] * (context - 1), params, output_ids=[0])
            seq.block_ids = [i % num_blocks]
            seq.num_computed_tokens = context - 1
            chunks.append(Chunk(seq, start=context - 1, length=1, sample=True))
        runner.execute(StepPlan(chunks))

    return step
