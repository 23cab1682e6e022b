"""Wire events: what a producer may send, and the exact error it gets back when it is wrong."""

import json

import msgspec
import pytest

from schemas import (
    AnswerDelta,
    AnswerEvent,
    Audit,
    InvalidQuestion,
    Message,
    Params,
    QuestionEvent,
    Timings,
    UndecodableEvent,
    Usage,
    decode_answer,
    decode_delta,
    decode_question,
    encode,
    error_answer,
)


def event(**fields) -> bytes:
    return json.dumps({"question_id": "q1", "prompt": "hi", **fields}).encode()


def test_minimal_question_decodes_with_defaults():
    question = decode_question(b'{"question_id": "q1", "prompt": "hi"}')
    assert question == QuestionEvent(question_id="q1", prompt="hi")
    assert question.params == Params() and question.schema == 1 and question.priority == 0


def test_messages_form_and_params_decode():
    raw = json.dumps({
        "question_id": "q2",
        "request_id": "r9",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        "params": {"temperature": 0.7, "top_p": 0.9, "seed": 42, "stop": ["\n\n"]},
        "stream": True,
    })
    question = decode_question(raw)  # str input is accepted too
    assert question.messages == (Message("system", "be brief"), Message("user", "2+2?"))
    assert question.params == Params(temperature=0.7, top_p=0.9, seed=42, stop=("\n\n",))
    assert question.request_id == "r9" and question.stream


def test_unknown_fields_are_ignored_for_forward_compatibility():
    question = decode_question(event(colour="blue", params={"top_k": 5, "future_knob": 1}))
    assert question.params.top_k == 5


def test_encode_omits_defaults_so_events_stay_small():
    assert json.loads(encode(QuestionEvent(question_id="q1", prompt="hi"))) == {
        "question_id": "q1", "prompt": "hi",
    }


def test_answer_round_trips():
    answer = AnswerEvent(
        question_id="q1", request_id="r1", text="4", token_ids=(19, 2), finish_reason="length",
        usage=Usage(prompt_tokens=7, completion_tokens=2),
        timings=Timings(queued_ms=1.5, ttft_ms=20.0, e2e_ms=31.0),
        audit=Audit(worker="w0", channel=3, blocks=(4, 5), steps=2, batch_sizes=(8, 7)),
    )
    assert decode_answer(encode(answer)) == answer


def test_delta_round_trips():
    delta = AnswerDelta(question_id="q1", seq=3, text=" wor", done=True)
    assert decode_delta(encode(delta)) == delta


def test_error_answer_carries_code_and_message():
    answer = decode_answer(encode(error_answer("q1", "r1", "empty_prompt", "prompt: empty")))
    assert answer.finish_reason == "error"
    assert (answer.error.code, answer.error.message) == ("empty_prompt", "prompt: empty")
    assert (answer.question_id, answer.request_id) == ("q1", "r1")


def test_structs_are_frozen():
    question = decode_question(event())
    with pytest.raises(AttributeError):
        question.prompt = "changed"
    with pytest.raises(AttributeError):
        question.params.temperature = 2.0
    with pytest.raises(AttributeError):
        AnswerEvent(question_id="q1").text = "x"


BAD_EVENTS = [
    # (case id, raw event, exception, code/reason, message substring)
    ("temperature-wrong-type", event(params={"temperature": "hot"}),
     InvalidQuestion, "invalid_field", "params.temperature: expected float"),
    ("temperature-negative", event(params={"temperature": -1}),
     InvalidQuestion, "invalid_field", "params.temperature: -1 is below 0"),
    ("top_p-zero", event(params={"top_p": 0}),
     InvalidQuestion, "invalid_field", "params.top_p: 0 must be above 0"),
    ("top_k-negative", event(params={"top_k": -1}),
     InvalidQuestion, "invalid_field", "params.top_k: -1 is below 0"),
    ("max_new_tokens-zero", event(params={"max_new_tokens": 0}),
     InvalidQuestion, "invalid_field", "params.max_new_tokens: 0 is below 1"),
    ("priority-too-high", event(priority=1000),
     InvalidQuestion, "invalid_field", "priority: 1000 is above 100"),
    ("too-many-stops", event(params={"stop": ["x"] * 17}),
     InvalidQuestion, "invalid_field", "params.stop: 17 items, at most 16 allowed"),
    ("empty-stop", event(params={"stop": [""]}),
     InvalidQuestion, "invalid_field", "params.stop[0]: empty"),
    ("bad-role", json.dumps({"question_id": "q1", "messages": [{"role": "bot", "content": "x"}]}).encode(),
     InvalidQuestion, "invalid_field", "messages[0].role: 'bot' is not one of: assistant, system, tool, user"),
    ("no-prompt-or-messages", b'{"question_id": "q1"}',
     InvalidQuestion, "empty_prompt", "prompt: missing"),
    ("empty-prompt", event(prompt=""), InvalidQuestion, "empty_prompt", "prompt: empty"),
    ("whitespace-prompt", event(prompt=" \n\t "), InvalidQuestion, "empty_prompt", "prompt: only whitespace"),
    ("empty-messages", json.dumps({"question_id": "q1", "messages": []}).encode(),
     InvalidQuestion, "empty_prompt", "messages: empty"),
    ("prompt-and-messages", event(messages=[{"role": "user", "content": "x"}]),
     InvalidQuestion, "invalid_field", "not both"),
    ("10MB-prompt", event(prompt="x" * 10_000_000),
     InvalidQuestion, "too_large", "at most 1000000 allowed"),
    ("prompt-over-char-limit", event(prompt="x" * 200_001),
     InvalidQuestion, "too_large", "prompt: 200001 characters, at most 200000 allowed"),
    ("schema-99", event(schema=99),
     InvalidQuestion, "unsupported_schema", "schema: version 99 is not supported"),
    ("schema-99-with-new-shape", event(schema=99, params="a v2 shape"),
     InvalidQuestion, "unsupported_schema", "version 99"),
    ("missing-question_id", b'{"prompt": "hi"}',
     UndecodableEvent, "missing_question_id", "question_id: missing required field"),
    ("numeric-question_id", b'{"question_id": 5, "prompt": "hi"}',
     UndecodableEvent, "missing_question_id", "got 5"),
    ("invalid-utf8", b'{"question_id": "q1", "prompt": "\xff\xfe"}',
     UndecodableEvent, "not_utf8", "UTF-8"),
    ("not-json", b'{"question_id": "q1", "prompt": ', UndecodableEvent, "not_json", "not valid JSON"),
    ("json-array", b'[{"question_id": "q1"}]', UndecodableEvent, "not_object", "got an array"),
    ("json-string", b'"what is 2+2?"', UndecodableEvent, "not_object", "got a string"),
    ("huge-without-id", b'{"prompt": "' + b"x" * 1_000_001 + b'"}',
     UndecodableEvent, "too_large", "at most 1000000 allowed"),
]


@pytest.mark.parametrize(
    "raw, exception, code, message", [case[1:] for case in BAD_EVENTS], ids=[case[0] for case in BAD_EVENTS]
)
def test_bad_events_are_rejected_with_a_precise_error(raw, exception, code, message):
    with pytest.raises(exception) as caught:
        decode_question(raw)
    error = caught.value
    if exception is InvalidQuestion:
        assert (error.code, error.question_id) == (code, "q1")
    else:
        assert error.reason == code
    assert message in error.message


def test_invalid_question_keeps_request_id_for_the_error_answer():
    with pytest.raises(InvalidQuestion) as caught:
        decode_question(event(request_id="r7", params={"temperature": -1}))
    assert caught.value.request_id == "r7"


def test_limits_are_adjustable():
    with pytest.raises(InvalidQuestion, match="at most 10 allowed"):
        decode_question(event(prompt="x" * 11), max_prompt_chars=10)
    with pytest.raises(InvalidQuestion) as caught:
        decode_question(event(), max_bytes=10)
    assert caught.value.code == "too_large"


def test_undecodable_answer_raises_msgspec_error():
    with pytest.raises(msgspec.ValidationError):
        decode_answer(b'{"text": "no id"}')
