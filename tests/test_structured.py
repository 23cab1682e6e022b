"""Structured answers: each packed question's response_format holds its own answer, and only its own.

A tiny random-weight model with the SmolLM2 tokenizer's full vocabulary (49,152 tokens, EOS 2): its
logits are noise, so whatever parses does so because the masks forced it.
"""

import json
import random
import re

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.constraint import check
from schemas import AnswerEvent, Params

FULL_VOCAB = 49152
EOS = 2  # <|im_end|>
MAX_NEW = 160

SCHEMAS = [
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "score": {"type": "integer", "minimum": 0, "maximum": 10}},
     "required": ["sentiment", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8}},
     "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "order"}, "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["kind", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                      {"enum": ["none"]}]}},
     "required": ["v"], "additionalProperties": False},
]


def fmt(response_format: dict):
    return msgspec.convert({"response_format": response_format}, Params).response_format


def schema_format(i: int, schema: dict) -> object:
    return fmt({"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})


@pytest.fixture(scope="module")
def model(smollm2_tokenizer, harness):
    hf = harness.build_hf_tiny("llama", seed=7, vocab_size=FULL_VOCAB, eos_token_id=EOS)
    return harness.kev_model_from_hf(hf, smollm2_tokenizer, name="tiny-full-vocab")


def sampling(i: int) -> dict:
    """Every other question sampled with its own seed and a different top-k/top-p; the rest greedy."""
    if i % 2 == 0:
        return dict(temperature=0.0)
    return dict(temperature=0.9, seed=1000 + i, top_k=[0, 40][i % 4 == 1], top_p=[1.0, 0.9][i % 3 == 0])


def mixed_batch(harness, count: int, seed: int) -> tuple[list, dict]:
    """`count` questions: eight schemas and free ones in turn, random prompts; qid -> schema (None = free)."""
    rng = random.Random(seed)
    questions, schemas = [], {}
    for i in range(count):
        schema = None if i % 9 == 8 else SCHEMAS[i % 9 % len(SCHEMAS)]
        params = dict(max_new_tokens=MAX_NEW if schema else 12, **sampling(i))
        if schema is not None:
            params["response_format"] = schema_format(i, schema)
        qid = f"q{i}"
        questions.append(harness.Q(qid, harness.random_prompt(rng, rng.randint(2, 40), FULL_VOCAB), params))
        schemas[qid] = schema
    return questions, schemas


def assert_valid(answer: AnswerEvent, schema: dict) -> None:
    assert answer.error is None and answer.finish_reason == "stop", answer
    assert not answer.incomplete
    jsonschema.validate(json.loads(answer.text), schema)
    assert answer.audit.constraint.startswith("json_schema:")


@pytest.mark.parametrize("count", [1, 9, 32])
def test_every_packed_constrained_answer_validates(model, harness, count):
    questions, schemas = mixed_batch(harness, count, seed=count)
    outcome = harness.run_core(model, questions)
    assert max(len(plan) for plan in outcome.plans) == count  # all in one forward
    for qid, schema in schemas.items():
        answer = outcome.answers[qid]
        if schema is None:
            assert answer.audit.constraint is None and not answer.incomplete
        else:
            assert_valid(answer, schema)
    stats = outcome.core.constraints
    assert stats.grammars.stats.compiles == len({json.dumps(s) for s in schemas.values() if s})
    assert stats.masks.stats.late == 0  # every mask after the first was ready before its draw


def test_free_neighbours_answer_as_they_do_alone(model, harness):
    """Constrained questions in the forward change no token of a free neighbour (fp32), greedy or sampled."""
    questions, schemas = mixed_batch(harness, 18, seed=5)
    packed = harness.run_core(model, questions)
    for q in questions:
        if schemas[q.qid] is None:
            assert packed.tokens(q.qid) == harness.run_core(model, [q]).tokens(q.qid), q.qid


def test_constrained_answers_are_their_solo_answers(model, harness):
    questions, _ = mixed_batch(harness, 9, seed=9)
    packed = harness.run_core(model, questions)
    for q in questions[:4]:
        assert packed.tokens(q.qid) == harness.run_core(model, [q]).tokens(q.qid), q.qid


def test_json_object_regex_and_grammars(model, harness):
    forms = {
        "obj": fmt({"type": "json_object"}),
        "phone": fmt({"type": "regex", "pattern": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}),
        "lark": fmt({"type": "grammar", "grammar": 'start: sum "=" NUM\nsum: NUM "+" NUM\nNUM: /[0-9]{1,3}/\n'}),
        "gbnf": fmt({"type": "grammar", "grammar": 'root ::= "yes" | "no" | "maybe"'}),
    }
    questions = [harness.Q(name, [10 + i, 20, 30], dict(max_new_tokens=MAX_NEW, response_format=f))
                 for i, (name, f) in enumerate(forms.items())]
    answers = harness.run_core(model, questions).answers
    assert all(a.finish_reason == "stop" and not a.incomplete for a in answers.values()), answers
    assert isinstance(json.loads(answers["obj"].text), dict)
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", answers["phone"].text)
    assert re.fullmatch(r"[0-9]{1,3}\+[0-9]{1,3}=[0-9]{1,3}", answers["lark"].text)
    assert answers["gbnf"].text in ("yes", "no", "maybe")


def test_a_grammar_that_cannot_finish_ends_length_and_says_incomplete(model, harness):
    long_enum = {"type": "object", "properties": {"word": {"enum": ["x" * 40]}}, "required": ["word"]}
    q = harness.Q("short", [5, 6, 7], dict(max_new_tokens=4, response_format=schema_format(0, long_enum)))
    answer = harness.run_core(model, [q]).answers["short"]
    assert answer.finish_reason == "length" and answer.incomplete
    assert len(answer.token_ids) == 4 and answer.text.startswith('{"word":"')


@pytest.mark.parametrize("response_format,named", [
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {"type": "string"}}}},
     'params.response_format.json_schema.schema: Unimplemented keys: ["not"]'),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "strnig"}}}, "Invalid type: strnig"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/$defs/gone"}}}, "/$defs/gone"),
    ({"type": "regex", "pattern": "(ab"}, "params.response_format.pattern"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, 'unknown name: "undefined_rule"'),
    ({"type": "grammar", "grammar": 'root ::= ("a"'}, "params.response_format.grammar: GBNF"),
])
def test_a_bad_format_is_an_error_answer_and_the_step_goes_on(model, harness, response_format, named):
    from engine.intake import QuestionRejected
    from schemas import QuestionEvent

    neighbour = harness.Q("free", [1, 2, 3], dict(max_new_tokens=6))
    outcome = harness.run_core(model, [neighbour])
    bad = QuestionEvent(question_id="bad", prompt="x", params=Params(response_format=fmt(response_format)))
    with pytest.raises(QuestionRejected) as rejected:
        outcome.core.add(bad, prompt_ids=[1, 2])
    assert rejected.value.code == "invalid_field" and named in rejected.value.message
    assert harness.run_core(model, [neighbour], core=outcome.core).tokens("free") == outcome.tokens("free")


def test_compiled_grammars_are_cached_per_schema_and_bounded(model, harness):
    def ask(*schemas):
        return [harness.Q(f"q{i}", [3, 4], dict(max_new_tokens=MAX_NEW, response_format=schema_format(i, s)))
                for i, s in enumerate(schemas)]

    outcome = harness.run_core(model, ask(SCHEMAS[0], SCHEMAS[1], SCHEMAS[0]), harness.tiny_options(grammar_cache_size=2))
    grammars = outcome.core.constraints.grammars
    assert (grammars.stats.compiles, grammars.stats.cache_hits) == (2, 1)  # one compile per distinct schema
    harness.run_core(model, ask(SCHEMAS[1], SCHEMAS[0]), core=outcome.core)
    assert (grammars.stats.compiles, grammars.stats.cache_hits) == (2, 3)  # cached: no compile at all
    harness.run_core(model, ask(SCHEMAS[2]), core=outcome.core)  # a third schema: the least recent goes
    assert len(grammars) == 2 and grammars.stats.compiles == 3
    harness.run_core(model, ask(SCHEMAS[0], SCHEMAS[1]), core=outcome.core)
    assert grammars.stats.compiles == 4  # SCHEMAS[1] had been evicted, SCHEMAS[0] was still there


# -- generated schemas ------------------------------------------------------------------------------------
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda words: {"enum": words}),
    st.tuples(st.integers(-50, 50), st.integers(0, 50)).map(
        lambda lo_span: {"type": "integer", "minimum": lo_span[0], "maximum": lo_span[0] + lo_span[1]}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
)


def objects(children):
    keys = st.lists(st.text("pqrst", min_size=1, max_size=3), min_size=1, max_size=3, unique=True)
    return keys.flatmap(lambda names: st.tuples(st.just(names), st.lists(children, min_size=len(names),
                                                                         max_size=len(names)))).map(
        lambda pair: {"type": "object", "properties": dict(zip(pair[0], pair[1])), "required": list(pair[0]),
                      "additionalProperties": False})


SMALL_SCHEMAS = st.recursive(LEAVES, lambda inner: st.one_of(
    objects(inner), inner.map(lambda item: {"type": "array", "items": item, "maxItems": 3})), max_leaves=5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SMALL_SCHEMAS, seed=st.integers(0, 2**32), temperature=st.sampled_from([0.0, 1.0]))
def test_generated_small_schemas_always_validate(model, harness, schema, seed, temperature):
    check(schema_format(0, schema))
    q = harness.Q("g", [7, 8, 9], dict(max_new_tokens=MAX_NEW, temperature=temperature, seed=seed,
                                       response_format=schema_format(0, schema)))
    assert_valid(harness.run_core(model, [q]).answers["g"], schema)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, seed=3),
                                    dict(temperature=1.2, seed=4, top_k=5), dict(temperature=1.0, seed=5, top_p=0.5),
                                    dict(temperature=0.0, repetition_penalty=1.3)])
def test_the_sampler_masks_its_own_row_only(params):
    import torch

    from engine.constrain.masks import RowMasks
    from engine.constrain.state import bias_row
    from engine.model.sampler import Sampler, SampleRow
    from engine.sequence import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(3, 1000) * 4
    rows = [SampleRow(SamplingParams(**params), [1, 2, 3], 9 + i) for i in range(3)]
    allowed = [17, 401, 999]
    bits = torch.zeros(32, dtype=torch.int32)
    for token in allowed:
        bits.numpy().view("uint32")[token // 32] |= 1 << (token % 32)
    free = Sampler().sample(logits.clone(), rows)
    masked = Sampler().sample(logits.clone(), rows, RowMasks(torch.tensor([1]), bias_row(bits, 1000)[None]))
    assert masked[1] in allowed
    assert (masked[0], masked[2]) == (free[0], free[2])


@pytest.mark.slow
def test_the_real_model_rates_reviews_in_valid_json(smollm2):
    from engine import IsolatedBatchPipeline

    schema = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative"]},
                                               "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["sentiment", "stars"], "additionalProperties": False}
    reviews = ["The soup was cold and the waiter was rude.", "Wonderful service, I will come back!",
               "Terrible. Never again.", "Best pizza in town."]
    questions = [{"prompt": f"Rate this review as JSON: {r}",
                  "params": {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "rating", "schema": schema}}}}
                 for r in reviews] + [{"prompt": "What is the capital of France?"}]
    answers = IsolatedBatchPipeline(smollm2, max_batch_size=8).run(questions, max_new_tokens=40, temperature=0.0)
    for answer in answers[:4]:
        assert_valid(answer, schema)
    assert "Paris" in answers[4].text and answers[4].audit.constraint is None


def test_the_device_unpacking_equals_the_host_one():
    """The GPU path unpacks the stacked bits on the device (bias_rows); it must give the host's rows."""
    import torch

    from engine.constrain.state import bias_row, bias_rows

    bits = torch.randint(-2**31, 2**31 - 1, (3, 40), dtype=torch.int32)
    for width in (1000, 1280, 1500):  # narrower than the mask, equal, wider (padded as blocked)
        assert torch.equal(bias_rows(bits, width), torch.stack([bias_row(row, width) for row in bits]))


def test_models_sharing_a_tokenizer_each_get_their_own_eos(smollm2_tokenizer):
    # The llguidance view is cached per tokenizer; a view built for one model's EOS let another model's
    # constrained answers run to `length` (seen when the speculative tests ran before these).
    from engine.constrain.grammars import llg_tokenizer

    first, second = llg_tokenizer(smollm2_tokenizer, 2), llg_tokenizer(smollm2_tokenizer, 5)
    assert (first.eos_token, second.eos_token) == (2, 5)
    assert llg_tokenizer(smollm2_tokenizer, 2) is first
