"""`kev bench structured`: the same questions packed with eight different JSON schemas, and free.

Prints, for each (median of --repeats, the two variants alternating within each repeat so a noisy
machine slows both alike): tokens/s over the whole run, and tokens/s in the decode steps where every
question was still in the batch. The second is the like-for-like figure: constrained answers end when
their JSON closes, so over a whole run their batch thins out sooner and tokens/s falls for that reason
alone. Then the mask work per step (run beside the forward) and how long steps waited for it, how many
constrained answers were complete and parsed, and each schema's compile time cold (first time in
this process) and cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import msgspec

from kev_async.bench.arguments import positive_int
from kev_async.bench.model import bench_model
from kev_async.sample_questions import QUESTIONS
from schemas import DEFAULT_MODEL, JsonSchemaFormat

# torch and the engine are imported inside the functions that use them: `kev --help` imports this module.


def _obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _text(most: int) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": most}


SCHEMAS = {
    "sentiment": _obj(sentiment={"enum": ["positive", "negative", "neutral"]},
                      confidence={"type": "number", "minimum": 0, "maximum": 1}),
    "entity": _obj(name=_text(40), kind={"enum": ["person", "place", "thing", "idea"]}),
    "verdict": _obj(answer={"type": "boolean"}, reason=_text(80)),
    "keywords": _obj(keywords={"type": "array", "items": _text(20), "minItems": 2, "maxItems": 5}),
    "rating": _obj(stars={"type": "integer", "minimum": 1, "maximum": 5}, summary=_text(60)),
    "translation": _obj(language={"enum": ["es", "fr", "de", "it"]}, text=_text(80)),
    "steps": _obj(steps={"type": "array", "items": _text(40), "maxItems": 4}),
    "fact": _obj(topic=_text(30), fact=_text(100), certain={"type": "boolean"}),
}
FORMATS = [msgspec.convert({"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
                           JsonSchemaFormat) for name, schema in SCHEMAS.items()]


def register(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "structured", help="questions packed with 8 JSON schemas vs the same questions free",
        description="The same questions in one engine, each with one of 8 JSON schemas (round-robin), then "
                    "free; greedy, runs alternating. Prints tokens/s and ms per step of each, their ratio, mask "
                    "time per step, how many answers parsed, and each schema's compile time cold and cached.")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--questions", type=positive_int("questions"), default=32,
                       help="how many of the mixed questions (default 32)")
    bench.add_argument("--max-new-tokens", type=positive_int("max new tokens"), default=64)
    bench.add_argument("--repeats", type=positive_int("repeats"), default=3, help="runs per variant; median kept")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    bench.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    bench_structured(bench_model(args), num_questions=args.questions, max_new_tokens=args.max_new_tokens,
                     repeats=args.repeats)
    return 0


@dataclasses.dataclass
class Sample:
    seconds: float
    tokens: int
    steps: int
    full_steps: list[float]  # seconds of each decode step with every question in the batch
    rows: int  # questions in the batch
    mask_seconds: float = 0.0
    wait_seconds: float = 0.0
    late: int = 0
    answers: tuple = ()

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def full_rate(self) -> float:
        """Tokens/s of a full decode step (the median one): one token per question."""
        return self.rows / statistics.median(self.full_steps) if self.full_steps else float("nan")


def bench_structured(model, *, num_questions: int = 32, max_new_tokens: int = 64, repeats: int = 3,
                     out=print) -> dict:
    from engine.pipeline import IsolatedBatchPipeline
    from engine.prompt import as_question

    free = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:num_questions])]
    constrained = [msgspec.structs.replace(q, params=msgspec.structs.replace(
        q.params, response_format=FORMATS[i % len(FORMATS)])) for i, q in enumerate(free)]
    compile_ms = _compile_times(model)
    pipe = IsolatedBatchPipeline(model, max_batch_size=num_questions)
    pipe.run(free[:2], max_new_tokens=2)  # warm-up: first-call allocations, and every grammar compiled
    pipe.run(constrained[:len(FORMATS)], max_new_tokens=2)
    samples: dict[str, list[Sample]] = {"free": [], "8 schemas": []}
    for _ in range(repeats):
        for name, batch in (("free", free), ("8 schemas", constrained)):
            samples[name].append(_timed(pipe, batch, max_new_tokens))
    runs = {name: _median(runs) for name, runs in samples.items()}
    report(runs, compile_ms, model, num_questions, max_new_tokens, repeats, out)
    return {"runs": runs, "compile_ms": compile_ms}


def _median(samples: list[Sample]) -> Sample:
    """The median run, with the full decode steps of every run (their median is the full-batch figure)."""
    middle = sorted(samples, key=lambda s: s.seconds)[len(samples) // 2]
    return dataclasses.replace(middle, full_steps=[t for s in samples for t in s.full_steps])


def _timed(pipe, batch, max_new_tokens: int) -> Sample:
    """`pipe.run`, with each step timed: the steps where every question decodes are the like-for-like ones."""
    from engine.prompt import as_question  # the engine (torch): not for `kev --help`
    from engine.step_hook import BatchSizes

    core = pipe.core
    masks = core.constraints.masks.stats
    before = (core.num_forwards, masks.mask_seconds, masks.wait_seconds, masks.late)
    questions = [as_question(q, i, max_new_tokens=max_new_tokens, temperature=0.0) for i, q in enumerate(batch)]
    sizes, full, answers = [], [], {}
    hook = BatchSizes(sizes.append)
    core.hooks.append(hook)
    started = time.perf_counter()
    for question in questions:
        core.add(question)
    while core.has_work:
        stepped = time.perf_counter()
        for answer in core.step().answers:
            answers[answer.question_id] = answer
        if len(sizes) > 1 and sizes[-1] == len(questions):  # past the prefill, nobody has left yet
            full.append(time.perf_counter() - stepped)
    seconds = time.perf_counter() - started
    core.hooks.remove(hook)
    ordered = tuple(answers[q.question_id] for q in questions)
    return Sample(seconds, sum(len(a.token_ids) for a in ordered), core.num_forwards - before[0], full,
                  len(questions), masks.mask_seconds - before[1], masks.wait_seconds - before[2],
                  masks.late - before[3], ordered)


def _compile_times(model) -> dict[str, tuple[float, float]]:
    """name -> (cold ms, cached ms), on a cache of its own (the tokenizer's translation is built first, apart)."""
    from engine.constrain.grammars import GrammarCache
    from schemas.constraint import spec_of

    cache = GrammarCache(model.tokenizer, model.spec.eos_token_ids[0], capacity=len(FORMATS))
    _ = cache.tokenizer
    times = {}
    for fmt in FORMATS:
        spec = spec_of(fmt)
        started = time.perf_counter()
        cache.get(spec)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        cache.get(spec)
        times[fmt.json_schema.name] = (cold * 1e3, (time.perf_counter() - started) * 1e3)
    return times


def report(runs: dict[str, Sample], compile_ms: dict, model, num_questions: int, max_new_tokens: int,
           repeats: int, out=print) -> None:
    import torch

    out(f"model {model.name} ({model.dtype}), {num_questions} questions, <= {max_new_tokens} new tokens, greedy, "
        f"median of {repeats}, torch threads {torch.get_num_threads()}")
    out("| run | tokens | steps | seconds | tokens/s | full steps | tokens/s at full batch |\n"
        "|---|---:|---:|---:|---:|---:|---:|")
    for name, run in runs.items():
        out(f"| {name} | {run.tokens} | {run.steps} | {run.seconds:.2f} | {run.rate:.1f} | {len(run.full_steps)} | "
            f"{run.full_rate:.1f} |")
    free, held = runs["free"], runs["8 schemas"]
    out(f"8 schemas / free: tokens/s at full batch {held.full_rate / free.full_rate:.2f}x (target >= 0.90x); "
        f"over the whole run {held.rate / free.rate:.2f}x (constrained answers end sooner: fewer rows per step)")
    out(f"masks: {held.mask_seconds / max(1, held.steps) * 1e3:.2f} ms of mask work per step, beside the forward; "
        f"steps waited {held.wait_seconds / max(1, held.steps) * 1e3:.3f} ms each; {held.late} computed late")
    complete = [a for a in held.answers if not a.incomplete and a.finish_reason == "stop"]
    parsed = sum(1 for a in complete if _parses(a.text))
    out(f"answers: {len(complete)}/{len(held.answers)} complete (the rest hit max_new_tokens), "
        f"{parsed}/{len(complete)} of those parse as JSON")
    out("| schema | compile cold ms | cached ms |\n|---|---:|---:|")
    for name, (cold, cached) in compile_ms.items():
        out(f"| {name} | {cold:.2f} | {cached:.4f} |")
    colds = [c for c, _ in compile_ms.values()]
    out(f"compile: cold median {statistics.median(colds):.2f} ms, max {max(colds):.2f} ms; cached median "
        f"{statistics.median(c for _, c in compile_ms.values()) * 1e3:.1f} us")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
