"""`kev bench ...`: speed measured side by side in one run, printed as a table and ratios."""

from __future__ import annotations

import argparse


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks that print side-by-side ratios",
                                  description="Benchmarks. Each runs its contenders in one process, on the "
                                              "same inputs, and prints tokens/s and ratios.")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    engine = kinds.add_parser(
        "engine", help="Kev vs transformers generate (one at a time, padded batch)",
        description="(a) transformers generate one question at a time, (b) transformers generate on one "
                    "left-padded batch, (c) Kev with early eviction, (d) Kev without it; greedy. Prints "
                    "tokens/s, (c)/(a), (c)/(b), (c)/(d) and whether (c)'s answers equal (a)'s.")
    engine.add_argument("--model", default="smollm2-135m-instruct")
    engine.add_argument("--questions", type=int, default=32, help="how many of the mixed questions (default 32)")
    engine.add_argument("--max-new-tokens", type=int, default=64)
    engine.add_argument("--repeats", type=int, default=3, help="Kev runs per variant; the median is kept")
    engine.add_argument("--skip-sequential", action="store_true",
                        help="skip (a), the slowest run (minutes); (c) is then checked against (b)")
    engine.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    engine.set_defaults(func=_bench_engine)
    _add_bench_lora(kinds)
    _add_bench_scaling(kinds)
    _add_bench_kafka(kinds)


def _add_bench_lora(kinds: argparse._SubParsersAction) -> None:
    lora = kinds.add_parser(
        "lora", help="Kev with 4 LoRA adapters mixed in one batch vs no adapter",
        description="Writes random PEFT adapters (all linear targets) to a temporary folder, then runs the "
                    "same questions with no adapter and with the adapters assigned round-robin, alternating, "
                    "in one engine; greedy. Prints tokens/s of each (median of --repeats) and the ratio.")
    lora.add_argument("--model", default="smollm2-135m-instruct")
    lora.add_argument("--questions", type=int, default=32, help="how many of the mixed questions (default 32)")
    lora.add_argument("--max-new-tokens", type=int, default=64)
    lora.add_argument("--repeats", type=int, default=3, help="runs per variant; the median is kept")
    lora.add_argument("--adapters", type=int, default=4)
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    lora.set_defaults(func=_bench_lora)


def _add_bench_scaling(kinds: argparse._SubParsersAction) -> None:
    scaling = kinds.add_parser(
        "scaling", help="tokens/s against the number of questions, with a plot",
        description="For 1, 2, 4, ... 32 questions: Kev, transformers one at a time and transformers on one "
                    "padded batch (greedy). Prints a line per count and draws the curves to --output.")
    scaling.add_argument("--model", default="smollm2-135m-instruct")
    scaling.add_argument("--max-new-tokens", type=int, default=32)
    scaling.add_argument("--counts", default="1,2,4,8,16,32", help="comma-separated question counts")
    scaling.add_argument("--output", "-o", default="docs/throughput.png")
    scaling.add_argument("--threads", type=int, default=None)
    scaling.set_defaults(func=_bench_scaling)


def _add_bench_kafka(kinds: argparse._SubParsersAction) -> None:
    kafka = kinds.add_parser(
        "kafka", help="the same questions through the bare engine and through Kafka",
        description="Answer N questions with the engine alone, then publish them to an embedded broker and "
                    "read the answers back through `kev serve` (in process); prints both rates and the ratio.")
    kafka.add_argument("--model", default="smollm2-135m-instruct")
    kafka.add_argument("--questions", type=int, default=64)
    kafka.add_argument("--max-new-tokens", type=int, default=32)
    kafka.add_argument("--threads", type=int, default=None)
    kafka.set_defaults(func=_bench_kafka)


def _bench_scaling(args: argparse.Namespace) -> int:
    from engine.bench import bench_scaling
    from kev_async.bench_plots import plot_scaling

    model = _model(args)
    result = bench_scaling(model, counts=tuple(int(c) for c in args.counts.split(",")),
                           max_new_tokens=args.max_new_tokens)
    plot_scaling(result, args.output)
    print(f"plot written to {args.output}")
    return 0


def _bench_kafka(args: argparse.Namespace) -> int:
    import anyio
    import msgspec

    from kev_async.bench_plots import bench_kafka
    from schemas import KevConfig, MetricsConfig

    model = _model(args)
    cfg = msgspec.structs.replace(KevConfig(), metrics=MetricsConfig(port=0))
    anyio.run(lambda: bench_kafka(cfg, model, num_questions=args.questions, max_new_tokens=args.max_new_tokens),
              backend="asyncio")
    return 0


def _model(args: argparse.Namespace):
    from engine import load_model
    from kev_async.ask import set_threads

    set_threads(args.threads)
    return load_model(args.model)


def _bench_engine(args: argparse.Namespace) -> int:
    from engine.bench import bench_engine

    bench_engine(_model(args), num_questions=args.questions, max_new_tokens=args.max_new_tokens,
                 repeats=args.repeats, sequential=not args.skip_sequential)
    return 0


def _bench_lora(args: argparse.Namespace) -> int:
    from engine.bench import bench_lora

    bench_lora(_model(args), num_questions=args.questions, max_new_tokens=args.max_new_tokens,
               repeats=args.repeats, num_adapters=args.adapters, rank=args.rank)
    return 0
