"""IsolatedBatchPipeline as a user calls it: answers in order, stop strings, transformers' greedy, errors;
answers by index, their start and end stamps, and keys Kev does not know on every Python path."""

import re

import anyio
import pytest
import torch

from conftest import tiny_options
from engine import Engine, IsolatedBatchPipeline, QuestionRejected
from engine.prompt import as_question

pytest_plugins = ["serve_fixtures"]

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "List three primary colors."]
NEW_TOKENS = 32


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def pipeline(smollm2):
    return IsolatedBatchPipeline(smollm2, max_batch_size=8, kv_slot_capacity=2048, early_stop=True)


@pytest.fixture(scope="module")
def greedy(pipeline):
    return pipeline.run(QUESTIONS, max_new_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.slow
def test_answers_come_back_in_order_and_complete(greedy, smollm2):
    tokenizer = smollm2.tokenizer
    assert [a.question_id for a in greedy] == ["q0", "q1", "q2"]
    assert "Paris" in greedy[0].text
    for prompt, answer in zip(QUESTIONS, greedy):
        assert answer.error is None and answer.finish_reason in ("stop", "length")
        assert answer.text.strip() and answer.text == tokenizer.decode(answer.token_ids, skip_special_tokens=True)
        assert answer.usage.prompt_tokens == len(chat_ids(tokenizer, prompt))
        assert answer.usage.completion_tokens == len(answer.token_ids) <= NEW_TOKENS
        if answer.finish_reason == "stop":
            assert answer.token_ids[-1] in smollm2.spec.eos_token_ids
        else:
            assert len(answer.token_ids) == NEW_TOKENS
        t = answer.timings
        assert 0 <= t.queued_ms <= t.ttft_ms <= t.e2e_ms and t.e2e_ms > 0


@pytest.mark.slow
def test_greedy_answers_equal_transformers_generate(greedy, smollm2):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32).eval()
    for prompt, answer in zip(QUESTIONS[:2], greedy):
        ids = chat_ids(smollm2.tokenizer, prompt)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                     eos_token_id=list(smollm2.spec.eos_token_ids), pad_token_id=0)
        assert list(answer.token_ids) == out[0, len(ids):].tolist(), prompt


@pytest.mark.slow
def test_stop_string_cuts_the_text_cleanly(pipeline, greedy):
    full = greedy[1].text
    words = full.split()
    stop = words[len(words) // 2]
    cut = full[: full.find(stop)]
    assert cut  # the stop string sits inside the answer, not at its start
    answer = pipeline.run([{"prompt": QUESTIONS[1], "params": {"stop": [stop]}}],
                          max_new_tokens=NEW_TOKENS, temperature=0.0)[0]
    assert answer.finish_reason == "stop"
    assert stop not in answer.text
    assert answer.text == cut
    assert len(answer.token_ids) < len(greedy[1].token_ids)


@pytest.mark.slow
def test_early_stop_off_gives_the_same_answers(smollm2, greedy):
    lazy = IsolatedBatchPipeline(smollm2, max_batch_size=8, kv_slot_capacity=2048, early_stop=False, num_blocks=256)
    answers = lazy.run(QUESTIONS, max_new_tokens=NEW_TOKENS, temperature=0.0)
    for fast, slow in zip(greedy, answers):
        assert (slow.text, slow.token_ids, slow.finish_reason) == (fast.text, fast.token_ids, fast.finish_reason)
    assert lazy.core.pool.num_used == 0


@pytest.mark.slow
def test_prompt_too_long_is_an_error_answer_and_the_rest_run(pipeline):
    answers = pipeline.run(["hello " * 2100, QUESTIONS[0]], max_new_tokens=4, temperature=0.0)
    assert answers[0].finish_reason == "error" and answers[0].error.code == "prompt_too_long"
    assert answers[1].error is None and answers[1].token_ids
    assert pipeline.core.pool.num_used == 0


def test_prompt_past_the_models_positions_is_refused_not_a_crash(tiny_models):
    """A model with 512 positions under the default max_context (2048): a longer prompt is rejected
    with prompt_too_long, a prompt that would grow past 512 ends there with "length", and the
    question sharing the batch still gets its answer."""
    from engine import EngineCore, EngineOptions, QuestionRejected
    from engine.sampling_defaults import Defaults
    from schemas import Params, QuestionEvent

    model = tiny_models["llama"].kev
    assert model.spec.max_position == 512
    core = EngineCore(model, EngineOptions(num_blocks=256, batch_window_ms=0.0, defaults=Defaults()))

    def ask(qid: str, length: int, new_tokens: int):
        event = QuestionEvent(question_id=qid, prompt="(ids)", params=Params(max_new_tokens=new_tokens))
        return core.add(event, prompt_ids=[i % 200 + 20 for i in range(length)])

    with pytest.raises(QuestionRejected) as rejected:
        ask("too-long", 600, 8)
    assert rejected.value.code == "prompt_too_long"
    ask("grows-past", 490, 40)
    ask("short", 3, 8)
    answers = {}
    while core.has_work:
        answers.update((a.question_id, a) for a in core.step().answers)
    assert answers["grows-past"].finish_reason == "length"
    assert answers["grows-past"].usage.prompt_tokens + answers["grows-past"].usage.completion_tokens <= 512
    assert len(answers["short"].token_ids) == 8


# -- on the tiny random model (tests/serve_fixtures.py) ----------------------------------------------

def tiny_greedy(**overrides):
    from engine.sampling_defaults import Defaults

    return tiny_options(defaults=Defaults(temperature=0.0, max_new_tokens=4), **overrides)


def test_answers_also_answer_by_index(tiny_model):
    answers = IsolatedBatchPipeline(tiny_model, options=tiny_greedy()).run(["one", "two"], max_new_tokens=3)
    assert [qid for qid, _ in answers.items()] == [0, 1] and list(answers.keys()) == [0, 1]
    assert answers.get(1) is answers[1] and answers.get(2) is None and answers.get(-1) is None
    assert [answer.question_id for answer in answers.values()] == ["q0", "q1"]


def test_as_completed_yields_each_answer_the_step_it_finishes(tiny_model):
    """kev ask prints from it: a refused question first, a 2-token answer before a 12-token one, each the
    answer run() gives."""
    questions = [{"prompt": "long", "params": {"max_new_tokens": 12}}, {"prompt": "x" * 9000},
                 {"prompt": "short", "params": {"max_new_tokens": 2}}]
    pipe = IsolatedBatchPipeline(tiny_model, options=tiny_greedy())
    streamed = list(pipe.as_completed(questions))
    assert [(a.question_id, a.error is not None) for a in streamed] == [("q1", True), ("q2", False), ("q0", False)]
    whole = IsolatedBatchPipeline(tiny_model, options=tiny_greedy()).run(questions)
    assert {a.question_id: a.token_ids for a in streamed} == {a.question_id: a.token_ids for a in whole}


def test_answers_carry_start_and_end_stamps_as_far_apart_as_e2e(tiny_model):
    pipe = IsolatedBatchPipeline(tiny_model, options=tiny_greedy())
    answers = pipe.run(["hello", "hi there", "x" * 9000], max_new_tokens=5)
    for answer in answers[:2]:
        t = answer.timings
        assert t.started_ms <= t.finished_ms
        assert abs((t.finished_ms - t.started_ms) - t.e2e_ms) <= 1  # each stamp rounded to the ms
    refused = answers[2].timings  # prompt_too_long: taken and ended at once
    assert answers[2].error.code == "prompt_too_long" and refused.started_ms == refused.finished_ms > 0


MISSPELT = "params.max_tokens (did you mean 'params.max_new_tokens'?)"


def test_as_question_reports_refuses_or_ignores_unknown_keys(logs):
    question = as_question({"prompt": "hi", "colour": "red", "params": {"temprature": 0.5}}, max_tokens=5)
    assert question.unknown_fields == ("colour", "params.temprature", "params.max_tokens")
    assert question.params.max_new_tokens is None  # nothing guessed
    assert [line["fields"] for line in logs if line["event"] == "question.unknown_fields"] == [
        ["colour", "params.temprature", "params.max_tokens"]]
    with pytest.raises(QuestionRejected, match=re.escape(MISSPELT)) as refused:
        as_question("hi", on_unknown="reject", max_tokens=5)
    assert refused.value.code == "invalid_field"
    logs.clear()
    as_question("hi", on_unknown="ignore", max_tokens=5)
    assert not logs


def test_pipeline_run_lists_unknown_keywords_in_every_answer_or_refuses_them(tiny_model, logs):
    pipe = IsolatedBatchPipeline(tiny_model, options=tiny_greedy())
    answers = pipe.run(["a", "b"], max_new_tokens=2, max_tokens=9)
    assert [a.audit.ignored_fields for a in answers] == [("params.max_tokens",)] * 2
    assert all(len(a.token_ids) <= 2 for a in answers)  # the known keyword still applies
    assert sum(line["event"] == "question.unknown_fields" for line in logs) == 2
    strict = IsolatedBatchPipeline(tiny_model, options=tiny_greedy(unknown_fields="reject"))
    with pytest.raises(QuestionRejected, match=re.escape(MISSPELT)):
        strict.run(["a", "b"], max_tokens=9)
    assert not strict.core.has_work and strict.core.pool.num_used == 0
    quiet = IsolatedBatchPipeline(tiny_model, options=tiny_greedy(unknown_fields="ignore")).run(["a"], max_tokens=9)
    assert quiet[0].audit.ignored_fields == ()


def test_engine_submit_lists_unknown_keywords_or_refuses_them(tiny_model):
    async def ask(policy: str):
        async with Engine(tiny_model, tiny_greedy(unknown_fields=policy)) as engine:
            if policy == "reject":
                with pytest.raises(QuestionRejected, match=re.escape(MISSPELT)):
                    await engine.submit("hi", max_tokens=9, temprature=0.5)
                return engine.in_flight
            return await engine.wait(await engine.submit("hi", max_tokens=9, temprature=0.5))

    assert anyio.run(ask, "report").audit.ignored_fields == ("params.max_tokens", "params.temprature")
    assert anyio.run(ask, "reject") == 0  # refused before it was queued
