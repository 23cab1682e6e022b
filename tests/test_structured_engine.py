"""Structured answers and unknown keys through the async Engine, as a worker runs them: events decoded
from JSON, grammars compiled off the device thread, error answers, the audit, and the metrics."""

from __future__ import annotations

import json

import anyio
import jsonschema
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from engine import Engine, EngineOptions
from engine.sampling_defaults import Defaults
from kev_async.observe.metrics import Metrics
from schemas import decode_question

pytestmark = pytest.mark.anyio
SCHEMA = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["sentiment", "score"], "additionalProperties": False}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def model(smollm2_tokenizer, harness):
    hf = harness.build_hf_tiny("qwen2", seed=11, vocab_size=49152, eos_token_id=2)
    return harness.kev_model_from_hf(hf, smollm2_tokenizer, name="tiny-full-vocab")


def options(**overrides) -> EngineOptions:
    return EngineOptions(**{**dict(max_parallel_queries=8, batch_window_ms=5, num_blocks=128, block_size=16,
                                   max_context=256, defaults=Defaults()), **overrides})


def event(qid: str, **params) -> bytes:
    return msgspec.json.encode({"question_id": qid, "prompt": f"Review {qid}: fine.", "params": params})


def review_format(name: str = "review", schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def ask(engine: Engine, raw: list[bytes]):
    handles = [await engine.submit(decode_question(r)) for r in raw]
    return {h.question_id: await engine.wait(h, timeout=120) for h in handles}


def scraped(metrics: Metrics) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples}


async def test_a_worker_answers_each_format_and_counts_it(model):
    metrics = Metrics()
    async with Engine(model, options()) as engine:
        metrics.watch_engine(engine)
        answers = await ask(engine, [
            event("a", response_format=review_format(), max_new_tokens=64),
            event("b", response_format=review_format("again"), temperature=1.0, seed=3, max_new_tokens=64),
            event("bad", response_format=review_format(schema={"type": "object", "not": {"required": ["x"]}})),
            event("free", max_new_tokens=5),
        ])
    with capture_logs() as logs:
        for answer in answers.values():
            metrics.observe_answer(answer)
    lines = {line["question_id"]: line for line in logs if line["event"] == "answer"}
    assert lines["a"]["constraint"] == answers["a"].audit.constraint and lines["a"]["incomplete"] is False
    assert "constraint" not in lines["free"]
    for qid in ("a", "b"):
        assert answers[qid].finish_reason == "stop" and not answers[qid].incomplete
        jsonschema.validate(json.loads(answers[qid].text), SCHEMA)
        assert answers[qid].audit.constraint == answers["a"].audit.constraint  # one schema, one hash
    bad = answers["bad"]
    assert bad.finish_reason == "error" and bad.error.code == "invalid_field"
    assert bad.error.message == 'params.response_format.json_schema.schema: Unimplemented keys: ["not"]'
    assert answers["free"].audit.constraint is None and answers["free"].error is None
    values = scraped(metrics)
    assert values["kev_constrained_questions_total"] == 2
    assert values["kev_grammar_compiles_total"] == 2  # the review schema once, the bad one once
    assert values["kev_grammar_cache_hits_total"] >= 2  # both review questions found it at admission
    assert values["kev_grammar_masks_total"] > 0 and values["kev_grammar_mask_seconds_total"] > 0
    assert values["kev_grammar_masks_late_total"] == 0
    assert values["kev_errors_total"] == 1


async def test_a_question_waits_for_its_grammar_without_holding_others(model):
    """A free question submitted while a new grammar compiles is answered; the compile is off the device thread."""
    async with Engine(model, options()) as engine:
        async with anyio.create_task_group() as tg:
            results = {}

            async def one(raw):
                results.update(await ask(engine, [raw]))

            tg.start_soon(one, event("slow", response_format={"type": "regex", "pattern": "[a-z]{2,9}@[a-z]{2,9}"
                                                                                         r"\.(com|org|net)"}))
            tg.start_soon(one, event("free", max_new_tokens=3))
    assert results["free"].finish_reason == "length" and results["slow"].finish_reason == "stop"
    assert results["slow"].audit.constraint.startswith("regex:")


@pytest.mark.parametrize("policy", ["ignore", "report", "reject"])
async def test_unknown_keys_are_reported_ignored_or_refused(model, policy):
    metrics = Metrics()
    raw = msgspec.json.encode({"question_id": "typo", "prompt": "hi", "max_tokens": 9,
                               "params": {"max_tokens": 5, "temprature": 0.5, "max_new_tokens": 3}})
    assert decode_question(raw).unknown_fields == ("max_tokens", "params.max_tokens", "params.temprature")
    async with Engine(model, options(unknown_fields=policy)) as engine:
        answer = (await ask(engine, [raw]))["typo"]
    metrics.observe_answer(answer)
    if policy == "reject":
        assert answer.error.code == "invalid_field"
        assert "params.max_tokens (did you mean 'params.max_new_tokens'?)" in answer.error.message
        assert "params.temprature (did you mean 'params.temperature'?)" in answer.error.message
        return
    assert answer.error is None and len(answer.token_ids) == 3  # the known keys still apply
    expected = () if policy == "ignore" else ("max_tokens", "params.max_tokens", "params.temprature")
    assert answer.audit.ignored_fields == expected
    assert scraped(metrics)["kev_unknown_fields_total"] == len(expected)
