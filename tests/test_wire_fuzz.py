"""Fuzzing the wire's two gates: whatever bytes a producer sends, `decode_question` gives a valid
QuestionEvent within every bound, or UndecodableEvent (a dead letter), or InvalidQuestion (an error
answer that fits on the wire), and nothing else; `decode_control` gives a ControlEvent or
InvalidControl. Any other exception would reach the consumer loop as a crash.
"""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from schemas import (
    ControlEvent,
    InvalidControl,
    InvalidQuestion,
    LimitsConfig,
    QuestionEvent,
    UndecodableEvent,
    control_key,
    decode_control,
    decode_question,
    encode,
    error_answer,
)
from schemas._validation import ID_CHARS_CEILING, TOPIC_CHARS_CEILING

SMALL = LimitsConfig(max_event_bytes=4096, max_id_chars=16, max_messages=3, max_prompt_chars=300,
                     max_control_bytes=2048)
LIMITS = st.sampled_from([SMALL, LimitsConfig()])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Strings around the bounds that matter: empty, short, just over the small limits, over the ceilings.
sizes = st.sampled_from([0, 1, 15, 16, 17, 255, 256, 257, 300, 1200])
short = st.text(min_size=1, max_size=12)
texts = st.one_of(st.text(max_size=20), st.text(max_size=20),
                  st.builds(lambda c, n: c * n, st.sampled_from("a é\x00\ud7ff"), sizes))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True), texts)
trees = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                      st.dictionaries(texts, inner, max_size=5)), max_leaves=20)


def deep(depth: int) -> st.SearchStrategy:
    """JSON nested `depth` levels: msgspec's recursion limit must not leak out as RecursionError."""
    return st.just(msgspec.Raw(b"[" * depth + b"]" * depth))


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                           "content": texts}), max_size=5)
params = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.floats(-1, 20), trees), "max_new_tokens": st.integers(-5, 50_000),
    "top_p": st.floats(0, 2), "stop": st.lists(texts, max_size=20), "seed": st.integers(-1, 2**64)})
QUESTION_FIELDS = {
    "question_id": texts, "prompt": texts, "messages": messages, "request_id": texts, "tenant": texts,
    "cache_salt": texts, "system": texts, "params": params, "adapter": texts,
    "priority": st.integers(-200, 200), "timeout_ms": st.integers(-1, 10**9), "stream": st.booleans(),
    "reply_topic": texts, "schema": st.sampled_from([1, 1, 2, "1", None])}
def field(values: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the field's kind, sometimes any JSON, rarely JSON nested past any limit."""
    return st.one_of(values, values, values, values, trees, deep(1500))


question_trees = st.one_of(
    st.fixed_dictionaries({}, optional={name: field(values) for name, values in QUESTION_FIELDS.items()}),
    st.fixed_dictionaries(  # close to valid: an id and a prompt or messages, a few more fields
        {"question_id": st.one_of(short, short, texts)},
        optional={"prompt": st.one_of(short, short, texts), "messages": messages,
                  **{name: field(values) for name, values in QUESTION_FIELDS.items()
                     if name not in ("question_id", "prompt", "messages", "schema")}}),
    st.fixed_dictionaries(  # every field of its kind: valid unless a bound is crossed
        {"question_id": short, "prompt": short},
        optional={name: values for name, values in QUESTION_FIELDS.items()
                  if name not in ("question_id", "prompt", "messages", "schema", "params")}),
    st.fixed_dictionaries({"question_id": short, "prompt": short, "colour": deep(1500)}))


def as_bytes(tree) -> bytes:
    return msgspec.json.encode(tree)


def mangled(data: bytes) -> st.SearchStrategy[bytes]:
    """Truncations and byte flips of a well-formed event."""
    return st.one_of(
        st.integers(0, len(data)).map(lambda n: data[:n]),
        st.tuples(st.integers(0, max(0, len(data) - 1)), st.integers(0, 255)).map(
            lambda f: data[:f[0]] + bytes([f[1]]) + data[f[0] + 1:]))


question_bytes = st.one_of(
    st.binary(max_size=200),
    question_trees.map(as_bytes),
    trees.map(as_bytes),
    question_trees.map(as_bytes).flatmap(mangled),
)


def within_bounds(question: QuestionEvent, limits: LimitsConfig) -> None:
    for name in ("question_id", "request_id", "tenant", "cache_salt", "adapter"):
        value = getattr(question, name)
        assert value is None or len(value) <= limits.max_id_chars, name
    assert 0 < len(question.question_id)
    assert question.reply_topic is None or len(question.reply_topic) <= TOPIC_CHARS_CEILING
    assert question.messages is None or len(question.messages) <= limits.max_messages
    prompt = len(question.prompt or "") + len(question.system or "") + sum(
        len(m.content) for m in question.messages or ())
    assert prompt <= limits.max_prompt_chars
    assert -100 <= question.priority <= 100 and len(question.params.stop) <= 16


@FUZZ
@given(data=question_bytes, limits=LIMITS)
@example(data=b'{"prompt":"!","\x80":0,"question_id":" "}', limits=SMALL)  # an unknown key that is not UTF-8
def test_any_question_bytes_give_a_bounded_question_or_one_of_two_errors(data, limits):
    try:
        question = decode_question(data, limits=limits)
    except UndecodableEvent as bad:
        assert bad.reason and len(bad.message) <= 1000
    except InvalidQuestion as bad:
        assert 0 < len(bad.question_id) <= ID_CHARS_CEILING
        assert bad.request_id is None or len(bad.request_id) <= limits.max_id_chars
        # The error answer carries only bounded fields: it always fits a producer's request.
        assert len(encode(error_answer(bad.question_id, bad.request_id, bad.code, bad.message))) < 8192
    else:
        assert isinstance(question, QuestionEvent)
        within_bounds(question, limits)
        assert decode_question(encode(question), limits=limits) == question  # what is served re-encodes


control_trees = st.fixed_dictionaries({}, optional={
    "action": st.one_of(st.sampled_from(["load_adapter", "unload_adapter", "update_defaults", "cancel"]), trees),
    "name": texts, "path": texts, "question_id": texts, "schema": st.sampled_from([1, 2]),
    "defaults": st.one_of(st.dictionaries(st.one_of(st.sampled_from(["temperature", "top_k", "seed"]), texts),
                                          st.one_of(st.integers(-5, 10**6), st.floats(-1, 20)), max_size=20),
                          trees, deep(1500))})
control_bytes = st.one_of(st.binary(max_size=200), control_trees.map(as_bytes),
                          control_trees.map(as_bytes).flatmap(mangled))


@FUZZ
@given(data=control_bytes)
def test_any_control_bytes_give_a_bounded_command_or_invalid_control(data):
    try:
        event = decode_control(data, max_bytes=SMALL.max_control_bytes)
    except InvalidControl as bad:
        assert bad.reason and len(bad.message) <= 1000
    else:
        assert isinstance(event, ControlEvent)
        assert event.name is None or 0 < len(event.name) <= ID_CHARS_CEILING
        assert event.question_id is None or 0 < len(event.question_id) <= ID_CHARS_CEILING
        assert event.path is None or len(event.path) <= 4096
        assert event.defaults is None or 0 < len(event.defaults) <= 16
        assert len(control_key(event)) <= 4 * ID_CHARS_CEILING + 200


def test_an_unknown_key_that_is_not_utf8_gets_an_error_answer():
    """The question decoder skips unknown keys unread; one with bytes that are not UTF-8 is still
    answered (the question is named), never an exception the consumer loop does not expect."""
    data = b'{"question_id":"q1","request_id":"r1","prompt":"hi","\x80\xff":0}'
    try:
        decode_question(data)
    except InvalidQuestion as bad:
        assert (bad.question_id, bad.request_id, bad.code) == ("q1", "r1", "not_utf8")
        assert "byte" in bad.message
    else:
        raise AssertionError("decoded")
