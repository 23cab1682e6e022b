"""`kev bench kafka --exactly-once`: the same questions through Kafka with kafka.delivery at_least_once and
exactly_once, in pairs of alternating order, each on a fresh broker, read by an eager read_committed reader."""

from __future__ import annotations

import math
import os
import statistics

import msgspec

from kev_async.bench.kafka_paths import PathRun, arrival_offsets, bench_questions, through_kafka
from kev_async.bench.machine import cpu_name
from schemas import KevConfig


async def compare_delivery(cfg: KevConfig, model, *, num_questions: int, max_new_tokens: int,
                           rate: float = math.inf, repeats: int = 3, out=print) -> dict:
    """at_least_once against exactly_once through Kafka, `repeats` pairs in alternating order, each on a fresh
    broker and read by an eager read_committed reader; prints each run, the pairs' ratios and their medians."""
    questions = bench_questions(num_questions, max_new_tokens)
    offsets = arrival_offsets(num_questions, rate)
    runs: dict[str, list[PathRun]] = {"at_least_once": [], "exactly_once": []}
    for pair in range(repeats):
        for delivery in (("at_least_once", "exactly_once") if pair % 2 == 0 else ("exactly_once", "at_least_once")):
            served = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, delivery=delivery))
            runs[delivery].append(await through_kafka(served, model, questions, offsets, 1, at_reader=True))
    arrivals = "all at once" if math.isinf(rate) else f"{rate:g}/s"
    out(f"{cpu_name()}, {os.cpu_count()} cores; model {model.name}, {num_questions} questions ({arrivals}), <= {max_new_tokens} new tokens, "
        f"greedy; kafka.transaction_ms {cfg.kafka.transaction_ms}, commit_every {cfg.kafka.commit_every}; "
        f"{repeats} pairs, alternating order")
    return {**delivery_report(runs["at_least_once"], runs["exactly_once"], out=out), "runs": runs}


def delivery_report(least: list[PathRun], exactly: list[PathRun], *, out=print) -> dict:
    """The runs of each mode pair by pair, exactly_once over at_least_once per pair (goodput, e2e p50 and
    p99 at the reader) and the medians of those ratios against the targets; a run with an error answer (a
    deadline missed on a starved host) is named, since its figures are not the delivery's cost."""
    out("| pair | delivery | tokens | errors | seconds | goodput tokens/s | e2e p50 ms | e2e p99 ms |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|")
    for pair, both in enumerate(zip(least, exactly)):
        for delivery, run in zip(("at_least_once", "exactly_once"), both):
            out(f"| {pair} | {delivery} | {run.completion_tokens} | {run.errors} | {run.seconds:.2f} | "
                f"{run.tokens_per_s:.1f} | {run.percentile(50) * 1000:.0f} | {run.percentile(99) * 1000:.0f} |")
    ratios = {"goodput": [e.tokens_per_s / a.tokens_per_s for a, e in zip(least, exactly)],
              "e2e_p50": [e.percentile(50) / a.percentile(50) for a, e in zip(least, exactly)],
              "e2e_p99": [e.percentile(99) / a.percentile(99) for a, e in zip(least, exactly)]}
    medians = {name: statistics.median(values) for name, values in ratios.items()}
    out("exactly_once / at_least_once per pair: "
        + "; ".join(f"{name.replace('_', ' ')} {', '.join(f'{v:.3f}' for v in values)}"
                    for name, values in ratios.items()))
    out(f"medians: goodput {medians['goodput']:.3f}x (target >= 0.95), e2e p50 {medians['e2e_p50']:.3f}x, "
        f"e2e p99 {medians['e2e_p99']:.3f}x (target <= 1.3)")
    every = least + exactly
    same = sum(all(run.tokens.get(q) == tokens for run in every) for q, tokens in every[0].tokens.items())
    out(f"answers identical in every run: {same}/{len(every[0].tokens)}")
    errored = [f"{delivery} pair {pair}" for delivery, runs in (("at_least_once", least), ("exactly_once", exactly))
               for pair, run in enumerate(runs) if run.errors]
    if errored:
        out(f"runs with error answers (not the delivery's cost; rerun on a quieter host): {', '.join(errored)}")
    return {**medians, "pairs": ratios, "identical": same, "errored": errored}
