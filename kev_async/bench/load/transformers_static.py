"""(b) transformers `generate` with static batches, replaying the same trace: what static serving does.

Questions queue as they arrive. When the model is free, a batch starts as soon as `batch_size` questions
wait, or when the oldest has waited `timeout_s`; it takes up to `batch_size` of them, left-padded,
greedy, each row stopping at EOS or its own budget, and admits nobody until the whole batch ends.
Each row's answer is timed at the step that produced its last token (a streaming static server could
return it then): the reading most favourable to static batching.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kev_async.bench.load.report import Outcome, SystemRun
from kev_async.bench.load.trace import TraceQuestion, prompt_ids


class _StepClock:
    """A generate() streamer that only notes when each decoding step's tokens came out."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first put is the prompt itself
            self._prompt_seen = True
            return
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def _per_row_budget(budgets: list[int], width: int, device: torch.device):
    """A stopping criterion that ends each row at its own max_new_tokens (generate takes only one)."""
    limits = torch.tensor(budgets, device=device)  # generate ORs it with flags on the model's device

    class PerRowBudget(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
            return torch.full_like(limits, input_ids.shape[1] - width) >= limits

    return PerRowBudget()


def _trim(tokens: list[int], eos: tuple[int, ...], budget: int) -> list[int]:
    """Up to and including the first EOS (as Kev reports it), at most `budget`; the padding after goes."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos:
            return tokens[: i + 1]
    return tokens[:budget]


def generate_batch(hf, model, batch: list[TraceQuestion], prompts: dict[str, list[int]], t0: float) -> list[Outcome]:
    eos = tuple(model.spec.eos_token_ids)
    rows = [prompts[q.qid] for q in batch]
    width = max(map(len, rows))
    ids = torch.tensor([[eos[0]] * (width - len(r)) + r for r in rows], device=hf.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=hf.device)
    budgets = [q.max_new_tokens for q in batch]
    clock = _StepClock()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(budgets), do_sample=False,
                          eos_token_id=list(eos), pad_token_id=eos[0], streamer=clock,
                          stopping_criteria=StoppingCriteriaList([_per_row_budget(budgets, width, hf.device)]))
    ended = time.monotonic()
    outcomes = []
    for q, row in zip(batch, out):
        answer = _trim(row[width:].tolist(), eos, q.max_new_tokens)
        last = clock.times[len(answer) - 1] if 0 < len(answer) <= len(clock.times) else ended
        first = clock.times[0] if clock.times else ended
        text = model.tokenizer.decode(answer, skip_special_tokens=True)
        reason = "stop" if answer and answer[-1] in eos else "length"
        outcomes.append(Outcome(q.qid, q.arrival_s, first - t0, last - t0, len(answer), answer, text, reason))
    return outcomes


def run_static(hf, model, trace: list[TraceQuestion], batch_size: int, timeout_s: float) -> SystemRun:
    prompts = {q.qid: prompt_ids(model, q) for q in trace}
    warm = trace[0]
    generate_batch(hf, model, [TraceQuestion("warm-up", 0.0, warm.prompt, warm.system, 2, warm.kind)],
                   {"warm-up": prompts[warm.qid]}, time.monotonic())
    outcomes: list[Outcome] = []
    pending, waiting = deque(trace), []
    t0 = time.monotonic()
    while pending or waiting:
        now = time.monotonic() - t0
        while pending and pending[0].arrival_s <= now:
            waiting.append(pending.popleft())
        if not waiting:
            time.sleep(pending[0].arrival_s - now)
            continue
        starts_at = waiting[0].arrival_s + timeout_s  # the oldest question's patience
        if len(waiting) >= batch_size or now >= starts_at:
            batch, waiting = waiting[:batch_size], waiting[batch_size:]
            outcomes += generate_batch(hf, model, batch, prompts, t0)
        else:
            next_arrival = pending[0].arrival_s if pending else starts_at
            time.sleep(max(0.0, min(starts_at, next_arrival) - now))
    by_id = {o.qid: o for o in outcomes}
    return SystemRun(f"transformers static (batch {batch_size})", [by_id[q.qid] for q in trace],
                     {"batch_size": batch_size, "batch_timeout_s": timeout_s})


def best_static(hf, model, trace: list[TraceQuestion], batch_sizes: list[int], timeout_s: float,
                summarize, out=print) -> tuple[SystemRun, list[dict]]:
    """Every batch size on the same trace; the one with the highest goodput is the static system."""
    runs, sweep = [], []
    for size in batch_sizes:
        run = run_static(hf, model, trace, size, timeout_s)
        summary = summarize(run)
        out(f"  transformers static, batch {size:3}: goodput {summary['goodput_tps']:.1f} tok/s, "
            f"e2e p50 {summary['e2e_p50_s'] or 0:.2f} s")
        runs.append((summary["goodput_tps"], run))
        sweep.append(summary)
    best = max(runs, key=lambda r: r[0])[1]
    best.name = f"transformers static (best: batch {best.notes['batch_size']})"
    return best, sweep
