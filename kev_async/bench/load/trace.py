"""The arrival trace of `kev bench load`: which questions come, when, with what answer budget.

Arrivals are a Poisson process (exponential gaps) at `rate` questions/s, or all at time 0 when the rate
is infinite; `stream_trace` puts long answers decoding first and long prompts after them (--streams).
The question mix and the budgets are drawn from their own seeded generator, so the same
seed gives the same questions at every rate: a sweep over rates only rescales the gaps. Each trace
question becomes the QuestionEvent (and the prompt token ids) every Kev system is given.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from engine.prompt import encode_prompt
from kev_async.bench.load.texts import LONG_TASKS, PASSAGES, STREAM_TASKS, SYSTEM_PROMPT_TEXT
from kev_async.sample_questions import QUESTIONS
from schemas import Params, QuestionEvent


@dataclass(frozen=True)
class TraceQuestion:
    qid: str
    arrival_s: float  # seconds after the trace starts
    prompt: str
    system: str | None
    max_new_tokens: int
    kind: str  # "short" | "long" | "stream"


def question_event(q: TraceQuestion, *, stream: bool = False) -> QuestionEvent:
    """The question as Kev takes it: greedy, with the question's own answer budget."""
    return QuestionEvent(question_id=q.qid, prompt=q.prompt, system=q.system, stream=stream,
                         params=Params(max_new_tokens=q.max_new_tokens, temperature=0.0))


def prompt_ids(model, q: TraceQuestion) -> list[int]:
    """The token ids Kev feeds the model for `q` (its chat template applied)."""
    return encode_prompt(model.tokenizer, question_event(q))


@dataclass(frozen=True)
class MixSpec:
    """What the questions look like; the defaults are `kev bench load`'s."""

    max_new_tokens: int = 128
    min_new_tokens: int = 4
    long_fraction: float = 0.4  # questions that carry a long context
    max_prompt_tokens: int = 1000  # the longest context, in the model's tokens
    min_long_tokens: int = 150
    shared_prefix_tokens: int = 0  # every question starts with this many tokens of one system prompt


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """`count` arrival times (s) of a Poisson process of `rate`/s; all 0.0 for rate=inf."""
    if rate <= 0:
        raise ValueError(f"--rate must be above 0 (or inf), not {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{seed}")
    t, times = 0.0, []
    for _ in range(count):
        t += rng.expovariate(1.0) / rate  # Exp(1)/rate: every rate rescales the same draws
        times.append(t)
    return times


def arrivals_within(duration_s: float, rate: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of `rate`/s up to `duration_s`."""
    if math.isinf(rate):
        raise ValueError("--duration needs a finite --rate (with --rate inf every question arrives at 0)")
    count = max(1, int(duration_s * rate * 3) + 16)  # far more than expected; cut below
    return [t for t in poisson_arrivals(count, rate, seed) if t <= duration_s] or [0.0]


def budget(spec: MixSpec, rng: random.Random) -> int:
    """An answer budget, log-uniform from min_new_tokens to max_new_tokens: many short, some long."""
    low, high = math.log(max(1, min(spec.min_new_tokens, spec.max_new_tokens))), math.log(spec.max_new_tokens)
    return max(1, round(math.exp(rng.uniform(low, high))))


class QuestionMix:
    """Builds short and long prompts deterministically; `tokenizer` counts the tokens of contexts."""

    def __init__(self, tokenizer, spec: MixSpec):
        self.tokenizer = tokenizer
        self.spec = spec
        self.system = shared_system_prompt(tokenizer, spec.shared_prefix_tokens) if spec.shared_prefix_tokens else None
        self._corpus = tokenizer.encode("\n\n".join(PASSAGES), add_special_tokens=False)

    def draw(self, count: int, seed: int) -> list[tuple[str, str, int]]:
        """(kind, prompt, max_new_tokens) for each of `count` questions; a longer trace only adds questions."""
        rng = random.Random(f"mix-{seed}")
        out = []
        for _ in range(count):
            max_new_tokens = budget(self.spec, rng)
            if rng.random() < self.spec.long_fraction:
                length = rng.randint(min(self.spec.min_long_tokens, self.spec.max_prompt_tokens),
                                     self.spec.max_prompt_tokens)
                out.append(("long", self.long_prompt(length, rng), max_new_tokens))
            else:
                out.append(("short", rng.choice(QUESTIONS), max_new_tokens))
        return out

    def long_prompt(self, context_tokens: int, rng: random.Random) -> str:
        """A context of about `context_tokens` tokens cut from the passages, then a task about it."""
        start = rng.randrange(len(self._corpus))
        ids = (self._corpus * (2 + context_tokens // max(1, len(self._corpus))))[start:start + context_tokens]
        context = self.tokenizer.decode(ids).strip()
        return f"Read these notes.\n\n{context}\n\n{rng.choice(LONG_TASKS)}"


def shared_system_prompt(tokenizer, tokens: int) -> str:
    """A system prompt of exactly about `tokens` tokens, the same for every question of the trace."""
    ids = tokenizer.encode(SYSTEM_PROMPT_TEXT, add_special_tokens=False)
    ids = (ids * (1 + tokens // max(1, len(ids))))[:tokens]
    return tokenizer.decode(ids)


def build_trace(tokenizer, *, rate: float, seed: int, spec: MixSpec, count: int | None = None,
                duration_s: float | None = None) -> list[TraceQuestion]:
    """The same seed and spec give the same questions at every rate; only arrival times differ."""
    if (count is None) == (duration_s is None):
        raise ValueError("give either a question count or a duration")
    arrivals = poisson_arrivals(count, rate, seed) if count is not None else arrivals_within(duration_s, rate, seed)
    mix = QuestionMix(tokenizer, spec)
    return [TraceQuestion(f"load-{i}", arrival, prompt, mix.system, budget, kind)
            for i, (arrival, (kind, prompt, budget)) in enumerate(zip(arrivals, mix.draw(len(arrivals), seed)))]


STREAMS_LEAD_S = 1.0  # the streams are decoding when the first long prompt arrives


def stream_trace(tokenizer, *, streams: int, prompts: int, rate: float, seed: int,
                 spec: MixSpec) -> list[TraceQuestion]:
    """Mixed load (--streams): `streams` questions whose answers run long (spec.max_new_tokens each) at time 0,
    then `prompts` long prompts of spec.max_prompt_tokens tokens at `rate` from STREAMS_LEAD_S on, answer
    budgets as the mix draws them: what a step that prefills a long prompt does to streams decoding."""
    rng = random.Random(f"streams-{seed}")
    mix = QuestionMix(tokenizer, spec)
    trace = [TraceQuestion(f"stream-{i}", 0.0, STREAM_TASKS[i % len(STREAM_TASKS)], mix.system, spec.max_new_tokens,
                           "stream") for i in range(streams)]
    for i, arrival in enumerate(poisson_arrivals(prompts, rate, seed)):
        trace.append(TraceQuestion(f"long-{i}", STREAMS_LEAD_S + arrival, mix.long_prompt(spec.max_prompt_tokens, rng),
                                   mix.system, budget(spec, rng), "long"))
    return trace
