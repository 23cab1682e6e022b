"""`kev gateway` against hostile callers and careless operators (issue 26, item 5; the gateway's side of 3 and 6).

A live stack as users run it: the embedded Tansu broker, an in-process worker on a tiny random-weight
Llama (isolation `shared`, so prefix caching is on), the keyed gateway (two tenants, one opted in to
Kev's audit) and an anonymous loopback gateway on the same topics. No mocks on the path.

- malformed headers and bodies (non-finite timeouts, deep nesting, huge numbers, wrong types, bad
  UTF-8, odd Content-Length) are 4xx in OpenAI's error shape, and a hypothesis fuzz finds no 500;
- question ids are 128 random bits; every published question is signed (kafka.trust) and stamped with
  the request's arrival time; anonymous requests each get their own cache_salt and see no cache hits;
- /health says ok and nothing more; x-kev-audit only for opted-in tenants;
- a tenant over its concurrency cap gets 429 with Retry-After, other tenants do not;
- a publish the broker does not ack in time is answered 503 and cancelled on kev.control, signed;
- `kev gateway` refuses to listen beyond the loopback without keys, and to publish unsigned.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

import anyio
import httpx
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from gateway_fixtures import API_KEY, TENANT, LiveStack, free_port, live_stack, replace, stack_config  # noqa: E402
from kafka_fixtures import kafka_config  # noqa: E402
from polling import eventually_sync  # noqa: E402

from consumers import create_topics  # noqa: E402
from schemas import decode_answer, decode_question  # noqa: E402
from schemas.control import decode_control  # noqa: E402
from schemas.signing import CANCEL, QUESTION, Verifier  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

MODEL = "tiny"
OTHER_KEY, OTHER = "sk-kev-test-2", "globex"  # a second tenant, not in gateway.audit_tenants
SEA = [{"role": "user", "content": "Say something about the sea."}]
ERROR_KEYS = {"message", "type", "param", "code"}
LONG_PROMPT = "The tide comes in over the grey stones of the harbour wall, and the gulls wait. " * 3
ID = re.compile(r"^chatcmpl-[0-9a-f]{32}$")


def run(async_fn, *args):
    return anyio.run(async_fn, *args, backend="asyncio")


@pytest.fixture(scope="module")
def keyed(kafka_broker, tiny_model) -> Iterator[LiveStack]:
    """Worker + keyed gateway: TENANT (audit on) and OTHER (audit off); short answers by default."""
    cfg = stack_config(kafka_config(kafka_broker, partitions=2), metrics_port=free_port(),
                       api_keys={API_KEY: TENANT, OTHER_KEY: OTHER}, request_timeout_ms=20_000)
    cfg = replace(cfg, sampling={"max_new_tokens": 4}, isolation={"level": "shared"})
    with live_stack(cfg, tiny_model) as running:
        yield running


@pytest.fixture(scope="module")
def anonymous(keyed) -> Iterator[LiveStack]:
    """A second gateway on the same topics and worker, without API keys (loopback, so allowed)."""
    cfg = replace(keyed.cfg, gateway={"api_keys": {}})
    with live_stack(cfg, worker=False) as running:
        yield running


def post(url: str, body, *, key: str | None = API_KEY, headers: dict | None = None,
         path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    return httpx.post(url + path, content=content, headers=sent, timeout=60)


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= response.status_code < 500 if status is None else response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"], error
    return error


async def records_of(bootstrap: str, topic: str, wanted: set[bytes], timeout: float = 20.0) -> dict:
    """key -> the first record with that key on `topic` (every key in `wanted`, or a timeout)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    found = {}
    try:
        with anyio.fail_after(timeout):
            while not wanted <= set(found):
                for records in (await consumer.getmany(timeout_ms=100)).values():
                    for record in records:
                        if record.key in wanted:
                            found.setdefault(record.key, record)
    finally:
        await consumer.stop()
    return found


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]'


# -- malformed headers and bodies: 4xx, OpenAI's shape ----------------------------------------------------

@pytest.mark.parametrize(("body", "param"), [
    (CHAT + b', "tools": ' + nested(100_000) + b"}", None),                                  # RecursionError was a 500
    (CHAT + b', "tools": ' + nested(5_000) + b"}", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "deep": '
     + nested(50_000) + b"}]}]}", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": ' + nested(50_000) + b"}]}]}", None),
    (CHAT + b', "response_format": {"type": ' + nested(900) + b"}}", None),
    (CHAT + b', "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),                         # huge numbers
    (CHAT + b', "temperature": 1e400}', "temperature"),
    (CHAT + b', "seed": 99999999999999999999999}', "seed"),
    (CHAT + b', "logit_bias": {"1": 1e308}}', "logit_bias"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),   # not UTF-8
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', None),    # a lone surrogate
    (b"\xef\xbb\xbf" + CHAT + b"}", None),                                                   # a BOM
    (b"null", None), (b'"chat"', None), (b"12", None), (b"{}", None), (b"", None),           # wrong types
    (CHAT + b', "model": 7}', "model"),
    (b'{"model": "tiny", "messages": "hi"}', "messages"),
    (b'{"model": "tiny"}', "messages"),                                                      # a required one missing
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x", "name": 5}]}', "messages[0].name"),
    (CHAT + b', "stop": ' + json.dumps(["x"] * 10_000).encode() + b"}", "stop"),
    (CHAT + b', "metadata": {"a": 1}}', "metadata[...]"),
    (CHAT + b', "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
])
def test_hostile_bodies_are_400s_in_openai_shape(keyed, body, param):
    error = assert_openai_error(post(keyed.url, body), 400)
    if param is not None:
        assert error["param"] == param, error


def test_a_deeply_nested_prompt_is_a_400(keyed):
    body = b'{"model": "tiny", "prompt": ' + nested(100_000) + b"}"
    assert_openai_error(post(keyed.url, body, path="/v1/completions"), 400)


@pytest.mark.parametrize("value", ["nan", "-1", "0", "abc", "-inf", ""])
def test_a_malformed_client_timeout_header_is_a_400(keyed, value):
    error = assert_openai_error(post(keyed.url, {"model": MODEL, "messages": SEA},
                                     headers={"x-stainless-read-timeout": value}), 400)
    assert error["param"] == "x-stainless-read-timeout"


@pytest.mark.parametrize("value", ["inf", "1e400", "1e300", "30"])
def test_an_infinite_or_huge_client_timeout_is_answered(keyed, value):
    """`inf` was a 500 (OverflowError): it means the client waits as long as the gateway lets it."""
    response = post(keyed.url, {"model": MODEL, "messages": SEA, "max_tokens": 2},
                    headers={"x-stainless-read-timeout": value})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def raw_request(url: str, head: bytes, body: bytes = b"") -> int:
    """The status of a request sent byte for byte (headers httpx would refuse to send)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + b"\r\n" + body)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1])


@pytest.mark.parametrize("header", [
    b"Content-Length: \xb2\r\n",                       # a digit to str.isdigit(), not to int()
    b"Content-Length: " + b"9" * 5000 + b"\r\n",
    b"Authorization: Bearer \xff\xfe\r\n",              # Latin-1, not ASCII
    b"Authorization: Bearer " + b"k" * 60_000 + b"\r\n",
    b"x-stainless-read-timeout: \xff\r\n",
])
def test_malformed_raw_headers_are_4xx(keyed, header):
    body = json.dumps({"model": MODEL, "messages": SEA, "max_tokens": 1}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: kev\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\n" + header)
    if not header.lower().startswith(b"content-length"):
        head += b"Content-Length: %d\r\n" % len(body)
    assert 400 <= raw_request(keyed.url, head, body) < 500


# -- a fuzz of bodies and headers: never a 500 -------------------------------------------------------------

_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
         | st.text(max_size=12))
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=12)
# Never a long answer: a token count is small, or not one Kev takes.
_tokens = st.integers(1, 4) | st.integers(-3, 0) | st.integers(2**31, 2**70) | st.text(max_size=4) | st.none()
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"]) | _json},
                              optional={"text": st.text(max_size=20) | _json})
_good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                       "content": st.text(min_size=1, max_size=30)
                                       | st.lists(_part, min_size=1, max_size=2)})
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"]) | _json},
    optional={"content": st.text(max_size=30) | st.lists(_part, max_size=3) | _json,
              "name": st.text(max_size=5) | _json})
_messages = st.lists(_good_message, min_size=1, max_size=3) | st.lists(_message, max_size=3) | _json
_FIELDS = ["temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "frequency_penalty",
           "presence_penalty", "logit_bias", "top_k", "repetition_penalty", "user", "metadata", "store",
           "service_tier", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "functions",
           "function_call", "parallel_tool_calls", "reasoning_effort", "modalities", "echo", "suffix", "best_of",
           "tenant", "cache_salt", "priority", "reply_topic", "timeout_ms", "question_id"]
# Mostly requests a worker answers, with one odd field or none; the rest are anything at all.
_extra = st.one_of(st.just({}), st.just({}), st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=8),
                                                             _json | st.booleans(), max_size=3))
_model = st.one_of(st.just(MODEL), st.just(MODEL), _json)
_chat = st.builds(lambda base, extra: {**extra, **base},
                  st.fixed_dictionaries({"model": _model, "messages": _messages},
                                        optional={"max_tokens": _tokens, "max_completion_tokens": _tokens,
                                                  "stream": st.booleans()}), _extra)
_completion = st.builds(lambda base, extra: {**extra, **base},
                        st.fixed_dictionaries({"model": _model, "prompt": st.text(max_size=30) | _json},
                                              optional={"max_tokens": _tokens, "stream": st.booleans()}), _extra)
_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"),
                       max_size=24).map(str.strip)
_headers = st.fixed_dictionaries({}, optional={
    "x-stainless-read-timeout": st.sampled_from(["inf", "1e400", "30", "600", "-inf", "nan", "0", "-1", "1e-9", "5 s"])
    | st.floats(0.5, 1e9).map(str) | _header_text,
    "content-type": _header_text,
    "x-request-id": _header_text,
})
_requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), _chat.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/completions"), _completion.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.binary(max_size=64)),
)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=_requests, headers=_headers)
def test_fuzzed_requests_never_get_a_500(keyed, request, headers):
    path, body = request
    sent = {"content-type": "application/json", **headers, "authorization": f"Bearer {API_KEY}"}
    response = httpx.post(keyed.url + path, content=body, headers={k: v.encode("latin-1") for k, v in sent.items()},
                          timeout=60)
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, (body[:300], headers, response.text[:300])
    if response.status_code >= 400:
        assert_openai_error(response)
    elif not response.headers["content-type"].startswith("text/event-stream"):
        assert response.json()["choices"], response.text


def test_after_the_fuzz_the_worker_answers_and_holds_no_kv_block(keyed):
    """Whatever the fuzz sent (streams hung up on, cancels, refusals), the worker is not stuck and leaks no
    KV block: a plain request is answered, then every block is free again."""
    answered = post(keyed.url, {"model": MODEL, "messages": SEA, "max_tokens": 2})
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] is not None
    eventually_sync(lambda: keyed.kv_blocks_used() == 0, timeout=20, every=0.2,
                    what=lambda: f"{keyed.kv_blocks_used()} KV blocks still held after the fuzz")


# -- ids, signatures, timestamps, tenants ------------------------------------------------------------------

def test_question_ids_are_random_128_bit(keyed):
    ids = [post(keyed.url, {"model": MODEL, "messages": SEA, "max_tokens": 1}).json()["id"] for _ in range(6)]
    assert all(ID.match(i) for i in ids), ids
    # A per-process prefix plus a counter shared its first half and counted up in the second.
    assert len({i[9:25] for i in ids}) == len(ids) and len({i[-8:] for i in ids}) == len(ids), ids


def test_published_questions_are_signed_stamped_and_scoped(keyed, anonymous):
    """The workers can believe the gateway (signed), measure deadlines from arrival (record timestamp), keep
    a tenant's questions together and every anonymous request apart (its own cache_salt)."""
    before = time.time_ns() // 1_000_000
    tenant_id = post(keyed.url, {"model": MODEL, "messages": SEA, "max_tokens": 1}).json()["id"]
    anonymous_ids = [post(anonymous.url, {"model": MODEL, "messages": SEA, "max_tokens": 1}, key=None).json()["id"]
                     for _ in range(2)]
    after = time.time_ns() // 1_000_000
    kafka = keyed.cfg.kafka
    found = run(partial(records_of, kafka.bootstrap_servers, kafka.questions_topic,
                        {i.encode() for i in [tenant_id, *anonymous_ids]}))
    verifier = Verifier.from_config(kafka.trust)
    for record in found.values():
        verified = verifier.verify(QUESTION, record.topic, record.key, record.value, record.headers)
        assert verified.trusted and verified.key_id == "test", verified
        assert before <= record.timestamp <= after, (before, record.timestamp, after)
        question = decode_question(record.value)
        assert question.reply_topic.startswith("kev.replies.") and question.timeout_ms == 20_000
    tenant_question = decode_question(found[tenant_id.encode()].value)
    assert tenant_question.tenant == TENANT and tenant_question.cache_salt is None
    salts = [decode_question(found[i.encode()].value).cache_salt for i in anonymous_ids]
    assert all(decode_question(found[i.encode()].value).tenant is None for i in anonymous_ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", s or "") for s in salts) and salts[0] != salts[1], salts


def test_anonymous_callers_share_no_prefix_and_see_no_cache_hits(keyed, anonymous):
    """The same long prompt twice: the tenant's second request hits its own cache; two anonymous requests
    share nothing (the worker itself reports no hit) and are told cached_tokens 0."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1}
    tenant = [post(keyed.url, body).json() for _ in range(2)]
    assert tenant[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, tenant[1]["usage"]
    strangers = [post(anonymous.url, body, key=None).json() for _ in range(2)]
    assert [s["usage"]["prompt_tokens_details"]["cached_tokens"] for s in strangers] == [0, 0]
    answers = run(partial(records_of, anonymous.cfg.kafka.bootstrap_servers, anonymous.reply_topic,
                          {s["id"].encode() for s in strangers}))
    assert [decode_answer(r.value).usage.cached_prompt_tokens for r in answers.values()] == [0, 0]


# -- what the gateway tells whom ---------------------------------------------------------------------------

def test_health_says_ok_and_nothing_more(keyed):
    response = httpx.get(keyed.url + "/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def _stream_comments(url: str, key: str | None) -> list[str]:
    body = {"model": MODEL, "messages": SEA, "max_tokens": 2, "stream": True}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith(":")]


def test_the_audit_header_goes_only_to_opted_in_tenants(keyed, anonymous):
    body = {"model": MODEL, "messages": SEA, "max_tokens": 2}
    opted_in = post(keyed.url, body)
    assert json.loads(opted_in.headers["x-kev-audit"])["audit"]["worker"] == keyed.worker
    for response in (post(keyed.url, body, key=OTHER_KEY), post(anonymous.url, body, key=None)):
        assert response.status_code == 200 and "x-kev-audit" not in response.headers
        assert response.headers["x-kev-finish-reason"] in ("stop", "length")  # their own answer's reason stays
    assert any(c.startswith(": x-kev-audit ") for c in _stream_comments(keyed.url, API_KEY))
    assert _stream_comments(keyed.url, OTHER_KEY) == [] and _stream_comments(anonymous.url, None) == []


# -- the concurrency cap, and a publish the broker does not ack in time -------------------------------------

@pytest.fixture(scope="module")
def unanswered(kafka_broker) -> Iterator[LiveStack]:
    """A gateway on topics no worker reads: its questions wait, holding their tenant's slots. Cap: 2."""
    cfg = stack_config(kafka_config(kafka_broker), api_keys={API_KEY: TENANT, OTHER_KEY: OTHER},
                       max_concurrent_per_tenant=2, request_timeout_ms=60_000)
    run(create_topics, cfg.kafka, {cfg.kafka.questions_topic: 2, cfg.kafka.control_topic: 1})
    with live_stack(cfg, worker=False) as running:
        yield running


def _open_stream(stack: ExitStack, url: str, key: str) -> httpx.Response:
    client = stack.enter_context(httpx.Client(timeout=60))
    body = {"model": MODEL, "messages": SEA, "max_tokens": 2, "stream": True}
    return stack.enter_context(client.stream("POST", url + "/v1/chat/completions", json=body,
                                             headers={"authorization": f"Bearer {key}"}))


def test_a_tenant_over_its_cap_gets_429_with_retry_after(unanswered):
    with ExitStack() as held:
        assert [_open_stream(held, unanswered.url, API_KEY).status_code for _ in range(2)] == [200, 200]
        for stream in (False, True):
            refused = post(unanswered.url, {"model": MODEL, "messages": SEA, "stream": stream})
            error = assert_openai_error(refused, 429)
            assert error["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
        assert _open_stream(held, unanswered.url, OTHER_KEY).status_code == 200  # another tenant is not held up
    # The clients hung up: their questions were cancelled and their slots freed.
    def a_slot_again() -> bool:
        with ExitStack() as held:
            return _open_stream(held, unanswered.url, API_KEY).status_code == 200

    eventually_sync(a_slot_again, timeout=10, every=0.1, what="the tenant's slots given back")


@contextmanager
def _paused(broker, seconds: float):
    """The broker stopped (SIGSTOP) and continued `seconds` later by a timer: the gateway sends its cancel
    and waits for it (up to 2 s) before it answers, so the test's own thread cannot continue the broker."""
    broker.send_signal(signal.SIGSTOP)
    timer = threading.Timer(seconds, broker.send_signal, (signal.SIGCONT,))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        broker.send_signal(signal.SIGCONT)


def test_a_publish_not_acked_in_time_is_a_503_and_cancelled(kafka_broker):
    """publish_timeout_ms 200 with the broker paused for 0.7 s: it is up, but its ack comes too late (an
    unpaused broker on loopback can ack within 1 ms). The question may still land on the questions topic,
    so the gateway cancels it on kev.control, signed and keyed by its id."""
    cfg = stack_config(kafka_config(kafka_broker), publish_timeout_ms=200)
    run(create_topics, cfg.kafka, {cfg.kafka.questions_topic: 2, cfg.kafka.control_topic: 1})
    with live_stack(cfg, worker=False) as stack:
        with ExitStack() as held, _paused(kafka_broker, 0.7):
            response = _open_stream(held, stack.url, API_KEY)
            response.read()
        assert_openai_error(response, 503)
        question_id = response.headers["x-request-id"]
    kafka = cfg.kafka
    cancel_key = f"cancel:{question_id}".encode()
    cancel = run(partial(records_of, kafka.bootstrap_servers, kafka.control_topic, {cancel_key}))[cancel_key]
    verifier = Verifier.from_config(kafka.trust)
    assert verifier.verify(CANCEL, cancel.topic, cancel.key, cancel.value, cancel.headers).trusted
    event = decode_control(cancel.value)
    assert event.action == "cancel" and event.question_id == question_id


def test_a_question_too_large_for_the_broker_is_a_413_and_the_gateway_stays_healthy(kafka_broker):
    """kafka.max_request_size 2,048: a 1,900-character prompt passes the gateway's own checks but not the
    producer's record limit. That is this request's fault, not the broker's: 413, /health still ok."""
    cfg = stack_config(kafka_config(kafka_broker, max_request_size=2048))
    run(create_topics, cfg.kafka, {cfg.kafka.questions_topic: 2, cfg.kafka.control_topic: 1})
    with live_stack(cfg, worker=False) as stack:
        with ExitStack() as held:  # published and acked (no worker answers it): the broker works
            assert _open_stream(held, stack.url, API_KEY).status_code == 200
        large = post(stack.url, {"model": MODEL, "messages": [{"role": "user", "content": "sea " * 475}],
                                 "max_tokens": 1})
        assert assert_openai_error(large, 413)["code"] == "too_large"
        health = httpx.get(stack.url + "/health", timeout=10)
        assert (health.status_code, health.json()) == (200, {"status": "ok"})


# -- refusing to start --------------------------------------------------------------------------------------

def _kev_gateway(capsys, tmp_path, *args: str, config: dict | None = None) -> tuple[int, str]:
    from kev_async.cli import main

    argv = ["gateway", "--bootstrap-servers", "127.0.0.1:1", "--port", "0", *args]
    if config is not None:
        path = tmp_path / "kev.yaml"
        path.write_bytes(msgspec.json.encode(config))
        argv += ["--config", str(path)]
    code = main(argv)
    return code, _without_log_lines(capsys.readouterr().err)


def _without_log_lines(err: str) -> str:
    """stderr less the JSON log lines of the module's live gateway, which can land in the capture at any time
    (a fuzzed client's hang-up, logged as it is noticed): the CLI's own words are what is asserted."""
    kept = []
    for line in err.splitlines(keepends=True):
        try:
            if "event" in json.loads(line):
                continue
        except (ValueError, TypeError):
            pass
        kept.append(line)
    return "".join(kept)


# The gateway's key may sign questions and cancels, nothing else (kev_async/gateway/exposure.py).
TRUST = {"kafka": {"trust": {"keys": {"gw": {"secret": "a-gateway-secret-0123456789",
                                              "scopes": ["questions", "cancel"]}}}}}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "kev.example.com"])
def test_kev_gateway_refuses_to_listen_beyond_loopback_without_keys(capsys, tmp_path, host):
    code, err = _kev_gateway(capsys, tmp_path, "--host", host, config=TRUST)
    assert code == 2 and err.count("\n") == 1, err
    assert f"refusing to listen on {host} without API keys" in err and "--allow-anonymous" in err
    # Anonymous by choice still needs the trust key: every anonymous request's cache_salt must be honoured.
    code, err = _kev_gateway(capsys, tmp_path, "--host", host, "--allow-anonymous")
    assert code == 2 and "kafka.trust.keys" in err, err


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                                ("[::1]", True), ("localhost", True), ("LOCALHOST", True),
                                                ("0.0.0.0", False), ("::", False), ("192.168.1.1", False),
                                                ("localhost.evil.com", False)])
def test_what_counts_as_loopback(host, loopback):
    from kev_async.gateway.exposure import is_loopback

    assert is_loopback(host) is loopback


@pytest.mark.parametrize("config", [{"gateway": {"api_keys": {"sk-1": "acme"}}}, None])
def test_kev_gateway_refuses_to_publish_unsigned(capsys, tmp_path, config):
    """Workers honour a reply topic or a tenant only when signed: unsigned, no answer would ever come back."""
    code, err = _kev_gateway(capsys, tmp_path, config=config)
    assert code == 2 and err.count("\n") == 1, err
    assert "kafka.trust.keys is empty" in err and "no answer would come back" in err
    code, err = _kev_gateway(capsys, tmp_path, config={"kafka": {"trust": {"keys": {"ops": "too-short"}}}})
    assert code == 2 and "at least 16 needed" in err, err


@pytest.mark.parametrize(("args", "config"), [
    (["--host", "0.0.0.0", "--allow-anonymous"], TRUST),
    (["--host", "0.0.0.0"], {**TRUST, "gateway": {"api_keys": {"sk-1": "acme"}}}),
    ([], TRUST),  # loopback, anonymous: a developer's laptop
])
def test_kev_gateway_starts_when_it_is_safe(tmp_path, args, config):
    """Past the checks, it goes on to the brokers (none at 127.0.0.1:1): exit 1 for that, not 2. A process of
    its own, as `kev gateway` configures logging for good."""
    import subprocess

    from serve_fixtures import KEV, ROOT, kev_env

    argv = [str(KEV), "gateway", "--bootstrap-servers", "127.0.0.1:1", "--port", "0", *args]
    if config is not None:
        (tmp_path / "kev.yaml").write_bytes(msgspec.json.encode(config))
        argv += ["--config", str(tmp_path / "kev.yaml")]
    done = subprocess.run(argv, env=kev_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "kev gateway: cannot reach the brokers" in done.stderr, done.stderr
