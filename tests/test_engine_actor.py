"""The scheduler actor on a tiny random-weight Llama: many askers, streamed answers, cancels free KV."""

import dataclasses
import threading
import time
from functools import partial

import anyio
import pytest
import torch
import transformers
from polling import eventually
from structlog.testing import capture_logs

from engine import Engine, EngineOptions
from engine.model.loader import resolve_model_dir
from engine.model.model import Model, rope_tables, spec_from_config
from engine.prompt import encode_prompt
from engine.step_hook import BatchSizes
from engine.model.transformer import Transformer
from kev_async.engine_actor import Cancel, DeviceBusy, Submit, engine_actor, open_engine_client
from kev_async.runtime.actors import Mailbox
from kev_async.runtime.supervisor import Child, RestartPolicy, Supervisor
from schemas import DEFAULT_MODEL, AnswerDelta, AnswerEvent, Params, QuestionEvent

pytestmark = pytest.mark.anyio

OPTIONS = EngineOptions(max_parallel_queries=16, batch_window_ms=1, num_blocks=128, block_size=16, max_context=512)
SHORT = Params(max_new_tokens=8, temperature=0)
LONG = Params(max_new_tokens=400, temperature=0)  # hundreds of steps: still decoding when cancelled


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                   max_position_embeddings=512)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    spec = spec_from_config(cfg)
    path = resolve_model_dir(DEFAULT_MODEL)
    weights = Transformer.from_state_dict(spec, hf.state_dict(), rope_tables(cfg, spec), torch.device("cpu"),
                                          torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return Model(spec, weights, tokenizer, torch.device("cpu"), torch.float32, None, cfg)


class Engines:
    """An engine factory that remembers what it made, so a test can look at the KV pool."""

    def __init__(self, model):
        self.model, self.made = model, []

    def __call__(self) -> Engine:
        self.made.append(Engine(self.model, OPTIONS))
        return self.made[-1]

    @property
    def pool(self):
        return self.made[-1].core.pool


def question(i: int, **fields) -> QuestionEvent:
    return QuestionEvent(question_id=f"q{i}", **{"prompt": f"question {i}" + " and more" * (i % 9),
                                                 "params": SHORT, **fields})


async def test_a_hundred_concurrent_askers_each_get_their_own_answer(model):
    answers = {}

    async def asker(client, i):
        answers[i] = await client.ask(question(i), timeout=30)

    engines = Engines(model)
    async with open_engine_client(engines) as client:
        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(asker, client, i)
    for i, answer in answers.items():
        assert answer.question_id == f"q{i}" and answer.finish_reason in ("length", "stop")
        # the prompt this answer was computed from is the asker's own (the prompts differ in length)
        assert answer.usage.prompt_tokens == len(encode_prompt(model.tokenizer, question(i)))
    assert len(answers) == 100
    assert engines.pool.num_used == 0


async def test_questions_in_answers_out_streamed_and_drained_when_the_inbox_closes(model):
    inbox, outbox = Mailbox("questions", 4), Mailbox("answers", 4)
    got: list = []
    async with anyio.create_task_group() as tg:
        await tg.start(partial(engine_actor, inbox.receive, outbox.send, engine_factory=Engines(model)))
        async with inbox.send:
            for i in range(20):
                await inbox.send.send(Submit(question(i, stream=i % 2 == 0)))
        async with outbox.receive:  # ends when the actor has answered everything and closed it
            got = [event async for event in outbox.receive]
    answers = {e.question_id: e for e in got if isinstance(e, AnswerEvent)}
    assert sorted(answers) == sorted(f"q{i}" for i in range(20))
    for i in range(0, 20, 2):
        deltas = [e for e in got if isinstance(e, AnswerDelta) and e.question_id == f"q{i}"]
        assert [d.seq for d in deltas] == list(range(len(deltas))) and deltas[-1].done
        assert "".join(d.text for d in deltas) == answers[f"q{i}"].text
        assert got.index(deltas[-1]) < got.index(answers[f"q{i}"])  # deltas first, then the answer
    assert not any(isinstance(e, AnswerDelta) and int(e.question_id[1:]) % 2 for e in got)


async def test_the_kafka_workers_envelopes_go_in_and_come_back_with_their_answers(model):
    from consumers.messages import Inbound, Outbound  # plain dataclasses; nothing here talks to Kafka

    inbox, outbox = Mailbox("questions", 4), Mailbox("answers", 4)
    sent = [Inbound(question(i, stream=i == 0), "kev.questions", 0, 100 + i, 0.0) for i in range(6)]
    async with anyio.create_task_group() as tg:
        await tg.start(partial(engine_actor, inbox.receive, outbox.send, engine_factory=Engines(model),
                               wrap=Outbound))
        async with inbox.send:
            for inbound in sent:
                await inbox.send.send(inbound)
        async with outbox.receive:
            got = [outbound async for outbound in outbox.receive]
    finals = [o for o in got if o.final]
    assert sorted(o.source.offset for o in finals) == list(range(100, 106))
    assert all(o.source.question.question_id == o.event.question_id for o in got)
    assert any(not o.final and o.source is sent[0] for o in got)  # q0 streamed its deltas


async def test_a_slow_reader_of_answers_holds_back_intake_and_loses_nothing(model):
    inbox, outbox = Mailbox("questions", 8), Mailbox("answers", 0)
    async with anyio.create_task_group() as tg:
        await tg.start(partial(engine_actor, inbox.receive, outbox.send, engine_factory=Engines(model),
                               max_in_flight=2))
        async with inbox.send, outbox.receive:
            for i in range(5):
                await inbox.send.send(Submit(question(i)))
            # Two answers are ready and nobody reads them.
            await eventually(lambda: outbox.stats().senders_waiting >= 2, timeout=10, every=0.005)
            await anyio.sleep(0.05)
            assert inbox.stats().depth == 2  # q2 waits in the actor for a place; q3, q4 stay queued
            inbox.send.close()
            got = [event.question_id async for event in outbox.receive]
    assert sorted(got) == [f"q{i}" for i in range(5)]


async def test_a_cancel_from_the_async_side_frees_the_questions_kv_blocks(model):
    inbox, outbox = Mailbox("questions", 4), Mailbox("answers", 4)
    engines = Engines(model)
    long = question(1, stream=True, params=LONG)
    async with anyio.create_task_group() as tg:
        await tg.start(partial(engine_actor, inbox.receive, outbox.send, engine_factory=engines))
        async with inbox.send, outbox.receive:
            await inbox.send.send(Submit(long))
            assert isinstance(await outbox.receive.receive(), AnswerDelta)  # it is decoding now
            assert engines.pool.num_used > 0
            await inbox.send.send(Cancel("q1"))
            answer = await _next_answer(outbox.receive)
            assert answer.finish_reason == "cancelled" and answer.usage.completion_tokens < 400
            assert engines.pool.num_used == 0 and engines.pool.num_free == OPTIONS.num_blocks


async def test_a_cancel_that_overtakes_its_question_cancels_it_on_arrival(model):
    # kev.control can be read before a lagging kev.questions partition: the gateway's cancel comes first.
    inbox, outbox = Mailbox("questions", 4), Mailbox("answers", 4)
    engines = Engines(model)
    async with anyio.create_task_group() as tg:
        await tg.start(partial(engine_actor, inbox.receive, outbox.send, engine_factory=engines))
        async with inbox.send, outbox.receive:
            await inbox.send.send(Cancel("q1"))
            await inbox.send.send(Submit(question(1, params=LONG)))
            answer = await _next_answer(outbox.receive)
            assert answer.question_id == "q1" and answer.finish_reason == "cancelled"
            assert answer.usage.completion_tokens == 0
            # once: the same id asked again is answered in full, and so is a cancel after its answer
            await inbox.send.send(Submit(question(1)))
            assert (await _next_answer(outbox.receive)).finish_reason != "cancelled"
            await inbox.send.send(Cancel("q1"))
            await inbox.send.send(Submit(question(1)))
            assert (await _next_answer(outbox.receive)).finish_reason != "cancelled"
            assert engines.pool.num_used == 0


async def test_an_asker_cancelled_mid_answer_cancels_its_question_and_frees_its_blocks(model):
    engines = Engines(model)
    async with open_engine_client(engines) as client:
        async with anyio.create_task_group() as askers:
            askers.start_soon(client.ask, question(7, params=LONG))
            await eventually(lambda: engines.pool.num_used > 0, timeout=5, every=0.002)  # decoding, holding blocks
            askers.cancel_scope.cancel()
        # the blocks come back the moment the cancel lands; the question's end is reported a step later
        await eventually(lambda: engines.pool.num_used == 0 and engines.made[-1].in_flight == 0, timeout=5,
                         every=0.002)


async def test_an_asker_that_times_out_gets_timeout_error_and_the_engine_goes_on(model):
    engines = Engines(model)
    async with open_engine_client(engines) as client:
        with pytest.raises(TimeoutError):
            await client.ask(question(7, params=LONG), timeout=0.05)
        await eventually(lambda: engines.pool.num_used == 0, timeout=5, every=0.002)
        assert (await client.ask(question(8), timeout=30)).question_id == "q8"


class DeviceFailsOnce(Engines):
    """The first engine's device fails once three questions are in flight (fault injection)."""

    def __call__(self) -> Engine:
        engine = super().__call__()
        if len(self.made) == 1:
            step = engine.core.step
            engine.core.step = lambda: step() if engine.in_flight < 3 else _raise(RuntimeError("device lost"))
        return engine


def _raise(error):
    raise error


async def test_a_device_failure_answers_taken_questions_with_errors_and_the_actor_is_restarted(model):
    questions, answers = Mailbox("questions", 8), Mailbox("answers", 8)
    scheduler = Child("scheduler", partial(engine_actor, engine_factory=DeviceFailsOnce(model)),
                      (questions.receive, answers.send), RestartPolicy(backoff_s=0), context={"device": "cpu"})
    supervisor = Supervisor("app", [scheduler])
    with capture_logs() as logs, questions.receive, answers.receive:
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            async with questions.send:
                for i in range(3):
                    await questions.send.send(Submit(question(i, params=LONG, request_id=f"r{i}")))
                failed = [await answers.receive.receive() for _ in range(3)]
                await questions.send.send(Submit(question(9)))
                answered = await answers.receive.receive()
    assert sorted((a.question_id, a.request_id, a.error.code) for a in failed) == [
        ("q0", "r0", "engine_failed"), ("q1", "r1", "engine_failed"), ("q2", "r2", "engine_failed")]
    assert answered.question_id == "q9" and answered.error is None  # the restarted actor serves
    assert supervisor.restarts == {"scheduler": 1}
    crash = next(e for e in logs if e["event"] == "actor.crashed")
    assert crash["actor"] == "scheduler" and crash["device"] == "cpu" and "device lost" in crash["error"]


async def test_defaults_update_through_the_actor_and_apply_to_later_questions(model):
    async with open_engine_client(Engines(model)) as client:
        version = await client.update_defaults(max_new_tokens=3, timeout=5)
        answer = await client.ask(question(3, params=Params(temperature=0)), timeout=30)
        with pytest.raises(ValueError, match="no_such_knob"):  # the asker's mistake comes back to it
            await client.update_defaults(no_such_knob=1, timeout=5)
    assert version == 2
    assert answer.audit.defaults_version == 2 and answer.usage.completion_tokens <= 3


async def test_one_scheduler_actor_per_device(model):
    async with open_engine_client(Engines(model)):
        with pytest.RaisesGroup(DeviceBusy):  # raised from a task group, so in an ExceptionGroup
            async with open_engine_client(Engines(model)):
                pass


async def _next_answer(stream) -> AnswerEvent:
    async for event in stream:
        if isinstance(event, AnswerEvent):
            return event
    raise AssertionError("the outbox ended without an answer")


# -- prompt limits in tokens, checked before the engine; tokenizing off the device thread (issue 26, item 7) --

MARK = "(held at the tokenizer)"


class HeldTokenizer:
    """The real tokenizer, except that rendering a prompt with MARK in it waits for the engine to make
    `forwards` more forwards (at most 10 s): that can only happen if tokenizing is off the device thread."""

    def __init__(self, inner, engines: Engines, forwards: int = 5):
        self.inner, self.engines, self.forwards = inner, engines, forwards
        self.held_on: set[int] = set()  # threads that rendered a held prompt
        self.forwards_while_held: int | None = None
        self.rendered: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_chat_template(self, messages, **kwargs):
        text = " ".join(m["content"] for m in messages)
        self.rendered.append(text[:40])
        if MARK in text:
            self.held_on.add(threading.get_ident())
            core = self.engines.made[-1].core
            start, give_up = core.num_forwards, time.monotonic() + 10
            while core.num_forwards < start + self.forwards and time.monotonic() < give_up:
                time.sleep(0.001)
            self.forwards_while_held = core.num_forwards - start
        return self.inner.apply_chat_template(messages, **kwargs)


def _with_tokenizer(model, tokenizer):
    return dataclasses.replace(model, tokenizer=tokenizer)


async def test_a_prompt_being_tokenized_does_not_hold_up_the_decode_steps(model):
    engines = Engines(model)
    held = HeldTokenizer(model.tokenizer, engines)
    engines.model = _with_tokenizer(model, held)
    device_threads: set[int] = set()
    async with open_engine_client(engines) as client:
        engines.made[-1].core.hooks.append(BatchSizes(lambda _size: device_threads.add(threading.get_ident())))
        async with anyio.create_task_group() as tg:
            answers = {}

            async def ask(q):
                answers[q.question_id] = await client.ask(q, timeout=60)

            tg.start_soon(ask, question(1, params=LONG))
            await eventually(lambda: engines.made[-1].core.num_forwards > 0, timeout=5, every=0.002)  # q1 decoding
            tg.start_soon(ask, question(2, prompt=f"A big prompt {MARK}"))
    assert held.forwards_while_held >= held.forwards  # q1's steps went on while q2's prompt was rendered
    assert held.held_on and device_threads and not held.held_on & device_threads
    assert answers["q1"].finish_reason == "length" and answers["q2"].error is None


async def test_a_prompt_over_the_token_limit_is_answered_before_the_engine(model):
    engines = Engines(model)
    added = []
    async with open_engine_client(engines) as client:
        core = engines.made[-1].core
        add = core.add
        core.add = lambda q, *args, **kwargs: (added.append(q.question_id), add(q, *args, **kwargs))[1]
        limit = core.scheduler.max_tokens_per_question  # 512: OPTIONS.max_context
        # Under the 8-characters-per-token bound (4,096), over 511 tokens once tokenized.
        long = question(1, prompt="hello " * 600)
        too_long = await client.ask(long, timeout=30)
        ok = await client.ask(question(2), timeout=30)
    tokens = len(encode_prompt(model.tokenizer, long))
    assert tokens > limit
    assert too_long.finish_reason == "error" and too_long.error.code == "prompt_too_long"
    assert f"the prompt has {tokens} tokens; this engine allows at most {limit - 1}" in too_long.error.message
    assert added == ["q2"] and core.num_forwards > 0 and ok.error is None


async def test_a_huge_prompt_is_refused_by_its_length_before_it_is_tokenized(model):
    engines = Engines(model)
    counting = HeldTokenizer(model.tokenizer, engines)
    engines.model = _with_tokenizer(model, counting)
    async with open_engine_client(engines) as client:
        huge = await client.ask(question(1, prompt="x" * 300_000), timeout=30)
        ok = await client.ask(question(2), timeout=30)
    assert huge.error.code == "prompt_too_long" and "300000 characters" in huge.error.message
    assert "at most 4096 characters are tokenized" in huge.error.message  # 8 per token of a 512 context
    assert [r[:10] for r in counting.rendered] == ["question 2"] and ok.error is None  # the huge one: never
