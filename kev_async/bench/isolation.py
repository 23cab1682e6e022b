"""`kev bench isolation`: is each answer the same alone and packed, at each precision and matmul kernel?

Isolation is Kev's promise: a question's answer does not depend on what shares its forward. Per
variant (precision, KV precision, matmul kernel) the load trace's questions are answered one at a
time, then all at once beside long neighbours that push prompts into chunks, greedy and seeded; the
table counts answers token-identical to their solo run. Default mode promises the greedy answer; the
seeded ones draw from the same noise, so they too should only move where logits move.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from kev_async.bench.machine import cpu_name
from kev_async.settings import set_threads
from schemas import DEFAULT_MODEL, Params, QuestionEvent

# torch and the engine are imported inside the functions that use them: `kev --help` imports this module.

VARIANTS = {  # name -> (precision, KV dtype, core.matmul, core.weights)
    "fp32": ("fp32", "auto", "row_linear", "full"),
    "bf16": ("bf16", "auto", "row_linear", "full"),
    "int8-kv": ("fp32", "int8", "row_linear", "full"),
    "bf16-library": ("bf16", "auto", "library", "full"),
    "int8-kv-library": ("fp32", "int8", "library", "full"),
    "bf16-int8-kv": ("bf16", "int8", "row_linear", "full"),
    "int8-weights": ("fp32", "auto", "row_linear", "int8"),
    "int8-weights-library": ("fp32", "auto", "library", "int8"),
    # a GGUF's matrices kept in its block formats (core.weights: auto; "full" on a model that has none)
    "gguf": ("fp32", "auto", "row_linear", "auto"),
    "bf16-gguf": ("bf16", "auto", "row_linear", "auto"),
}
NEIGHBOURS = 4  # long neighbours packed beside the trace
NEIGHBOUR_TOKENS = 900  # their contexts' tokens (less on a model with fewer positions)


def register(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "isolation", help="answers alone vs packed, per precision and matmul kernel",
        description="The load trace's questions answered alone, then packed beside long neighbours, in each "
                    "variant; counts greedy and seeded answers token-identical to their solo run.")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--questions", type=int, default=24, help="greedy trace questions (default 24)")
    bench.add_argument("--seeded", type=int, default=6, help="of those, also asked seeded at temperature 0.8 "
                                                             "(default 6)")
    bench.add_argument("--max-new-tokens", type=int, default=48, help="answer budget cap (default 48)")
    bench.add_argument("--variants", default="fp32,bf16,int8-kv",
                       help=f"comma-separated of {', '.join(VARIANTS)} (default fp32,bf16,int8-kv)")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    bench.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"kev bench isolation: error: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
        return 2
    set_threads(args.threads)
    bench_isolation(args.model, names, num_questions=args.questions, seeded=args.seeded,
                    max_new_tokens=args.max_new_tokens)
    return 0


def questions(tokenizer, count: int, seeded: int, max_new_tokens: int, positions: int) -> tuple[list, list]:
    """(the trace's questions, greedy then `seeded` of them seeded; the long neighbours), every prompt
    short enough for a model of `positions` positions."""
    from kev_async.bench.load.trace import MixSpec, QuestionMix, build_trace

    longest = min(NEIGHBOUR_TOKENS, positions - max_new_tokens - 64)  # room for the template and the answer
    spec = MixSpec(max_new_tokens=max_new_tokens, max_prompt_tokens=longest, min_long_tokens=min(150, longest))
    trace = build_trace(tokenizer, rate=float("inf"), seed=0, spec=spec, count=count)
    asked = [QuestionEvent(question_id=q.qid, prompt=q.prompt, system=q.system,
                           params=Params(max_new_tokens=q.max_new_tokens, temperature=0.0)) for q in trace]
    asked += [QuestionEvent(question_id=f"{q.qid}-seeded", prompt=q.prompt, system=q.system,
                            params=Params(max_new_tokens=q.max_new_tokens, temperature=0.8, top_p=0.95, seed=i))
              for i, q in enumerate(trace[:seeded])]
    mix = QuestionMix(tokenizer, spec)
    rng = random.Random("neighbours")
    neighbours = [QuestionEvent(question_id=f"neighbour-{i}", prompt=mix.long_prompt(longest, rng),
                                params=Params(max_new_tokens=max_new_tokens, temperature=0.0))
                  for i in range(NEIGHBOURS)]
    return asked, neighbours


def bench_isolation(model_name: str, names: list[str], *, num_questions: int = 24, seeded: int = 6,
                    max_new_tokens: int = 48, out=print) -> list[dict]:
    rows = []
    for name in names:
        started = time.perf_counter()
        rows.append(_variant(model_name, name, num_questions, seeded, max_new_tokens))
        rows[-1]["seconds"] = time.perf_counter() - started
        out(f"{name}: done in {rows[-1]['seconds']:.0f} s")
    _report(rows, model_name, out)
    return rows


def _variant(model_name: str, name: str, count: int, seeded: int, max_new_tokens: int) -> dict:
    from engine import EngineOptions, IsolatedBatchPipeline, load_model

    precision, kv_dtype, kernel, weights = VARIANTS[name]
    model = load_model(model_name, dtype=precision, matmul=kernel, weights=weights)
    asked, neighbours = questions(model.tokenizer, count, seeded, max_new_tokens, model.spec.max_position)
    options = EngineOptions(kv_dtype=kv_dtype, batch_window_ms=0.0)
    solo_pipe = IsolatedBatchPipeline(model, max_batch_size=1, options=options)
    solo = {q.question_id: list(solo_pipe.run([q])[0].token_ids) for q in asked}
    packed_pipe = IsolatedBatchPipeline(model, max_batch_size=len(asked) + len(neighbours),
                                        options=dataclasses.replace(options))
    batch = neighbours[:2] + asked + neighbours[2:]
    packed = {a.question_id: list(a.token_ids) for a in packed_pipe.run(batch)}
    greedy = [q.question_id for q in asked if not q.question_id.endswith("-seeded")]
    sampled = [q.question_id for q in asked if q.question_id.endswith("-seeded")]
    return dict(variant=name, dtype=str(model.dtype).removeprefix("torch."), kv_dtype=kv_dtype,
                weights=model.weight_format, matmul=model.weights.matmul_kernel,
                greedy_same=sum(solo[q] == packed[q] for q in greedy), greedy=len(greedy),
                seeded_same=sum(solo[q] == packed[q] for q in sampled), seeded=len(sampled))


def _report(rows: list[dict], model_name: str, out) -> None:
    out(f"\n{model_name}, {cpu_name()}; each answer alone vs packed beside {NEIGHBOURS} long neighbours")
    out("| variant | dtype | KV | weights | matmul | greedy identical | seeded identical | seconds |")
    out("|---|---|---|---|---|---:|---:|---:|")
    for r in rows:
        out(f"| {r['variant']} | {r['dtype']} | {r['kv_dtype']} | {r['weights']} | {r['matmul']} | "
            f"{r['greedy_same']}/{r['greedy']} | "
            f"{r['seeded_same']}/{r['seeded']} | {r['seconds']:.0f} |")
