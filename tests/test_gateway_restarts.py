"""A streamed question redelivered to a second worker (issue 39, finding 7): the gateway relays one
attempt's deltas and never splices two answers. And an answer that lands before its last deltas (with
exactly_once delivery the answer is in the worker's transaction, its deltas outside it): the stream still
gives every token once, with its logprob.

A live gateway on the embedded Tansu broker with no worker; the test plays the workers, producing
deltas (each stamped with its worker's attempt) and the final answer to the gateway's own reply
topic, and reads what an SSE client receives. No mocks on the path.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from functools import partial

import anyio
import httpx
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from gateway_fixtures import API_KEY, LiveStack, live_stack, stack_config  # noqa: E402
from kafka_fixtures import kafka_config, produce, read_topic  # noqa: E402

from consumers import create_topics  # noqa: E402
from schemas import AnswerDelta, AnswerEvent, Audit, TokenLogprob, Usage, decode_question, encode  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

MODEL = "tiny"
OTHER_KEY = "sk-kev-test-other"
SEA = [{"role": "user", "content": "Say something about the sea."}]


def run(async_fn, *args):
    return anyio.run(async_fn, *args, backend="asyncio")


@pytest.fixture(scope="module")
def gateway(kafka_broker) -> Iterator[LiveStack]:
    cfg = stack_config(kafka_config(kafka_broker), api_keys={API_KEY: "acme", OTHER_KEY: "globex"},
                       request_timeout_ms=60_000)
    run(create_topics, cfg.kafka, {cfg.kafka.questions_topic: 2, cfg.kafka.control_topic: 1})
    with live_stack(cfg, worker=False) as running:
        yield running


def deltas(question_id: str, attempt: str, pieces: list[str]) -> list[bytes]:
    return [encode(AnswerDelta(question_id, seq, text, done=seq == len(pieces) - 1, attempt=attempt))
            for seq, text in enumerate(pieces)]


def final(question_id: str, attempt: str, text: str) -> bytes:
    return encode(AnswerEvent(question_id, text=text, usage=Usage(5, 6), audit=Audit(worker="w2", attempt=attempt)))


def stream_with_replies(stack: LiveStack, replies, *, path: str = "/v1/chat/completions",
                        extra: dict | None = None) -> tuple[str, list]:
    """Open a stream, play the workers' replies to the gateway's reply topic, return (its id, its events)."""
    body = {"model": MODEL, "stream": True, **({"messages": SEA} if "chat" in path else {"prompt": "The sea"}),
            **(extra or {})}
    kafka = stack.cfg.kafka
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", stack.url + path, json=body, headers={"authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        question_id = response.headers["x-request-id"]
        run(partial(produce, kafka.bootstrap_servers, stack.reply_topic, replies(question_id),
                    key=question_id.encode()))
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    return question_id, [json.loads(event) for event in events[:-1]]


def stream_when_answered(stack: LiveStack, replies, extra: dict) -> list:
    """As stream_with_replies, for a stream whose headers wait for the first reply (tools offered): the
    question's id is read off the questions topic (the one asked with `extra`'s tools), not the headers."""
    body = {"model": MODEL, "stream": True, "messages": SEA, **extra}
    got: dict = {}

    def ask() -> None:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", stack.url + "/v1/chat/completions", json=body,
                headers={"authorization": f"Bearer {API_KEY}"}) as response:
            got["events"] = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]

    asking = threading.Thread(target=ask)
    asking.start()
    kafka = stack.cfg.kafka
    for _ in range(40):
        asked = [decode_question(r.value) for r in run(partial(read_topic, kafka.bootstrap_servers,
                                                               kafka.questions_topic, 1, linger=0.2))]
        if ids := [question.question_id for question in asked if question.tools]:
            break
    run(partial(produce, kafka.bootstrap_servers, stack.reply_topic, replies(ids[-1]), key=ids[-1].encode()))
    asking.join(timeout=60)
    assert got["events"][-1] == "[DONE]", got
    return [json.loads(event) for event in got["events"][:-1]]


def text_of(events: list[dict]) -> str:
    return "".join(choice["delta"].get("content") or "" for event in events for choice in event.get("choices", []))


def test_a_restart_that_diverges_ends_the_stream_with_an_error_and_keeps_the_whole_answer(gateway):
    """The first worker streamed "The capital is a river." and died; the second answered differently. The
    client gets the first attempt's text, then OpenAI's error event naming the restart, never a splice."""
    def replies(qid: str) -> list[bytes]:
        return [*deltas(qid, "w1-a", ["The capital", " is a river."]),
                *deltas(qid, "w2-b", ["Sure!", " Paris", " has a river."]),
                final(qid, "w2-b", "Sure! Paris has a river.")]

    question_id, events = stream_with_replies(gateway, replies)
    assert text_of(events) == "The capital is a river."  # one attempt's text only
    error = events[-1]["error"]
    assert error["code"] == "stream_restarted" and error["type"] == "server_error", error
    assert "restarted" in error["message"] and f"/v1/chat/completions/{question_id}" in error["message"], error
    assert not any(event.get("choices") and event["choices"][0]["finish_reason"] for event in events)

    kept = httpx.get(f"{gateway.url}/v1/chat/completions/{question_id}", timeout=30,
                     headers={"authorization": f"Bearer {API_KEY}"})
    assert kept.status_code == 200, kept.text
    whole = kept.json()
    assert whole["id"] == question_id and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == "Sure! Paris has a river."
    assert whole["usage"]["completion_tokens"] == 6
    for key in (OTHER_KEY, "sk-nobody"):  # another tenant, or no tenant at all, cannot read it
        assert httpx.get(f"{gateway.url}/v1/chat/completions/{question_id}", timeout=30,
                         headers={"authorization": f"Bearer {key}"}).status_code in (401, 404)


def test_a_restart_that_extends_what_was_sent_finishes_normally(gateway):
    """The first worker sent "Sure!" and died; the second (same seed) computed the same start: its deltas
    are not relayed, and the rest of its final answer is sent as the tail."""
    def replies(qid: str) -> list[bytes]:
        return [*deltas(qid, "w1-a", ["Sure!"]),
                *deltas(qid, "w2-b", ["Sure!", " Paris", " has a river."]),
                final(qid, "w2-b", "Sure! Paris has a river.")]

    _, events = stream_with_replies(gateway, replies)
    assert text_of(events) == "Sure! Paris has a river."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("error" in event for event in events)


def test_deltas_that_land_after_their_answer_still_give_every_token_and_its_logprob(gateway):
    """Two deltas, the answer, then the last three deltas: the client gets the whole text and each token's
    logprob once, the last three from the answer."""
    tokens = ["The", " sea", " is", " wide", "."]
    scored = tuple(TokenLogprob(token, i, -0.5 - i) for i, token in enumerate(tokens))

    def replies(qid: str) -> list[bytes]:
        pieces = [AnswerDelta(qid, seq, tokens[seq], done=seq == 4, attempt="w1-a", logprobs=(scored[seq],))
                  for seq in range(5)]
        answer = AnswerEvent(qid, text="".join(tokens), usage=Usage(5, 5), audit=Audit(worker="w1", attempt="w1-a"),
                             logprobs=scored)
        return [*map(encode, pieces[:2]), encode(answer), *map(encode, pieces[2:])]

    _, events = stream_with_replies(gateway, replies, extra={"logprobs": True})
    assert text_of(events) == "The sea is wide."
    sent = [(entry["token"], entry["logprob"]) for event in events for choice in event.get("choices", [])
            if choice.get("logprobs") for entry in choice["logprobs"]["content"]]
    assert sent == [(entry.token, entry.logprob) for entry in scored]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_tool_call_whose_deltas_land_after_its_answer_still_gives_every_logprob(gateway):
    """The same with tools offered: the call's last pieces come from the answer, and so do their logprobs."""
    from tool_fixtures import TOOLS

    CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    pieces_text = ["<tool_call>", CALL[len("<tool_call>"):-20], CALL[-20:]]
    scored = tuple(TokenLogprob(piece, i, -0.25 - i) for i, piece in enumerate(pieces_text))

    def replies(qid: str) -> list[bytes]:
        pieces = [AnswerDelta(qid, seq, text, done=seq == 2, attempt="w1-a", logprobs=(scored[seq],))
                  for seq, text in enumerate(pieces_text)]
        answer = AnswerEvent(qid, text=CALL, usage=Usage(5, 3), audit=Audit(worker="w1", attempt="w1-a"),
                             logprobs=scored)
        return [encode(pieces[0]), encode(answer), *map(encode, pieces[1:])]

    events = stream_when_answered(gateway, replies, extra={"logprobs": True, "tools": TOOLS})
    calls = [call for event in events for choice in event.get("choices", [])
             for call in choice["delta"].get("tool_calls") or ()]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(call["function"].get("arguments") or "" for call in calls)) == {"city": "Paris", "days": 2}
    sent = [(entry["token"], entry["logprob"]) for event in events for choice in event.get("choices", [])
            if choice.get("logprobs") for entry in choice["logprobs"]["content"]]
    assert sent == [(entry.token, entry.logprob) for entry in scored]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_completions_stream_that_diverges_ends_with_the_error_too(gateway):
    def replies(qid: str) -> list[bytes]:
        return [*deltas(qid, "w1-a", [" is blue"]), *deltas(qid, "w2-b", [" is grey"]),
                final(qid, "w2-b", " is grey and cold")]

    question_id, events = stream_with_replies(gateway, replies, path="/v1/completions")
    assert "".join(event["choices"][0]["text"] for event in events if event.get("choices")) == " is blue"
    assert events[-1]["error"]["code"] == "stream_restarted"
    kept = httpx.get(f"{gateway.url}/v1/completions/{question_id}", timeout=30,
                     headers={"authorization": f"Bearer {API_KEY}"})
    assert kept.status_code == 200 and kept.json()["choices"][0]["text"] == " is grey and cold"


def test_kept_answers_are_bounded_in_count_bytes_and_time_and_scoped_to_their_tenant():
    from kev_async.gateway.kept_answers import KeptAnswers

    now = [0.0]
    kept = KeptAnswers(keep_s=60, max_count=3, max_bytes=4096, clock=lambda: now[0])

    def keep(answer_id: str, text: str, tenant: str | None = "acme") -> bool:
        return kept.keep(answer_id, AnswerEvent(answer_id, text=text), tenant=tenant, model=MODEL, created=0,
                         chat=True)

    assert keep("a", "x") and keep("b", "y") and keep("c", "z", tenant=None)
    assert kept.get("a", "globex") is None and kept.get("c", "acme") is None  # another tenant's, or anonymous
    assert kept.get("a", "acme").answer.text == "x" and kept.get("c", None).answer.text == "z"
    assert keep("d", "w")
    assert kept.get("a", "acme") is None and kept.get("d", "acme") is not None  # the oldest went first
    assert keep("e", "v" * 3000)  # fits alone, but not with the others: they go
    assert kept.get("b", "acme") is None and kept.get("e", "acme") is not None
    assert not keep("f", "v" * 5000)  # larger than the whole store: not kept
    now[0] = 61
    assert kept.get("e", "acme") is None  # expired
