"""`python -m benchmarks.answer_surface`: what logprobs and n samples cost, side by side in one run.

logprobs: the median engine step with `--batch` questions decoding and nobody asking for logprobs, one
asking (top 5), and all asking (top 20); the three cases interleave round by round, so drift in the host's
load hits each alike. n samples: one question with n=4 against the same four samples asked as four
questions (each with its derived seed, strict isolation: no prefix shared between questions), prompt
tokens computed and wall time to all four answers, the two alternating; each sample must equal its
question asked alone, or the run stops."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kev_async.bench.model import bench_model
from schemas import DEFAULT_MODEL

# torch and the engine load inside the functions: --help answers without them.

LOGPROB_CASES = {"nobody asks": (0, 0), "one asks (top 5)": (1, 5), "all ask (top 20)": (None, 20)}


def register(kinds: argparse._SubParsersAction) -> None:
    surface = kinds.add_parser(
        "answer_surface", help="the cost of logprobs on an engine step, and of n=4 samples against 4 questions",
        description=__doc__.split("\n\n", 1)[1])
    surface.add_argument("--model", default=DEFAULT_MODEL)
    surface.add_argument("--batch", type=int, default=16, help="questions decoding in the logprobs steps (default 16)")
    surface.add_argument("--steps", type=int, default=12, help="timed steps per case and round (default 12)")
    surface.add_argument("--prompt-tokens", type=int, default=480, help="the n-samples prompt (default 480)")
    surface.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are kept (default 5)")
    surface.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    surface.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    model = bench_model(args)
    bench_logprobs(model, batch=args.batch, steps=args.steps, rounds=args.rounds)
    bench_samples(model, prompt_tokens=args.prompt_tokens, rounds=args.rounds)
    return 0


def _core(model, blocks: int, context: int):
    from engine import EngineCore, EngineOptions
    from engine.sampling_defaults import Defaults

    return EngineCore(model, EngineOptions(num_blocks=blocks, block_size=16, max_context=context,
                                           batch_window_ms=0.0, defaults=Defaults()))


def _step_times(model, batch: int, steps: int, asking: int, top: int) -> list[float]:
    from schemas import Params, QuestionEvent

    core, rng, warm = _core(model, 16 * batch + 64, 512), random.Random(1), 4
    for i in range(batch):
        params = dict(max_new_tokens=warm + steps + 8, temperature=0.8, seed=i)
        if i < asking:
            params.update(logprobs=True, top_logprobs=top)
        core.add(QuestionEvent(question_id=f"q{i}", prompt="x", params=Params(**params)),
                 prompt_ids=[rng.randrange(1000, 5000) for _ in range(20)])
    for _ in range(warm):
        core.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return times


def bench_logprobs(model, *, batch: int = 16, steps: int = 12, rounds: int = 5, out=print) -> dict[str, float]:
    """Median step seconds of each case; the ratio to nobody asking is printed beside it."""
    got: dict[str, list[float]] = {name: [] for name in LOGPROB_CASES}
    for _ in range(rounds):
        for name, (asking, top) in LOGPROB_CASES.items():
            got[name] += _step_times(model, batch, steps, batch if asking is None else asking, top)
    medians = {name: statistics.median(times) for name, times in got.items()}
    out(f"logprobs: {batch} questions decoding, {rounds} rounds of {steps} steps per case")
    out("| case | median step ms | over nobody asking |\n|---|---:|---:|")
    for name, seconds in medians.items():
        out(f"| {name} | {seconds * 1000:.2f} | {seconds / medians['nobody asks']:.3f}x |")
    return medians


def _samples_run(model, questions, prompt: list[int]):
    core = _core(model, 512, 1024)
    started = time.perf_counter()
    for question in questions:
        core.add(question, prompt_ids=prompt)
    answers = []
    while core.has_work:
        answers += core.step().answers
    seconds = time.perf_counter() - started
    computed = sum(a.usage.prompt_tokens - a.usage.cached_prompt_tokens for a in answers)
    return seconds, computed, [a.token_ids for a in sorted(answers, key=lambda a: (a.question_id, a.index))]


def bench_samples(model, *, prompt_tokens: int = 480, rounds: int = 5, out=print) -> dict[str, float]:
    """n=4 in one question against four questions; raises if a sample differs from its question alone."""
    from schemas import Params, QuestionEvent, sample_seed

    prompt = [random.Random(5).randrange(1000, 5000) for _ in range(prompt_tokens)]
    params = dict(max_new_tokens=8, temperature=0.9)
    together = [QuestionEvent(question_id="q", prompt="x", params=Params(n=4, seed=7, **params))]
    apart = [QuestionEvent(question_id=f"q{i}", prompt="x", params=Params(seed=sample_seed(7, i), **params))
             for i in range(4)]
    times: dict[str, list[float]] = {"n=4, one question": [], "4 questions": []}
    computed: dict[str, int] = {}
    for _ in range(rounds):
        runs = {"n=4, one question": _samples_run(model, together, prompt),
                "4 questions": _samples_run(model, apart, prompt)}
        if runs["n=4, one question"][2] != runs["4 questions"][2]:
            raise AssertionError("a sample differs from the same question asked alone with its derived seed")
        for name, (seconds, tokens, _ids) in runs.items():
            times[name].append(seconds)
            computed[name] = tokens
    medians = {name: statistics.median(t) for name, t in times.items()}
    out(f"n samples: a {prompt_tokens}-token prompt, 8 new tokens each, {rounds} rounds alternating; "
        "every sample equal to its question alone")
    out("| run | prompt tokens computed | median ms |\n|---|---:|---:|")
    for name, seconds in medians.items():
        out(f"| {name} | {computed[name]} | {seconds * 1000:.1f} |")
    out(f"n=4 / 4 questions: wall time {medians['n=4, one question'] / medians['4 questions']:.3f}x")
    return medians


if __name__ == "__main__":
    from benchmarks.command import run_alone

    raise SystemExit(run_alone(register))
