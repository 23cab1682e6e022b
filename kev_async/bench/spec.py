"""`kev bench spec`: the same questions with speculative decoding off, ngram and draft_model, side by side.

Three workloads: extraction (each prompt holds a short note and asks for it quoted back: answers copy
their prompt, what prompt lookup is for), code editing (a small function rewritten with one change:
most of the answer is the function again) and open chat (the sample questions: little to copy). For
each workload and concurrency, every method runs the same greedy questions, the methods alternating
within each repeat so a noisy machine slows them alike; it prints tokens/s (median of --repeats), each
method's ratio to off, forwards, accepted/drafted tokens, and whether every answer is token-identical
to off's (it must be).
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
FUNCTIONS = [
    ("def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
     "    return total", "rename the variable total to subtotal"),
    ("def greet(name):\n    if not name:\n        return 'Hello, stranger!'\n    return 'Hello, ' + name + '!'",
     "make it say Hi instead of Hello"),
    ("def is_even(number):\n    remainder = number % 2\n    return remainder == 0", "rename number to value"),
    ("def average(values):\n    if len(values) == 0:\n        return 0\n    return sum(values) / len(values)",
     "return None instead of 0 for an empty list"),
]
WORKLOADS = {
    "extraction": [f"Here is a note: '{text}' Copy the note inside the quotes exactly, word for word."
                   for text in TEXTS],
    "code": [f"Rewrite this Python function with one change: {change}. Reply with the whole function only.\n\n"
             f"{code}" for code, change in FUNCTIONS],
    "chat": list(QUESTIONS),
}
METHODS = ("off", "ngram", "draft_model")


def register(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "spec", help="speculative decoding: off vs ngram vs draft model, on extraction, code edits and chat",
        description="The same greedy questions with speculative.method off, ngram and draft_model, alternating, "
                    "at each concurrency: tokens/s, each method's ratio to off, forwards, accepted/drafted "
                    "tokens, identical answers.")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--concurrency", default="1,4",
                       help="comma-separated question counts (default 1,4; the issue's set: 1,4,16,64)")
    bench.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    bench.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of off, ngram, draft_model")
    bench.add_argument("--max-new-tokens", type=positive_int("max new tokens"), default=64)
    bench.add_argument("--max-draft-tokens", type=positive_int("max draft tokens"), default=4)
    bench.add_argument("--policy", choices=["auto", "always"], default=DEFAULT_CONFIG.speculative.policy,
                       help="speculative.policy of the speculative runs")
    bench.add_argument("--draft-model", default=None, help="speculative.draft_model (same tokenizer)")
    bench.add_argument("--draft-layers", type=positive_int("draft layers"), default=None,
                       help="speculative.draft_layers (default without --draft-model: half the target's layers)")
    bench.add_argument("--repeats", type=positive_int("repeats"), default=2, help="runs per variant; median kept")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    bench.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    counts = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit("--concurrency: one or more positive counts, e.g. 1,4")
    workloads = _choice(args.workloads, WORKLOADS, "--workloads")
    methods = _choice(args.methods, METHODS, "--methods")
    if "off" not in methods:
        methods = ["off", *methods]  # the ratios are against it
    bench_spec(bench_model(args), counts=counts, workloads=workloads, methods=methods,
               max_new_tokens=args.max_new_tokens, max_draft_tokens=args.max_draft_tokens, repeats=args.repeats,
               policy=args.policy, draft_model=args.draft_model, draft_layers=args.draft_layers)
    return 0


def _choice(text: str, known, flag: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in known]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: {', '.join(unknown) or 'nothing'} not one of {', '.join(known)}")
    return chosen


def bench_spec(model, *, counts: list[int], workloads: list[str] = list(WORKLOADS), methods: list[str] = list(METHODS),
               max_new_tokens: int = 64, max_draft_tokens: int = 4, repeats: int = 2, policy: str = "auto",
               draft_model: str | None = None, draft_layers: int | None = None, out=print) -> list[dict]:
    import torch

    if draft_model is None and draft_layers is None:
        draft_layers = max(1, model.spec.num_layers // 2)
    pipes = {method: _pipeline(model, method, max(counts), max_draft_tokens, policy, draft_model, draft_layers)
             for method in methods}
    for pipe in pipes.values():
        pipe.run(QUESTIONS[:1], max_new_tokens=2, temperature=0.0)  # warm-up: first-call allocations
    draft = f"{draft_model or model.name}{f'[:{draft_layers} layers]' if draft_layers else ''}"
    out(f"model {model.name} ({model.dtype}), <= {max_new_tokens} new tokens, greedy, up to {max_draft_tokens} "
        f"drafts, policy {policy}, draft model {draft}, median of {repeats}, torch threads {torch.get_num_threads()}")
    spec = [m for m in methods if m != "off"]
    out("| workload | questions | off tokens/s | " + " | ".join(f"{m} tokens/s | {m}/off | {m} accepted/drafted"
                                                          for m in spec)
        + " | forwards (" + " / ".join(methods) + ") | identical |")
    out("|---|---:|---:|" + "---:|---:|---:|" * len(spec) + "---:|---|")
    rows = []
    for workload in workloads:
        prompts = WORKLOADS[workload]
        for count in counts:
            batch = [prompts[i % len(prompts)] for i in range(count)]
            runs = {method: [] for method in methods}
            for _ in range(repeats):
                for method, pipe in pipes.items():
                    runs[method].append(_timed(pipe, batch, max_new_tokens))
            row = _row(workload, count, runs)
            rows.append(row)
            out(_line(row, methods))
    return rows


def _pipeline(model, method: str, batch: int, max_draft_tokens: int, policy: str, draft_model, draft_layers):
    from engine.pipeline import IsolatedBatchPipeline

    extra = dict(draft_model=draft_model, draft_layers=draft_layers) if method == "draft_model" else {}
    return IsolatedBatchPipeline(model, max_batch_size=batch, speculative=method, max_draft_tokens=max_draft_tokens,
                                 speculative_policy=policy, **extra)


def _timed(pipe, batch: list[str], max_new_tokens: int) -> dict:
    core = pipe.core
    forwards, drafted, accepted = core.num_forwards, _drafted(core), _accepted(core)
    started = time.perf_counter()
    answers = pipe.run(batch, max_new_tokens=max_new_tokens, temperature=0.0)
    seconds = time.perf_counter() - started
    return dict(rate=sum(a.usage.completion_tokens for a in answers) / seconds,
                forwards=core.num_forwards - forwards, drafted=_drafted(core) - drafted,
                accepted=_accepted(core) - accepted,
                tokens=[a.token_ids for a in answers])


def _drafted(core) -> int:
    speculation = core.scheduler.speculation
    return speculation.num_draft_tokens if speculation is not None else 0


def _accepted(core) -> int:
    speculation = core.scheduler.speculation
    return speculation.num_accepted_draft_tokens if speculation is not None else 0


def _row(workload: str, count: int, runs: dict[str, list[dict]]) -> dict:
    off = runs["off"]
    row = dict(workload=workload, questions=count, identical=True, methods={})
    base = statistics.median(r["rate"] for r in off)
    for method, results in runs.items():
        rate = statistics.median(r["rate"] for r in results)
        row["methods"][method] = dict(rate=rate, ratio=rate / base, forwards=results[0]["forwards"],
                                      drafted=results[0]["drafted"], accepted=results[0]["accepted"])
        row["identical"] &= all(r["tokens"] == off[0]["tokens"] for r in results)
    return row


def _line(row: dict, methods: list[str]) -> str:
    cells = [row["workload"], str(row["questions"]), f"{row['methods']['off']['rate']:.1f}"]
    for method in methods[1:]:
        m = row["methods"][method]
        cells += [f"{m['rate']:.1f}", f"{m['ratio']:.2f}x", f"{m['accepted']}/{m['drafted']}"]
    cells += [" / ".join(str(row["methods"][m]["forwards"]) for m in methods), "yes" if row["identical"] else "NO"]
    return "| " + " | ".join(cells) + " |"
