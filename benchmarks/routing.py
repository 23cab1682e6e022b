"""`python -m benchmarks.routing`: the prefix-cache hit rate of prefix_hash against round_robin.

Two `kev serve` workers with isolation.level shared, questions with a few long system prompts sent
through `kev route` (in process) on the embedded broker, once per strategy. The hit rate is what the
workers' metrics call kev_prefix_cache_hit_rate: prompt tokens read from the cache / prompt tokens,
summed here over the answers' usage. prefix_hash sends each system prompt to one worker, whose
cache then holds fewer prefixes; round_robin makes every worker cache every prefix, so a small pool
evicts them in turn. Built on the drill's runner (kev_async/drill/) with faults off.

`python -m benchmarks.routing --semantic` reports on semantic_hash instead (benchmarks/semantic.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

from benchmarks import semantic
from schemas import DEFAULT_MODEL

# The drill (aiokafka, the broker) and structlog's set-up are imported inside the functions that use them:
# --help answers without loading them.

PERSONAS = ("a travel agent", "a legal assistant", "a cooking tutor", "a programming tutor",
            "a fitness coach", "a history teacher", "a customer support agent", "a science explainer")
PARAGRAPH = ("Follow the house style: short sentences, plain words, no lists unless asked, and cite the "
             "policy section you rely on. Refuse requests outside your scope politely and offer the "
             "nearest thing you can do. Never invent names, numbers, prices or dates. ")


def system_prompts(count: int, repeat: int = 3) -> tuple[str, ...]:
    """`count` distinct long system prompts (about 60 words per repeat), one persona each."""
    return tuple(f"You are {PERSONAS[i % len(PERSONAS)]}. " + PARAGRAPH * repeat for i in range(count))


def register(kinds: argparse._SubParsersAction) -> None:
    routing = kinds.add_parser(
        "routing", help="prefix-cache hit rate: prefix_hash vs round_robin over 2 workers; --semantic: "
                        "semantic_hash on paraphrases",
        description="Run `kev route` with each strategy in front of --workers `kev serve` workers "
                    "(isolation.level shared) on the embedded broker; questions cycle through --system-prompts "
                    "long system prompts. Prints each strategy's prefix-cache hit rate and the ratio. With "
                    "--semantic, no broker: how often semantic_hash and prefix_hash put fixed paraphrase pairs "
                    "and unrelated pairs (English, Chinese) in one of --buckets buckets, and the cost per question.")
    routing.add_argument("--model", default=DEFAULT_MODEL)
    routing.add_argument("--questions", type=int, default=64)
    routing.add_argument("--workers", type=int, default=2)
    routing.add_argument("--partitions", type=int, default=2)
    routing.add_argument("--system-prompts", type=int, default=4)
    routing.add_argument("--max-new-tokens", type=int, default=8)
    routing.add_argument("--num-blocks", type=int, default=26,
                         help="each worker's KV pool in 16-token blocks (default 26): a worker's share of the "
                              "prefixes (4 prompts / 2 workers = 2, 10 full blocks each) plus the running "
                              "questions' own blocks (2 x 3); not room for all four prefixes")
    routing.add_argument("--max-parallel", type=int, default=2, help="router.max_parallel_queries per worker: "
                                                                      "few running questions keep few prefixes alive")
    routing.add_argument("--spread", type=float, default=20.0)
    routing.add_argument("--workdir", default=".cache/bench/routing", help="where the workers' logs go "
                                                                          "(default .cache/bench/routing)")
    routing.add_argument("--semantic", action="store_true",
                         help="report semantic_hash on paraphrase pairs instead (--model's embedding layer)")
    semantic.add_arguments(routing)
    routing.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from kev_async.logs import quieted

    if args.semantic:
        return semantic.run(args)
    with quieted("warning"):
        rates = _hit_rates(args)
    ratio = rates["prefix_hash"] / rates["round_robin"] if rates["round_robin"] else float("inf")
    print(f"prefix_hash / round_robin = {ratio:.2f}x (target >= 1.8x)")
    return 0


def _hit_rates(args: argparse.Namespace) -> dict[str, float]:
    from kev_async.drill.run import DrillOptions, run_drill

    rates = {}
    for strategy in ("prefix_hash", "round_robin"):
        options = DrillOptions(
            questions=args.questions, workers=args.workers, partitions=args.partitions,
            max_new_tokens=args.max_new_tokens, spread_s=args.spread, model=args.model,
            workdir=Path(args.workdir) / strategy, faults=False, route=strategy,
            system_prompts=system_prompts(args.system_prompts),
            worker_env={"KEV_ISOLATION__LEVEL": "shared", "KEV_KV_CACHE__NUM_BLOCKS": str(args.num_blocks),
                        "KEV_ROUTER__MAX_PARALLEL_QUERIES": str(args.max_parallel)})
        result = anyio.run(run_drill, options, lambda line: None, backend="asyncio")
        rates[strategy] = result.cached_prompt_tokens / max(1, result.prompt_tokens)
        print(f"{strategy:14} hit rate {rates[strategy]:.3f} ({result.cached_prompt_tokens}/{result.prompt_tokens} "
              f"prompt tokens cached); {result.answered}/{result.questions} answered at {result.answers_per_s} "
              f"answers/s; per worker {sorted(result.by_worker.values())}")
    return rates


if __name__ == "__main__":
    from benchmarks.command import run_alone

    raise SystemExit(run_alone(register))
