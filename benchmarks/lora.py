"""`python -m benchmarks.lora`: the same questions with four adapters mixed in one batch, and with none (random
PEFT adapters from tests/adapter_fixtures.py, which the product's tests write too)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import msgspec

from benchmarks.engine import Run
from kev_async.bench.model import bench_model
from kev_async.sample_questions import QUESTIONS
from schemas import DEFAULT_MODEL
from tests.adapter_fixtures import write_random_adapter

# torch and the engine are imported inside the functions that use them: --help answers without loading them.


def register(kinds: argparse._SubParsersAction) -> None:
    lora = kinds.add_parser(
        "lora", help="Kev with 4 LoRA adapters mixed in one batch vs no adapter",
        description="Writes random PEFT adapters (all linear targets) to a temporary folder, then runs the "
                    "same questions with no adapter and with the adapters assigned round-robin, alternating, "
                    "in one engine; greedy. Prints tokens/s of each (median of --repeats) and the ratio.")
    lora.add_argument("--model", default=DEFAULT_MODEL)
    lora.add_argument("--questions", type=int, default=32, help="how many of the mixed questions (default 32)")
    lora.add_argument("--max-new-tokens", type=int, default=64)
    lora.add_argument("--repeats", type=int, default=3, help="runs per variant; the median is kept")
    lora.add_argument("--adapters", type=int, default=4)
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    lora.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    bench_lora(bench_model(args), num_questions=args.questions, max_new_tokens=args.max_new_tokens,
               repeats=args.repeats, num_adapters=args.adapters, rank=args.rank)
    return 0


def bench_lora(model, *, num_questions: int = 32, max_new_tokens: int = 64, repeats: int = 3,
               num_adapters: int = 4, rank: int = 8, out=print) -> dict:
    """The same questions with no adapter and with `num_adapters` spread round-robin, in one engine.

    The two variants alternate within each repeat, so a noisy neighbour slows both alike; the median
    repeat of each is reported.
    """
    from engine.options import EngineOptions
    from engine.pipeline import IsolatedBatchPipeline
    from engine.prompt import as_question

    questions = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:num_questions])]
    pipe = IsolatedBatchPipeline(model, max_batch_size=num_questions,
                                 options=EngineOptions(max_loras=num_adapters))
    names = [f"adapter{i}" for i in range(num_adapters)]
    mixed = [msgspec.structs.replace(q, adapter=names[i % num_adapters]) for i, q in enumerate(questions)]
    variants = {"no adapter": questions, f"{num_adapters} adapters (r={rank}, all linear), round-robin": mixed}
    timings: dict[str, list] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:  # kept while serving: an evicted adapter is read back from it
        for i, name in enumerate(names):
            pipe.core.load_adapter(name, write_random_adapter(Path(tmp) / name, model, rank, seed=i))
        pipe.run(questions[:2], max_new_tokens=2)  # warm-up: first-call allocations
        pipe.run(mixed[:2], max_new_tokens=2)
        for _ in range(repeats):
            for name, batch in variants.items():
                started = time.perf_counter()
                answers = pipe.run(batch, max_new_tokens=max_new_tokens, temperature=0.0)
                timings[name].append((time.perf_counter() - started, answers))
    runs = {name: _median_run(name, samples) for name, samples in timings.items()}
    report_lora(runs, model, num_questions, max_new_tokens, repeats, out)
    return runs


def _median_run(name: str, samples: list) -> Run:
    seconds, answers = sorted(samples, key=lambda s: s[0])[len(samples) // 2]
    ids = [list(a.token_ids) for a in answers]
    return Run(name, seconds, sum(map(len, ids)), ids)


def report_lora(runs: dict, model, num_questions: int, max_new_tokens: int, repeats: int, out=print) -> None:
    import torch

    out(f"model {model.name} ({model.dtype}), {num_questions} questions, <= {max_new_tokens} new tokens, "
        f"greedy, median of {repeats}, torch threads {torch.get_num_threads()}")
    out("| run | tokens | seconds | tokens/s |\n|---|---:|---:|---:|")
    for run in runs.values():
        out(f"| {run.name} | {run.tokens} | {run.seconds:.2f} | {run.rate:.1f} |")
    base, lora = runs.values()
    out(f"adapters / no adapter = {lora.rate / base.rate:.2f}x (target >= 0.70x)")


if __name__ == "__main__":
    from benchmarks.command import run_alone

    raise SystemExit(run_alone(register))
