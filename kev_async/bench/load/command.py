"""`kev bench load`'s command line: its flags, and the one-line error it prints for a setting it cannot run with."""

from __future__ import annotations

import argparse
import os
import sys

from kev_async.bench.arguments import positive_ints
from kev_async.drawing import matplotlib_missing
from schemas import DEFAULT_MODEL

DESCRIPTION = """\
Open-loop load: questions arrive by a Poisson process at --rate questions/s (or all at once with
--rate inf), whatever the system is doing, and each question's latency counts from its arrival.
The questions mix short ones with long ones (notes of up to --max-prompt-tokens tokens plus a task),
with answer budgets spread log-uniformly from --min-new-tokens to --max-new-tokens; greedy, stopping at
EOS. The same seed gives the same questions at every rate; a sweep (--rates) only rescales the gaps.

--streams N makes it a mixed load instead: N questions with long answers (--max-new-tokens each) decode
from time 0 while --questions long prompts of --max-prompt-tokens tokens arrive at --rate from 1 s on: the
inter-token gaps then show whether a prompt step stalls the streams (Kev's stall-free steps: give
--prompt-chunk-tokens 128,2048 to run both step sizes side by side).

Systems, each on the same trace, one after another:
  kev engine        Kev's async Engine in process, tokens streamed (TTFT = first streamed text); once per
                    --prompt-chunk-tokens value when several are given
  transformers      generate() with static batches: a batch starts when --hf-batch-sizes questions wait or
                    the oldest has waited --hf-batch-timeout s; nothing joins until it ends. Every size is
                    run; the one with the best goodput is reported (the others are printed and in the JSON)
  kev via kafka     with --via-kafka: the embedded broker and an in-process `kev serve` worker
  openai-compatible with --compare-url: any server with streaming /v1/chat/completions (--compare-api chat)
                    or /v1/completions with the prompt as Kev's token ids (--compare-api completions)

Reported per system: goodput (tokens of completed answers / wall time from the first arrival to the last
answer), TTFT p50/p99, end-to-end p50/p99 (s), the gaps between streamed pieces of one answer (p50, p99 and
the worst, every streamed answer pooled), and how many answers equal Kev's answer to the same question
asked alone (batch size 1, greedy; cached next to the JSON). Servers that stream only text are compared
on text.
"""


def register(kinds: argparse._SubParsersAction) -> None:
    load = kinds.add_parser("load", help="open-loop load: Poisson arrivals against Kev, transformers static "
                                         "batching and any OpenAI-compatible server",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    load.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf or built-in name")
    _add_trace_flags(load.add_argument_group("the trace"))
    _add_system_flags(load.add_argument_group("the systems"))
    _add_engine_flags(load.add_argument_group("engine options (passed to load_model / EngineOptions)"))
    out = load.add_argument_group("output")
    out.add_argument("--output-json", default=".cache/bench/load.json",
                     help="the JSON result (default .cache/bench/load.json; the solo reference cache is written "
                          "next to it)")
    out.add_argument("--plot", default=".cache/bench/load.png",
                     help="latency and goodput vs rate (default .cache/bench/load.png; --plot docs/load.png refreshes "
                          "the README's; '' = no plot)")
    out.add_argument("--no-reference", action="store_true", help="skip the solo greedy reference (no identity "
                                                                 "column; saves one sequential pass)")
    load.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores, at most 16)")
    load.set_defaults(func=_cli)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (questions/s, or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a rate must be above 0, not {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(part) for part in text.split(",") if part.strip()]


def _chunk_sizes(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts like 128,2048") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: token counts are 0 or more")
    return values


def _add_trace_flags(group) -> None:
    group.add_argument("--rate", type=_rate, default=1.0, help="offered load, questions/s; 'inf' = all at once "
                                                                "(default 1)")
    group.add_argument("--rates", type=_rates, default=None, help="a sweep, e.g. 0.5,1,2,4 (overrides --rate)")
    count = group.add_mutually_exclusive_group()
    count.add_argument("--questions", type=int, default=None, help="questions in the trace (default 256)")
    count.add_argument("--duration", type=float, default=None, help="instead: arrivals for this many seconds")
    group.add_argument("--seed", type=int, default=0, help="same seed, same questions and arrival draws")
    group.add_argument("--max-new-tokens", type=int, default=128, help="the largest answer budget (default 128)")
    group.add_argument("--min-new-tokens", type=int, default=4, help="the smallest answer budget (default 4)")
    group.add_argument("--long-fraction", type=float, default=0.4, help="share of questions with long notes "
                                                                        "(default 0.4)")
    group.add_argument("--max-prompt-tokens", type=int, default=1000, help="longest notes, in tokens (default 1000)")
    group.add_argument("--streams", type=int, default=0, metavar="N",
                       help="mixed load: N long answers decoding from time 0, then --questions long prompts of "
                            "--max-prompt-tokens at --rate (default 0: the Poisson mix)")
    group.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                       help="every question starts with one common system prompt of N tokens (default 0); "
                            "whether Kev reuses it is --isolation's choice")


def _add_system_flags(group) -> None:
    group.add_argument("--no-static", action="store_true", help="skip transformers static batching")
    group.add_argument("--hf-batch-sizes", type=positive_ints("batch sizes", "4,8,16,32"), default=[4, 8, 16, 32],
                       help="static batch sizes to try (default 4,8,16,32)")
    group.add_argument("--hf-batch-timeout", type=float, default=0.5,
                       help="s the oldest waiting question waits for a full batch (default 0.5)")
    group.add_argument("--via-kafka", action="store_true", help="also Kev through the embedded broker")
    group.add_argument("--compare-url", default=None, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8080")
    group.add_argument("--compare-api", choices=("chat", "completions"), default="chat",
                       help="chat: messages to /v1/chat/completions; completions: Kev's prompt token ids to "
                            "/v1/completions (default chat)")
    group.add_argument("--compare-api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else none)")
    group.add_argument("--compare-model", default=None, help="model name to send (default: the first of /v1/models)")
    group.add_argument("--compare-name", default=None,
                       help="what to call that server in tables and plots, e.g. 'llama.cpp F32' (default "
                            "'openai-compatible URL')")
    group.add_argument("--compare-body", default=None, metavar="JSON",
                       help='extra fields for every request, e.g. \'{"cache_prompt": false}\' for llama-server')


def _add_engine_flags(group) -> None:
    group.add_argument("--kev-batch-size", type=int, default=32, help="Kev's max_parallel_queries (default 32)")
    group.add_argument("--kv-mib", type=int, default=None, help="Kev's KV pool budget in MiB (default: the engine's)")
    group.add_argument("--max-tokens-per-step", type=int, default=None,
                       help="Kev's token budget per forward; longer prompts are prefilled in chunks (default: "
                            "the engine's)")
    group.add_argument("--dtype", default=None, help="weights/activations precision for load_model, e.g. fp32, bf16")
    group.add_argument("--weights", default=None, help="weight quantisation, e.g. int8 (where Kev has it)")
    group.add_argument("--kv-dtype", default=None, help="KV cache precision: auto (the compute dtype; fp16 for a "
                                                        "GGUF kept as stored under fp32), compute, fp16 or int8")
    group.add_argument("--matmul", default=None, choices=("auto", "row_linear", "library"),
                       help="core.matmul: the CPU kernel for weight matmuls (default: auto)")
    group.add_argument("--prompt-chunk-tokens", type=_chunk_sizes, default=None, metavar="N[,N...]",
                       help="scheduler.prompt_chunk_tokens: the prompt a step carries while others decode (0: no "
                            "limit); several values run Kev once with each, side by side (default: the engine's)")
    group.add_argument("--deterministic", action="store_true", default=None,
                       help="isolation.deterministic: bitwise-identical logits whatever shares the forward")
    group.add_argument("--speculative", choices=("off", "ngram", "draft_model"), default=None,
                       help="speculative.method for Kev's engine, with speculative.policy auto (default: off)")
    group.add_argument("--isolation", choices=("strict", "shared"), default="strict",
                       help="shared: Kev reuses cached full prompt blocks (prefix cache, EngineOptions."
                            "prefix_caching); pair it with --shared-prefix (default strict)")


def _cli(args: argparse.Namespace) -> int:
    # The run imports torch, transformers and the engine: loaded for a run, not for `kev --help`.
    from kev_async.bench.load.run import LoadBenchError, run_load

    if args.plot and matplotlib_missing("kev bench load", "--plot '' for no plot"):
        return 2
    try:
        run_load(args)
    except LoadBenchError as exc:
        print(f"kev bench load: error: {exc}", file=sys.stderr)
        return 2
    return 0
