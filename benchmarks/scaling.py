"""`python -m benchmarks.scaling`: tokens/s against the number of questions for Kev and both transformers
baselines, printed per count and drawn as curves (scaling_plot.py)."""

from __future__ import annotations

import argparse

from benchmarks.engine import run_hf_padded, run_hf_sequential, run_kev
from kev_async.bench.model import bench_model, hf_model
from kev_async.sample_questions import QUESTIONS
from schemas import DEFAULT_MODEL

# The engine and matplotlib are imported inside the functions that use them: --help answers without loading them.


def register(kinds: argparse._SubParsersAction) -> None:
    scaling = kinds.add_parser(
        "scaling", help="tokens/s against the number of questions, with a plot",
        description="For 1, 2, 4, ... 32 questions: Kev, transformers one at a time and transformers on one "
                    "padded batch (greedy). Prints a line per count and draws the curves to --output.")
    scaling.add_argument("--model", default=DEFAULT_MODEL)
    scaling.add_argument("--max-new-tokens", type=int, default=32)
    scaling.add_argument("--counts", default="1,2,4,8,16,32", help="comma-separated question counts")
    scaling.add_argument("--output", "-o", default=".cache/bench/throughput.png",
                         help="the plot (default .cache/bench/throughput.png; -o docs/throughput.png refreshes the "
                              "README's)")
    scaling.add_argument("--threads", type=int, default=None)
    scaling.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from benchmarks.scaling_plot import plot_scaling

    model = bench_model(args)
    result = bench_scaling(model, counts=tuple(int(c) for c in args.counts.split(",")),
                           max_new_tokens=args.max_new_tokens)
    plot_scaling(result, args.output)
    print(f"plot written to {args.output}")
    return 0


def bench_scaling(model, *, counts=(1, 2, 4, 8, 16, 32), max_new_tokens: int = 32, out=print) -> dict:
    """Tokens/s against the number of questions, for Kev and both transformers baselines."""
    from engine.prompt import as_question, encode_prompt

    hf = hf_model(model)
    rates: dict[str, list[float]] = {"kev": [], "transformers, one at a time": [], "transformers, padded batch": []}
    for count in counts:
        questions = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:count])]
        prompts = [encode_prompt(model.tokenizer, q) for q in questions]
        kev = run_kev(model, questions, max_new_tokens, early_stop=True, repeats=1)
        sequential = run_hf_sequential(hf, model, prompts, max_new_tokens)
        padded = run_hf_padded(hf, model, prompts, max_new_tokens)
        for name, run in zip(rates, (kev, sequential, padded)):
            rates[name].append(run.rate)
        out(f"{count:3} questions: kev {kev.rate:6.1f}  one-at-a-time {sequential.rate:6.1f}  "
            f"padded {padded.rate:6.1f} tokens/s")
    return {"counts": list(counts), "rates": rates, "max_new_tokens": max_new_tokens, "model": model.name}


if __name__ == "__main__":
    from benchmarks.command import run_alone

    raise SystemExit(run_alone(register))
