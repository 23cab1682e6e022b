"""Failure isolation: one question's trouble ends that question alone; the batch and the engine go on."""

import copy

import anyio
import pytest

from conftest import tiny_options
from engine import Engine, EngineCore
from schemas import Message, Params, QuestionEvent

VOCAB = 256  # the tiny models' vocabulary; the real tokenizer's ids are folded into it
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['role'] + ': ' + m['content'] }}"
               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class FoldedTokenizer:
    """The real SmolLM2 tokenizer with its ids folded into a tiny vocabulary, and a chosen template."""

    def __init__(self, tokenizer, template=None):
        self.tokenizer, self.chat_template = tokenizer, template or tokenizer.chat_template

    def apply_chat_template(self, messages, **kwargs):
        ids = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [i % VOCAB for i in ids]

    def decode(self, ids, **kwargs):
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture
def model(tiny_models, smollm2_tokenizer):
    tiny = copy.copy(tiny_models["llama"].kev)
    tiny.tokenizer = FoldedTokenizer(smollm2_tokenizer, ALTERNATING)
    return tiny


def question(qid, prompt="hi", tokens=12, **fields):
    return QuestionEvent(question_id=qid, prompt=None if "messages" in fields else prompt,
                         params=Params(max_new_tokens=tokens), **fields)


def run(core):
    answers = {}
    while core.has_work:
        answers.update({a.question_id: a for a in core.step().answers})
    return answers


def test_a_prompt_the_chat_template_refuses_is_an_error_answer_not_a_crash(model):
    core = EngineCore(model, tiny_options())
    core.add(question("good"))
    with pytest.raises(Exception) as refused:
        core.add(question("bad", messages=(Message("user", "a"), Message("user", "b"))))
    assert refused.value.code == "bad_prompt" and "roles must alternate" in refused.value.message
    answers = run(core)
    assert answers["good"].finish_reason == "length" and len(answers["good"].token_ids) == 12


def test_a_question_whose_text_cannot_be_decoded_ends_alone(model):
    core = EngineCore(model, tiny_options())
    for qid in ("left", "broken", "right"):
        core.add(question(qid))
    alone = run_alone(model, "left")

    def explode(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")

    core.output._streams["broken"].push = explode  # a fault in exactly one question's detokenizer
    answers = run(core)
    assert answers["broken"].finish_reason == "error" and "planted" in answers["broken"].error.message
    assert answers["left"].token_ids == alone and answers["right"].finish_reason == "length"
    assert core.pool.num_used == 0


def run_alone(model, qid):
    core = EngineCore(model, tiny_options())
    core.add(question(qid))
    return run(core)[qid].token_ids


def test_a_neighbours_non_finite_cache_never_reaches_a_decode(model):
    """Decode padding reads the row's own slot: a masked key weighs 0, but 0 * inf would be NaN."""
    def answer_of_b(poison: bool):
        core = EngineCore(model, tiny_options())
        core.add(question("A", "a much longer prompt for question A " * 3, tokens=16))
        core.add(question("B", "hi", tokens=16))
        core.step()  # both prefilled; A holds block 0
        if poison:
            core.kv.v[:, 0] = float("inf")  # A's own first value row overflows
        return run(core)["B"].token_ids

    assert answer_of_b(poison=True) == answer_of_b(poison=False)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_overflow_wait_makes_a_burst_wait_instead_of_refusing_it(model):
    options = tiny_options(max_parallel_queries=4, max_waiting=2, overflow_policy="wait")
    async with Engine(model, options) as engine:
        handles = [await engine.submit(question(f"q{i}", tokens=4)) for i in range(6)]
        answers = [await engine.wait(h, 30) for h in handles]
    assert [a.error for a in answers] == [None] * 6


@pytest.mark.anyio
async def test_plain_string_questions_get_distinct_ids_as_others_finish(model):
    async with Engine(model, tiny_options()) as engine:
        first = await engine.submit("one", max_new_tokens=2)
        await engine.wait(first, 30)
        second, third = await engine.submit("two", max_new_tokens=2), await engine.submit("three", max_new_tokens=2)
        answers = [await engine.wait(h, 30) for h in (second, third)]
    assert len({first.question_id, second.question_id, third.question_id}) == 3
    assert all(a.error is None for a in answers)


@pytest.mark.anyio
async def test_a_submit_racing_close_is_answered_or_refused_never_left_hanging(model):
    engine = Engine(model, tiny_options())
    handles = []

    async def submit():
        try:
            handles.append(await engine.submit(question("late")))
        except RuntimeError:
            pass  # refused: the engine was already closed

    async def close():
        engine.close()

    async with engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit)
            tg.start_soon(close)
    for handle in handles:
        with anyio.fail_after(5):
            answer = await engine.wait(handle)
        assert answer.finish_reason in ("cancelled", "error")


@pytest.mark.anyio
async def test_asking_again_right_after_a_cancel_is_not_a_duplicate(model):
    async with Engine(model, tiny_options()) as engine:
        first = await engine.submit(question("again", tokens=200))
        engine.cancel(first)
        second = await engine.submit(question("again", tokens=3))  # the same id, at once
        cancelled, answered = await engine.wait(first, 30), await engine.wait(second, 30)
    assert cancelled.finish_reason == "cancelled"
    assert answered.error is None and len(answered.token_ids) == 3
