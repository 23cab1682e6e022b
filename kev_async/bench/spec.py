"""`kev bench spec`: the same questions with speculative decoding off and on (ngram), side by side.

Two workloads: extraction (each prompt holds a short text and asks for it quoted back, so answers copy
their prompt: what prompt lookup is for) and open chat (the sample questions: little to copy). For each
and each concurrency: tokens/s with speculation off and ngram (greedy, median of --repeats, the two
alternating so a noisy machine slows both alike), their ratio, forwards, drafted and accepted tokens,
and whether every answer is token-identical (it must be).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kev_async.bench.arguments import positive_int
from kev_async.bench.model import bench_model
from kev_async.sample_questions import QUESTIONS
from schemas import DEFAULT_CONFIG, DEFAULT_MODEL

# torch and the engine are imported inside the functions that use them: `kev --help` imports this module.

TEXTS = [
    "Order 4471 ships on Tuesday from the Rotterdam warehouse to Anna Berg, 12 Linden Street, Uppsala.",
    "The meeting moved to Thursday at 3 pm in room 204; bring the signed budget and the Q3 sales figures.",
    "Dosage: take one 200 mg tablet twice a day with food, for seven days, and never more than four a day.",
    "The library opens at 9 am on weekdays and 10 am on Saturdays, and closes at 6 pm; it is shut on Sundays.",
]
WORKLOADS = {
    "extraction": [f"Here is a note: '{text}' Copy the note inside the quotes exactly, word for word."
                   for text in TEXTS],
    "chat": list(QUESTIONS),
}


def register(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "spec", help="speculative decoding (ngram) vs none, on extraction and chat prompts",
        description="The same greedy questions with speculative.method off and ngram, alternating, at each "
                    "concurrency: tokens/s, the ratio, forwards, drafted/accepted tokens, identical answers.")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--concurrency", default="1,4", help="comma-separated question counts (default 1,4)")
    bench.add_argument("--max-new-tokens", type=positive_int("max new tokens"), default=64)
    bench.add_argument("--max-draft-tokens", type=positive_int("max draft tokens"), default=4)
    bench.add_argument("--policy", choices=["auto", "always"], default=DEFAULT_CONFIG.speculative.policy,
                       help="speculative.policy of the ngram runs")
    bench.add_argument("--repeats", type=positive_int("repeats"), default=3, help="runs per variant; median kept")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    bench.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    counts = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit("--concurrency: one or more positive counts, e.g. 1,4")
    bench_spec(bench_model(args), counts=counts, max_new_tokens=args.max_new_tokens,
               max_draft_tokens=args.max_draft_tokens, repeats=args.repeats, policy=args.policy)
    return 0


def bench_spec(model, *, counts: list[int], max_new_tokens: int = 64, max_draft_tokens: int = 4,
               repeats: int = 3, policy: str = "auto", out=print) -> list[dict]:
    import torch

    from engine.pipeline import IsolatedBatchPipeline

    pipes = {mode: IsolatedBatchPipeline(model, max_batch_size=max(counts), speculative=mode,
                                         max_draft_tokens=max_draft_tokens, speculative_policy=policy)
             for mode in ("off", "ngram")}
    for pipe in pipes.values():
        pipe.run(QUESTIONS[:1], max_new_tokens=2, temperature=0.0)  # warm-up: first-call allocations
    out(f"model {model.name} ({model.dtype}), <= {max_new_tokens} new tokens, greedy, up to {max_draft_tokens} "
        f"drafts, policy {policy}, median of {repeats}, torch threads {torch.get_num_threads()}")
    out("| workload | questions | off tokens/s | ngram tokens/s | ngram/off | forwards off | forwards ngram | "
        "drafted | accepted | identical |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for workload, prompts in WORKLOADS.items():
        for count in counts:
            batch = [prompts[i % len(prompts)] for i in range(count)]
            runs = {"off": [], "ngram": []}
            for _ in range(repeats):
                for mode, pipe in pipes.items():
                    runs[mode].append(_timed(pipe, batch, max_new_tokens))
            row = _row(workload, count, runs)
            rows.append(row)
            out(f"| {workload} | {count} | {row['off']:.1f} | {row['ngram']:.1f} | {row['ratio']:.2f}x | "
                f"{row['forwards_off']} | {row['forwards_ngram']} | {row['drafted']} | {row['accepted']} | "
                f"{'yes' if row['identical'] else 'NO'} |")
    return rows


def _timed(pipe, batch: list[str], max_new_tokens: int) -> dict:
    core = pipe.core
    forwards, drafted, accepted = (core.num_forwards, core.scheduler.num_draft_tokens,
                                   core.scheduler.num_accepted_draft_tokens)
    started = time.perf_counter()
    answers = pipe.run(batch, max_new_tokens=max_new_tokens, temperature=0.0)
    seconds = time.perf_counter() - started
    return dict(rate=sum(a.usage.completion_tokens for a in answers) / seconds,
                forwards=core.num_forwards - forwards, drafted=core.scheduler.num_draft_tokens - drafted,
                accepted=core.scheduler.num_accepted_draft_tokens - accepted,
                tokens=[a.token_ids for a in answers])


def _row(workload: str, count: int, runs: dict[str, list[dict]]) -> dict:
    off, on = runs["off"], runs["ngram"]
    rate_off, rate_on = statistics.median(r["rate"] for r in off), statistics.median(r["rate"] for r in on)
    return dict(workload=workload, questions=count, off=rate_off, ngram=rate_on, ratio=rate_on / rate_off,
                forwards_off=off[0]["forwards"], forwards_ngram=on[0]["forwards"], drafted=on[0]["drafted"],
                accepted=on[0]["accepted"], identical=all(r["tokens"] == off[0]["tokens"] for r in off + on))
