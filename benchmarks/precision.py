"""`python -m benchmarks.precision`: fp32 against bf16, int8 weights and int8 KV on the same model and questions.

Per variant: tokens/s (Kev, all questions at once, greedy), weights MiB, KV bytes per token and
tokens per MiB of KV pool, how many answers are token-identical to fp32's, and the largest
difference of the first step's logits from fp32's. The variants' runs are interleaved (one run of
each, then again), so a noisy machine slows them alike; the median run is kept.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from kev_async.bench.machine import cpu_name
from kev_async.sample_questions import QUESTIONS
from kev_async.settings import set_threads
from schemas import DEFAULT_MODEL

# torch and the engine are imported inside the functions that use them: --help answers without loading them.

VARIANTS = {  # name -> (load_model dtype, load_model weights, EngineOptions.kv_dtype)
    "fp32": ("fp32", "full", "auto"),
    "bf16": ("bf16", "full", "auto"),
    "int8-weights": ("fp32", "int8", "auto"),
    "int8-kv": ("fp32", "full", "int8"),
    "bf16-int8-weights": ("bf16", "int8", "auto"),
    # a GGUF in block formats Kev runs as stored (weights: auto; any other model loads these in full)
    "gguf": ("fp32", "auto", "auto"),
    "bf16-gguf": ("bf16", "auto", "auto"),
}
DEFAULT_VARIANTS = ("fp32", "bf16", "int8-weights", "int8-kv")


def register(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "precision", help="fp32 vs bf16, int8 weights, int8 KV: speed, memory, agreement",
        description="Kev in each precision on the same questions, runs interleaved: tokens/s, weights MiB, "
                    "KV bytes/token, answers token-identical to fp32's, max first-step logit difference.")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--questions", type=int, default=32, help="how many of the mixed questions (default 32)")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per variant; the median is kept")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    bench.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                       help=f"comma-separated, fp32 first, of {', '.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    bench.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or names[0] != "fp32":
        print(f"python -m benchmarks.precision: error: --variants must start with fp32 and name only {', '.join(VARIANTS)}")
        return 2
    set_threads(args.threads)
    bench_precision(args.model, names, num_questions=args.questions, max_new_tokens=args.max_new_tokens,
                    repeats=args.repeats)
    return 0


@dataclass
class Variant:
    name: str
    pipe: object
    model: object
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    answers: list[list[int]] = field(default_factory=list)
    first_logits: list = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / statistics.median(self.seconds)


def bench_precision(model_name: str, names: list[str], *, num_questions: int = 32, max_new_tokens: int = 64,
                    repeats: int = 3, out=print) -> dict:
    from engine.prompt import as_question

    questions = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:num_questions])]
    variants = [_variant(model_name, name, len(questions)) for name in names]
    for variant in variants:
        variant.pipe.run(questions[:2], max_new_tokens=2)  # warm-up: first-call allocations
        variant.first_logits = _first_logits(variant.pipe, questions)
    for _ in range(repeats):
        for variant in variants:
            started = time.perf_counter()
            answers = variant.pipe.run(questions, max_new_tokens=max_new_tokens, temperature=0.0)
            variant.seconds.append(time.perf_counter() - started)
            variant.answers = [list(a.token_ids) for a in answers]
            variant.tokens = sum(map(len, variant.answers))
    rows = _rows(variants)
    _report(rows, model_name, len(questions), max_new_tokens, out)
    return rows


def _variant(model_name: str, name: str, batch: int) -> Variant:
    from engine import EngineOptions, load_model
    from engine.pipeline import IsolatedBatchPipeline

    dtype, weights, kv_dtype = VARIANTS[name]
    model = load_model(model_name, dtype=dtype, weights=weights)
    pipe = IsolatedBatchPipeline(model, max_batch_size=batch, options=EngineOptions(kv_dtype=kv_dtype))
    return Variant(name, pipe, model)


def _first_logits(pipe, questions) -> list:
    """Each question's logits of its first generated token, computed solo."""
    weights, captured = pipe.core.runner.weights, []

    def logits(hidden):
        result = type(weights).logits(weights, hidden)
        captured.append(result[0].float().clone())
        return result

    weights.logits = logits  # on this engine's own copy of the weights; removed below
    try:
        for question in questions:
            pipe.run([question], max_new_tokens=1, temperature=0.0)
    finally:
        del weights.logits
    return captured


def _rows(variants: list[Variant]) -> list[dict]:
    import torch

    base = variants[0]
    rows = []
    for v in variants:
        core = v.pipe.core
        kv_per_token = core.kv.nbytes // (core.kv.num_blocks * core.kv.block_size)
        same = sum(a == b for a, b in zip(v.answers, base.answers))
        agree = [_common_prefix(a, b) for a, b in zip(v.answers, base.answers) if a != b]
        diff = max((a - b).abs().max().item() for a, b in zip(v.first_logits, base.first_logits))
        rows.append(dict(variant=v.name, dtype=str(v.model.dtype).removeprefix("torch."),
                         tokens_per_s=v.rate, speedup=v.rate / base.rate,
                         weights_mib=v.model.weights.nbytes / 2**20, kv_bytes_per_token=kv_per_token,
                         kv_tokens_per_mib=2**20 / kv_per_token, identical=same, questions=len(v.answers),
                         max_first_logit_diff=diff, diverge_median=statistics.median(agree) if agree else None,
                         kv_dtype=str(core.kv.k.dtype).removeprefix("torch.")))
    del torch
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _report(rows: list[dict], model_name: str, questions: int, max_new_tokens: int, out) -> None:
    import torch

    out(f"model {model_name}, {questions} questions at once, <= {max_new_tokens} new tokens, greedy, "
        f"torch threads {torch.get_num_threads()}, {cpu_name()}")
    out("| variant | compute | KV | tokens/s | x fp32 | weights MiB | KV bytes/token | KV tokens/MiB | "
        "identical to fp32 | others diverge at token (median) | max first-step logit diff |")
    out("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        diverge = "-" if r["diverge_median"] is None else f"{r['diverge_median']:.0f}"
        out(f"| {r['variant']} | {r['dtype']} | {r['kv_dtype']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
            f"{r['weights_mib']:.0f} | {r['kv_bytes_per_token']} | {r['kv_tokens_per_mib']:.0f} | "
            f"{r['identical']}/{r['questions']} | {diverge} | "
            f"{r['max_first_logit_diff']:.3f} |")


if __name__ == "__main__":
    from benchmarks.command import run_alone

    raise SystemExit(run_alone(register))
