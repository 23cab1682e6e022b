"""Question preparation off the engine actor's inbox (issue 39, finding 5): questions are tokenized and
their grammars compiled concurrently, each principal a few compiles at a time, and cancels and control
commands come on their own mailbox, ahead of the questions. Real engines: SmolLM2 where step time is
what is measured, a full-vocabulary tiny model elsewhere; ~100 KB grammars, each new to the engine."""

from __future__ import annotations

import gc
import random
import statistics
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import anyio
import pytest

from engine import Engine, EngineOptions
from engine.sampling_defaults import Defaults
from kev_async.engine_actor import Cancel, Submit, UpdateDefaults, engine_actor
from kev_async.runtime.actors import Mailbox, ask
from kev_async.runtime.supervisor import Child, RestartPolicy, Supervisor
from schemas import AnswerEvent, GrammarFormat, Params, QuestionEvent
from schemas.principal import ANONYMOUS, Principal

pytestmark = pytest.mark.anyio
ONE = Params(max_new_tokens=1, temperature=0)
LONG = Params(max_new_tokens=400, temperature=0)
FLOOD = 20


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer, harness):
    """Random weights over SmolLM2's whole vocabulary: grammars mask real tokens, steps take milliseconds."""
    hf = harness.build_hf_tiny("llama", seed=5, vocab_size=49152, eos_token_id=2)
    return harness.kev_model_from_hf(hf, smollm2_tokenizer, name="tiny-full-vocab")


def grammar(seed: int, terminals: int = 2400) -> GrammarFormat:
    """A Lark grammar of about 100 KB (2,400 terminals; 40-100 ms to compile here), different for each seed."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 12)))
             for _ in range(terminals)]
    return GrammarFormat("start: item+\nitem: " + " | ".join(f"T{k}" for k in range(terminals)) + "\n"
                         + "\n".join(f"T{k}: /{w}[a-z]{{1,6}}[0-9]*/" for k, w in enumerate(words)))


_seeds = iter(range(10_000, 1_000_000))


def structured(qid: str, terminals: int = 2400) -> QuestionEvent:
    return QuestionEvent(question_id=qid, prompt=f"Name item {qid}.", params=Params(
        max_new_tokens=1, temperature=0, response_format=grammar(next(_seeds), terminals)))


def plain(qid: str, params: Params = ONE) -> QuestionEvent:
    return QuestionEvent(question_id=qid, prompt="What is the capital of France?", params=params)


@dataclass
class Actor:
    questions: Mailbox
    control: Mailbox
    engine: Engine
    answered: list[AnswerEvent] = field(default_factory=list)  # in the order they came out
    at: dict[str, float] = field(default_factory=dict)  # question_id -> when its answer came
    _changed: anyio.Event = field(default_factory=anyio.Event)

    async def send(self, question: QuestionEvent, principal: Principal = ANONYMOUS) -> float:
        sent = time.perf_counter()
        await self.questions.send.send(Submit(question, principal=principal))
        return sent

    async def until_answered(self, *question_ids: str, timeout: float = 60) -> None:
        with anyio.fail_after(timeout):
            while not all(qid in self.at for qid in question_ids):
                await self._changed.wait()

    def position(self, question_id: str) -> int:
        return [a.question_id for a in self.answered].index(question_id)

    def answer(self, question_id: str) -> AnswerEvent:
        return next(a for a in self.answered if a.question_id == question_id)

    async def _collect(self, answers: Mailbox) -> None:
        async for event in answers.receive:
            if isinstance(event, AnswerEvent):
                self.answered.append(event)
                self.at[event.question_id] = time.perf_counter()
                self._changed.set()
                self._changed = anyio.Event()


@asynccontextmanager
async def running(model, *, max_in_flight: int = 64, inbox: int = 64, **options):
    """One engine actor with a control mailbox; drained when the block ends."""
    questions, control, answers = Mailbox("q", inbox), Mailbox("c", 8), Mailbox("a", 64)
    made = []

    def make() -> Engine:
        made.append(Engine(model, EngineOptions(**{**dict(max_parallel_queries=32, batch_window_ms=0, num_blocks=256,
                                                           block_size=16, max_context=512, defaults=Defaults()),
                                                   **options})))
        return made[-1]

    async with anyio.create_task_group() as tg:
        await tg.start(partial(engine_actor, questions.receive, answers.send, control=control.receive,
                               engine_factory=make, max_in_flight=max_in_flight))
        actor = Actor(questions, control, made[-1])
        tg.start_soon(actor._collect, answers)
        yield actor
        questions.send.close()
    control.send.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # timings: one backend is enough
async def test_a_plain_question_behind_twenty_new_grammars_is_answered_about_as_fast_as_alone(smollm2):
    """Before: the actor tokenized and compiled one question at a time, so a 1-token question behind
    20 new grammars waited for all 20 compiles (2.0-2.5 s against 0.05 s alone on a 2-core EPYC)."""
    rounds = 3
    floods = [[structured(f"g{r}-{i}") for i in range(FLOOD)] for r in range(rounds)]  # built before any clock
    ratios, compile_shares, positions = [], [], []
    async with running(smollm2) as actor:
        grammars = actor.engine.core.constraints.grammars.stats
        await actor.send(plain("warm"))
        await actor.send(structured("warm-grammar"))  # builds llguidance's view of the tokenizer once
        await actor.until_answered("warm", "warm-grammar")
        for r, flood in enumerate(floods):  # alone, then behind 20 new grammars: the pair shares the host's load
            gc.collect()  # now, not inside a measured answer
            sent = await actor.send(plain(f"alone-{r}"))
            await actor.until_answered(f"alone-{r}")
            alone = actor.at[f"alone-{r}"] - sent
            compiling = grammars.compile_seconds
            for question in flood:
                await actor.send(question)
            sent = await actor.send(plain(f"behind-{r}"))
            await actor.until_answered(f"behind-{r}", *(q.question_id for q in flood))
            behind = actor.at[f"behind-{r}"] - sent
            ratios.append(behind / alone)
            compile_shares.append(behind / (grammars.compile_seconds - compiling))
            positions.append(sum(actor.position(q.question_id) < actor.position(f"behind-{r}") for q in flood))
    assert all(actor.answer(q.question_id).error is None for flood in floods for q in flood)
    # Other work on a shared host can slow any one step, so: the best of three pairs against its time
    # alone, and in every pair what no host's load changes: its place among the answers, and its time
    # against the compile time of the grammars it was queued behind (which that load slows alike).
    assert min(ratios) <= 2, ratios
    assert all(p < FLOOD // 2 for p in positions), positions  # grammars answered before it: not most
    assert all(share < 0.5 for share in compile_shares), compile_shares


async def test_a_cancel_ends_a_question_waiting_to_be_prepared_before_the_queue_drains(tiny):
    async with running(tiny) as actor:
        flood = [structured(f"g{i}") for i in range(FLOOD)]
        target = structured("target")  # the 21st new grammar: it waits for a compile place
        for question in flood + [target]:
            await actor.send(question)
        await actor.control.send.send(Cancel("target"))
        await actor.until_answered("target", *(q.question_id for q in flood))
    cancelled = actor.answer("target")
    assert cancelled.finish_reason == "cancelled" and cancelled.usage.completion_tokens == 0
    assert actor.position("target") < FLOOD // 2, [a.question_id for a in actor.answered]
    assert sorted(a.question_id for a in actor.answered) == sorted(q.question_id for q in flood + [target])
    assert all(actor.answer(q.question_id).finish_reason == "length" for q in flood)
    assert actor.engine.core.pool.num_used == 0


async def test_every_question_is_answered_once_wherever_its_preparation_ends(tiny):
    """Cancelled while it waits for a compile place, while it runs, before it came; a grammar that does
    not compile: one answer each, as before the actor prepared questions concurrently."""
    async with running(tiny) as actor:
        for question in [structured(f"g{i}") for i in range(6)] + [structured("mid"), plain("plain", LONG)]:
            await actor.send(question)
        for qid in ("mid", "plain", "not-yet"):
            await actor.control.send.send(Cancel(qid))
        await actor.send(plain("not-yet", LONG))  # its cancel came first
        bad = QuestionEvent(question_id="bad", prompt="x", params=Params(response_format=GrammarFormat("start: (")))
        await actor.send(bad)
        await actor.until_answered("mid", "plain", "not-yet", "bad", *(f"g{i}" for i in range(6)))
    for qid in ("mid", "plain", "not-yet"):
        assert actor.answer(qid).finish_reason == "cancelled", actor.answer(qid)
    assert actor.answer("bad").error.code == "invalid_field"
    assert len(actor.answered) == 10 == len({a.question_id for a in actor.answered})


def _lose_device():
    raise RuntimeError("device lost")


async def test_a_crash_answers_the_questions_still_being_prepared(tiny):
    lost = threading.Event()
    made = []

    def make() -> Engine:
        engine = Engine(tiny, EngineOptions(max_parallel_queries=8, batch_window_ms=0, num_blocks=128, max_context=512,
                                            defaults=Defaults()))
        if not made:  # the first engine's device fails at its first step once `lost` is set
            step = engine.core.step
            engine.core.step = lambda: _lose_device() if lost.is_set() else step()
        made.append(engine)
        return engine

    questions, control, answers = Mailbox("q", 16), Mailbox("c", 4), Mailbox("a", 16)
    scheduler = Child("scheduler", partial(engine_actor, engine_factory=make, control=control.receive),
                      (questions.receive, answers.send), RestartPolicy(backoff_s=0))
    with questions.receive, answers.receive, control.receive:
        async with anyio.create_task_group() as tg:
            await tg.start(Supervisor("app", [scheduler]).run)
            async with questions.send:
                await questions.send.send(Submit(plain("running", LONG)))
                for i in range(5):  # 5 new grammars: one compiling, the rest waiting for a place
                    await questions.send.send(Submit(structured(f"g{i}")))
                with anyio.fail_after(10):
                    while questions.stats().depth:  # all taken: one still in the inbox would be the next actor's
                        await anyio.sleep(0.001)
                lost.set()
                with anyio.fail_after(30):
                    got = [await answers.receive.receive() for _ in range(6)]
                    await questions.send.send(Submit(plain("after")))
                    after = await answers.receive.receive()
    assert sorted(a.question_id for a in got) == ["g0", "g1", "g2", "g3", "g4", "running"]
    assert all(a.error.code == "engine_failed" for a in got), got
    assert after.question_id == "after" and after.error is None  # the restarted actor serves


async def test_update_defaults_is_applied_while_the_question_inbox_is_full(tiny):
    async with running(tiny, max_in_flight=1, inbox=2) as actor:
        await actor.send(plain("busy", LONG))  # holds the only place for hundreds of steps
        for i in range(3):  # one waits in the actor for a place, two fill the inbox
            await actor.send(plain(f"q{i}", Params(temperature=0)))
        assert actor.questions.stats().depth == 2  # full: another send would wait
        with anyio.fail_after(5):
            version = await ask(actor.control.send, UpdateDefaults({"max_new_tokens": 3}), 5)
        assert version == 2 and not actor.answered  # applied, and "busy" is still decoding
        await actor.control.send.send(Cancel("busy"))
        await actor.until_answered("busy", "q0", "q1", "q2")
    assert actor.answer("busy").finish_reason == "cancelled"
    for i in range(3):  # queued before the update, admitted after it
        answer = actor.answer(f"q{i}")
        assert answer.audit.defaults_version == 2 and answer.usage.completion_tokens <= 3


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("per_principal", [2, 64])
async def test_one_principals_flood_of_grammars_does_not_starve_anothers(tiny, per_principal):
    """With the budget (2) the other principal's compile waits for at most two of the flood's; without
    one (64) the same question waits behind the whole flood: the contrast says it is the budget."""
    flooder, other = Principal("gw", "acme"), Principal("gw", "other")
    async with running(tiny, compiles_per_principal=per_principal) as actor:
        await actor.send(structured("warm"))
        await actor.until_answered("warm")
        most_held = 0

        async def watch():
            nonlocal most_held
            while True:
                most_held = max(most_held, actor.engine.compiles.holding(flooder))
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            flood = [structured(f"g{i}") for i in range(FLOOD)]
            for question in flood:
                await actor.send(question, flooder)
            await actor.send(structured("theirs"), other)
            await actor.until_answered("theirs", *(q.question_id for q in flood))
            tg.cancel_scope.cancel()
    position = actor.position("theirs") - 1  # after "warm"
    if per_principal == 2:
        assert most_held == 2
        assert position < FLOOD // 2, [a.question_id for a in actor.answered]
    else:
        assert most_held > 2 and position >= FLOOD // 2
    assert actor.answer("theirs").error is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_compile_threads_asked_for_one_new_format_at_once_compile_it_once(smollm2_tokenizer):
    from engine.compile_threads import CompileThreads
    from engine.constrain.grammars import GrammarCache
    from engine.device_thread import loop_poster
    from schemas.constraint import spec_of

    cache = GrammarCache(smollm2_tokenizer, 2, 8)
    cache.tokenizer  # built before: its half second would otherwise hide the race
    threads = CompileThreads(4, loop_poster())
    specs = [spec_of(grammar(next(_seeds)))] * 4 + [spec_of(GrammarFormat("start: ("))] * 4
    outcomes = [None] * len(specs)

    async def one(i):
        outcomes[i] = await threads.run(_outcome, cache, specs[i])

    try:
        async with anyio.create_task_group() as tg:  # eight jobs queued at once, four threads take them
            for i in range(len(specs)):
                tg.start_soon(one, i)
    finally:
        threads.close()
    assert cache.stats.compiles == 2 and cache.stats.failed == 1
    assert len({id(o) for o in outcomes[:4]}) == 1 and all(isinstance(o, str) for o in outcomes[4:])


def _outcome(cache, spec):
    from schemas.constraint import InvalidConstraint

    try:
        return cache.get(spec)
    except InvalidConstraint as bad:
        return str(bad)
