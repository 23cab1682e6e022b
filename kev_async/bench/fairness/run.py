"""One `kev bench fairness` invocation: each scenario under each policy on each path (in process, through Kafka),
one after another in this process, then a table per scenario and path, the two paths side by side, the ratios
against the targets, and the JSON result."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from engine import EngineOptions, load_model
from kev_async.bench.fairness.in_process import Outcome, Samples, run_in_process
from kev_async.bench.fairness.scenarios import Scenario, backlogs, flood
from kev_async.bench.machine import run_stamp
from kev_async.settings import set_threads
from schemas import KevConfig
from schemas.config import TenantConfig

WEIGHTS = ((1.0, 1.0), (3.0, 1.0))
PATHS = ("in process", "through Kafka")


def run_fairness(args: argparse.Namespace, scenarios: list[str], paths: list[str], out=print) -> dict:
    set_threads(args.threads)
    model = load_model(args.model)
    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), **run_stamp(), "torch_threads": torch.get_num_threads(),
              "model": model.name, "args": {k: v for k, v in vars(args).items() if k != "func"}}
    out(f"model {model.name} ({model.dtype}), {result['cpu']}, torch threads {result['torch_threads']}, "
        f"batch {args.batch_size}")
    if "through Kafka" in paths:
        kafka = _kafka_base(args)
        out(f"through Kafka: kev serve in this process, embedded broker, {kafka.kafka.partitions} partitions, "
            f"kafka.read_ahead {kafka.kafka.read_ahead} per partition, router.channel_pool_size "
            f"{kafka.router.channel_pool_size}; questions keyed by id, signed per tenant")
    runners = {path: _runner(path, model, args) for path in paths}
    if "flood" in scenarios:
        result["flood"] = {path: _flood(run, args, path, out) for path, run in runners.items()}
        _flood_side_by_side(result["flood"], out)
    if "shares" in scenarios:
        result["shares"] = {path: _shares(run, args, path, out) for path, run in runners.items()}
        _shares_side_by_side(result["shares"], out)
    target = Path(args.output_json)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1, default=str))
    out(f"result written to {target}")
    return result


def _runner(path: str, model, args) -> Callable[..., tuple[list[Outcome], Samples]]:
    """How `path` runs a scenario under a policy; `sample=True` where the scheduler's service is read."""
    if path == "in process":
        return lambda scenario, policy, sample=False: run_in_process(model, _options(args, policy, scenario),
                                                                     scenario)
    from kev_async.bench.fairness.through_kafka import kafka_path

    return kafka_path(model, _kafka_base(args))


def _options(args, policy: str, scenario: Scenario) -> EngineOptions:
    tenants = {name: TenantConfig(weight=weight) for name, weight in scenario.weights.items()}
    steps = {name: getattr(args, name) for name in ("max_tokens_per_step", "prompt_chunk_tokens")
             if getattr(args, name, None) is not None}
    return EngineOptions(max_parallel_queries=args.batch_size, policy=policy, tenants=tenants, **steps)


def _kafka_base(args) -> KevConfig:
    """The worker's config: the in-process path's engine knobs, the channel pool and the read-ahead window."""
    cfg = KevConfig()
    replace = msgspec.structs.replace
    steps = {name: getattr(args, name) for name in ("max_tokens_per_step", "prompt_chunk_tokens")
             if getattr(args, name, None) is not None}
    return replace(cfg, router=replace(cfg.router, max_parallel_queries=args.batch_size,
                                       channel_pool_size=args.channel_pool_size or 4 * args.batch_size),
                   scheduler=replace(cfg.scheduler, **steps),
                   kafka=replace(cfg.kafka, read_ahead=args.read_ahead or args.batch_size))


def _flood(run, args, path: str, out) -> dict:
    scenario = flood(args.flood, args.flood_tokens, args.small, args.small_tokens, args.after)
    out(f"\n== flood, {path}: bulk asks {args.flood} questions ({args.flood_tokens} tokens each) at once, chat "
        f"{args.small} ({args.small_tokens} tokens) {args.after:g} s later")
    out("running: chat alone")
    alone, _ = run(scenario.only("chat"), "fair")
    runs = {}
    for policy in ("fcfs", "fair"):
        out(f"running: policy {policy}")
        runs[policy], _ = run(scenario, policy)
    chat_alone = _median_latency(alone, "chat")
    rows = {policy: {"chat_median_s": _median_latency(outcomes, "chat"), "bulk_goodput_tps": _goodput(outcomes, "bulk"),
                     "errors": sum(o.error is not None for o in outcomes)} for policy, outcomes in runs.items()}
    for row in rows.values():
        row["chat_vs_alone"] = row["chat_median_s"] / chat_alone
        row["bulk_vs_fcfs"] = row["bulk_goodput_tps"] / rows["fcfs"]["bulk_goodput_tps"]
    identical = _same_tokens(runs["fcfs"], runs["fair"]) and _same_tokens(alone, runs["fair"])
    out("| policy | chat median s | chat vs alone | bulk goodput tok/s | bulk vs FCFS | errors |")
    out("|---|---:|---:|---:|---:|---:|")
    out(f"| chat alone | {chat_alone:.2f} | 1.00x | - | - | {sum(o.error is not None for o in alone)} |")
    for policy, row in rows.items():
        out(f"| {policy} | {row['chat_median_s']:.2f} | {row['chat_vs_alone']:.2f}x | {row['bulk_goodput_tps']:.1f} "
            f"| {row['bulk_vs_fcfs']:.2f}x | {row['errors']} |")
    fair = rows["fair"]
    out(f"fair: chat's median latency {fair['chat_vs_alone']:.2f}x alone (target <= 2x), bulk's goodput "
        f"{fair['bulk_vs_fcfs']:.2f}x FCFS's (target >= 0.95x); answers identical under every policy: {identical}")
    return {"chat_alone_median_s": chat_alone, "policies": rows, "identical": identical,
            "answers": {o.qid: o.token_ids for o in runs["fair"]}}


def _flood_side_by_side(by_path: dict, out) -> None:
    out("\n== flood, side by side (policy fair)")
    out("| path | chat alone s | chat under the flood s | chat vs alone | bulk vs FCFS | identical |")
    out("|---|---:|---:|---:|---:|---|")
    for path, r in by_path.items():
        fair = r["policies"]["fair"]
        out(f"| {path} | {r['chat_alone_median_s']:.2f} | {fair['chat_median_s']:.2f} | {fair['chat_vs_alone']:.2f}x "
            f"| {fair['bulk_vs_fcfs']:.2f}x | {r['identical']} |")
    if len(by_path) == 2:
        one, other = (r["answers"] for r in by_path.values())
        out(f"answers identical in process and through Kafka: {sum(one[q] == other.get(q) for q in one)}/{len(one)}")


def _shares(run, args, path: str, out) -> dict:
    results = []
    for weights in WEIGHTS:
        scenario = backlogs(args.backlog, args.backlog_tokens, weights)
        out(f"\n== {scenario.name}, {path}: tenants a and b ask {args.backlog} questions each at once "
            f"({args.backlog_tokens} tokens each)")
        out(f"running: policy fair, weights a {weights[0]:g}, b {weights[1]:g}")
        outcomes, samples = run(scenario, "fair", sample=True)
        served = _served_while_both_wait(samples, ("a", "b"))
        promised = weights[0] / weights[1]
        got = served["a"] / served["b"] if served["b"] else float("inf")
        results.append({"weights": weights, "served": served, "ratio": got, "promised": promised,
                        "off_by": got / promised - 1, "window_s": served["window_s"],
                        "errors": sum(o.error is not None for o in outcomes)})
    out("\n| weights a:b | a tokens | b tokens | served a:b | promised | off by | window s |")
    out("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        out(f"| {r['weights'][0]:g}:{r['weights'][1]:g} | {r['served']['a']} | {r['served']['b']} | {r['ratio']:.2f} "
            f"| {r['promised']:.2f} | {100 * r['off_by']:+.1f}% | {r['window_s']:.1f} |")
    out("service (tokens prefilled and decoded) while both tenants had questions waiting; target: within 10% of "
        "the weights")
    return {"runs": results}


def _shares_side_by_side(by_path: dict, out) -> None:
    out("\n== shares, side by side: served a:b against the weights (target: within 10%)")
    out("| path | " + " | ".join(f"{a:g}:{b:g}" for a, b in WEIGHTS) + " |")
    out("|---|" + "---:|" * len(WEIGHTS))
    for path, r in by_path.items():
        out(f"| {path} | " + " | ".join(f"{run['ratio']:.2f} ({100 * run['off_by']:+.1f}%)" for run in r["runs"]) + " |")


def _median_latency(outcomes: list[Outcome], tenant: str) -> float:
    return statistics.median(o.finished_s - o.arrival_s for o in outcomes if o.tenant == tenant)


def _goodput(outcomes: list[Outcome], tenant: str) -> float:
    """`tenant`'s answer tokens per second, from the scenario's start to its last answer."""
    mine = [o for o in outcomes if o.tenant == tenant and o.error is None]
    return sum(o.tokens for o in mine) / max(o.finished_s for o in mine)


def _same_tokens(one: list[Outcome], other: list[Outcome]) -> bool:
    theirs = {o.qid: o.token_ids for o in other}
    return all(theirs.get(o.qid) == o.token_ids for o in one)


def _served_while_both_wait(samples: Samples, tenants: tuple[str, str]) -> dict:
    """Tokens computed for each tenant between the first and the last sample where both had questions waiting."""
    both = [(t, report) for t, report in samples.points
            if all(report.get(name, {}).get("waiting", 0) > 0 for name in tenants)]
    if len(both) < 2:
        return {**dict.fromkeys(tenants, 0), "window_s": 0.0}
    (t0, first), (t1, last) = both[0], both[-1]
    return {**{name: last[name]["served"] - first[name]["served"] for name in tenants}, "window_s": t1 - t0}
