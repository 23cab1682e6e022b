"""`python -m benchmarks.engine`: Kev against transformers on the same model and questions, in one process.

(a) transformers `generate`, one question at a time   (b) transformers `generate`, one left-padded batch
(c) Kev, early eviction                                (d) Kev, finished questions kept until the batch drains
All greedy, all stopping at EOS or max_new_tokens. Prints tokens/s, the ratios, and whether (c)'s answers
are token-identical to (a)'s. `Run` and the run_* helpers are shared with the lora and scaling benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from kev_async.bench.model import bench_model, hf_model
from kev_async.sample_questions import QUESTIONS
from schemas import DEFAULT_MODEL

# torch and the engine are imported inside the functions that use them: --help answers without loading them.


def register(kinds: argparse._SubParsersAction) -> None:
    engine = kinds.add_parser(
        "engine", help="Kev vs transformers generate (one at a time, padded batch)",
        description="(a) transformers generate one question at a time, (b) transformers generate on one "
                    "left-padded batch, (c) Kev with early eviction, (d) Kev without it; greedy. Prints "
                    "tokens/s, (c)/(a), (c)/(b), (c)/(d) and whether (c)'s answers equal (a)'s.")
    engine.add_argument("--model", default=DEFAULT_MODEL)
    engine.add_argument("--questions", type=int, default=32, help="how many of the mixed questions (default 32)")
    engine.add_argument("--max-new-tokens", type=int, default=64)
    engine.add_argument("--repeats", type=int, default=3, help="Kev runs per variant; the median is kept")
    engine.add_argument("--skip-sequential", action="store_true",
                        help="skip (a), the slowest run (minutes); (c) is then checked against (b)")
    engine.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    engine.add_argument("--deterministic", action="store_true",
                        help="also run (e), Kev in deterministic mode (bitwise batch-invariant logits), and "
                             "print its cost as (e)/(c) and whether its answers equal (c)'s")
    engine.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    bench_engine(bench_model(args), num_questions=args.questions, max_new_tokens=args.max_new_tokens,
                 repeats=args.repeats, sequential=not args.skip_sequential, deterministic=args.deterministic)
    return 0


@dataclass
class Run:
    name: str
    seconds: float
    tokens: int
    answers: list[list[int]]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def run_kev(model, questions, max_new_tokens: int, early_stop: bool, repeats: int,
            deterministic: bool = False) -> Run:
    from engine.pipeline import IsolatedBatchPipeline

    pipe = IsolatedBatchPipeline(model, max_batch_size=len(questions), early_stop=early_stop,
                                 deterministic=deterministic)
    pipe.run(questions[:2], max_new_tokens=2)  # warm-up: first-call allocations
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        answers = pipe.run(questions, max_new_tokens=max_new_tokens, temperature=0.0)
        runs.append((time.perf_counter() - started, answers))
    seconds, answers = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run
    ids = [list(a.token_ids) for a in answers]
    name = "kev, early eviction" if early_stop else "kev, no early eviction"
    if deterministic:
        name = "kev, deterministic mode"
    return Run(name, seconds, sum(map(len, ids)), ids)


def run_hf_sequential(hf, model, prompts: list[list[int]], max_new_tokens: int) -> Run:
    import torch

    eos = list(model.spec.eos_token_ids)
    answers, started = [], time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids], device=hf.device),
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=hf.device),
                              max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])
            answers.append(_trim(out[0, len(ids):].tolist(), eos))
    seconds = time.perf_counter() - started
    return Run("transformers, one at a time", seconds, sum(map(len, answers)), answers)


def run_hf_padded(hf, model, prompts: list[list[int]], max_new_tokens: int) -> Run:
    import torch

    eos = list(model.spec.eos_token_ids)
    width = max(map(len, prompts))
    ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos[0])
    seconds = time.perf_counter() - started
    answers = [_trim(row[width:].tolist(), eos) for row in out]
    return Run("transformers, padded batch", seconds, sum(map(len, answers)), answers)


def _trim(tokens: list[int], eos: list[int]) -> list[int]:
    """Up to and including the first EOS, as Kev reports it; drop the padding after."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def bench_engine(model, *, num_questions: int = 32, max_new_tokens: int = 64, repeats: int = 3,
                 sequential: bool = True, deterministic: bool = False, out=print) -> dict:
    from engine.prompt import as_question, encode_prompt

    questions = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:num_questions])]
    prompts = [encode_prompt(model.tokenizer, q) for q in questions]
    hf = hf_model(model)
    runs = {}
    if sequential:
        runs["a"] = run_hf_sequential(hf, model, prompts, max_new_tokens)
    runs["b"] = run_hf_padded(hf, model, prompts, max_new_tokens)
    runs["c"] = run_kev(model, questions, max_new_tokens, early_stop=True, repeats=repeats)
    if deterministic:  # right after (c), so both see the same machine
        runs["e"] = run_kev(model, questions, max_new_tokens, early_stop=True, repeats=repeats, deterministic=True)
    runs["d"] = run_kev(model, questions, max_new_tokens, early_stop=False, repeats=repeats)
    report(runs, model, num_questions, max_new_tokens, out)
    return runs


def report(runs: dict, model, num_questions: int, max_new_tokens: int, out=print) -> None:
    import torch

    out(f"model {model.name} ({model.dtype}), {num_questions} questions, <= {max_new_tokens} new tokens, "
        f"greedy, torch threads {torch.get_num_threads()}")
    out(f"| run | engine | tokens | seconds | tokens/s |\n|---|---|---:|---:|---:|")
    for key, run in runs.items():
        out(f"| ({key}) | {run.name} | {run.tokens} | {run.seconds:.2f} | {run.rate:.1f} |")
    c = runs["c"]
    for key in ("a", "b", "d"):
        if key in runs:
            out(f"(c)/({key}) = {c.rate / runs[key].rate:.2f}x")
    if "e" in runs:
        e = runs["e"]
        same = sum(x == y for x, y in zip(e.answers, c.answers))
        out(f"deterministic mode: (e)/(c) = {e.rate / c.rate:.2f}x of default throughput; "
            f"answers equal to (c)'s: {same}/{len(c.answers)}")
    reference = runs.get("a") or runs["b"]
    same = sum(x == y for x, y in zip(c.answers, reference.answers))
    out(f"(c) answers token-identical to ({'a' if 'a' in runs else 'b'}): {same}/{len(c.answers)}")
    if same < len(c.answers):
        first = [len(_common_prefix(x, y)) for x, y in zip(c.answers, reference.answers) if x != y]
        out(f"  differing answers agree on their first {statistics.median(first):.0f} tokens (median)")


def _common_prefix(x: list[int], y: list[int]) -> list[int]:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return x[:n]


if __name__ == "__main__":
    from benchmarks.command import run_alone

    raise SystemExit(run_alone(register))
