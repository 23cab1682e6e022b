"""`kev gateway` with the official `openai` client and `httpx`, against a live stack: the embedded Tansu
broker, an in-process worker on a tiny random-weight Llama, and the gateway. No mocks on the path.

- chat and legacy completions, whole and streamed (a seeded sampled stream joins to the whole answer's
  text), `models.list()`, adapters from kev.control, auth (401), a greedy n=2 and other bad input (4xx in
  OpenAI's error shape, nothing published);
- a stream the client abandons is cancelled: the worker ends the question `cancelled` and frees its
  KV blocks;
- 200 concurrent requests, half of them streamed: every one gets its own answer;
- the broker gone: 503 in about `publish_timeout_ms`, never a hang;
- the Kafka pieces under the gateway: deltas follow a question's reply_topic, and a worker replaying
  kev.control skips old cancels.
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import time
from functools import partial

import anyio
import httpx
import msgspec
import openai
import pytest
from aiokafka import AIOKafkaConsumer

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from gateway_fixtures import (API_KEY, SESSION_ENV, TENANT, TRUST_KEY_ID, TRUST_SECRET, live_stack,  # noqa: E402
                              produce_commands, produce_signed, stack_config)
from kafka_fixtures import kafka_config, read_topic, running_worker  # noqa: E402
from polling import eventually_sync  # noqa: E402

from consumers import EmbeddedBroker, create_topics, run_control_reader  # noqa: E402
from schemas import ControlEvent, decode_answer, decode_question, encode  # noqa: E402
from schemas.signing import QUESTION  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

MODEL = "tiny"
SEA = [{"role": "user", "content": "Say something about the sea."}]
ERROR_KEYS = {"message", "type", "param", "code"}


def run(async_fn, *args):
    return anyio.run(async_fn, *args, backend="asyncio")


def post(stack, path: str, body, *, key: str | None = API_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.url + path, content=content, headers={**headers, "content-type": "application/json"},
                      timeout=30)


async def replies_for(bootstrap: str, topic: str, question_id: str, timeout: float = 20.0) -> list:
    """Every reply record for `question_id` on `topic` up to and with its answer (deltas decoded as dicts)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    found = []
    try:
        with anyio.fail_after(timeout):
            while True:
                for records in (await consumer.getmany(timeout_ms=100)).values():
                    for record in records:
                        if record.key != question_id.encode():
                            continue
                        data = msgspec.json.decode(record.value)
                        found.append(data)
                        if "seq" not in data:
                            return found
    finally:
        await consumer.stop()


# -- through the openai client ----------------------------------------------------------------------------

def test_chat_completion_has_usage_and_kev_audit_header(client, stack):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=SEA, max_tokens=8)
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == MODEL
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert 1 <= usage.completion_tokens <= 8 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    kev = json.loads(raw.headers["x-kev-audit"])
    assert kev["audit"]["worker"] == stack.worker and kev["audit"]["blocks"]
    assert raw.headers["x-request-id"] == completion.id


def test_a_body_without_model_is_answered_by_the_served_model(stack):
    """As vLLM and llama.cpp's server take it; the response names the model that answered."""
    response = post(stack, "/v1/chat/completions", {"messages": SEA, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL and response.json()["choices"][0]["message"]["content"]


def test_completion(client):
    completion = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=6)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.choices[0].text and completion.choices[0].finish_reason in ("stop", "length")
    assert 1 <= completion.usage.completion_tokens <= 6


def test_completion_continues_the_prompt_as_given(client, tiny_model):
    # As OpenAI's and llama.cpp's /v1/completions: the prompt's own tokens, no chat template around them.
    prompt = "Once upon a time"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert completion.usage.prompt_tokens == len(tiny_model.tokenizer.encode(prompt))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    assert chat.usage.prompt_tokens > completion.usage.prompt_tokens  # the template's tokens around the prompt


def test_usage_counts_the_tokens_the_engine_alone_answers_with(client, stack, tiny_model):
    # Token accounting agrees across paths: the question the gateway published, asked of kev's Engine alone
    # (the worker's options), gives the same text and the same number of completion tokens.
    from engine import Engine, EngineOptions

    messages = [{"role": "user", "content": "Count the waves, one by one."}]
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=13, temperature=0)
    published = run(read_topic, stack.cfg.kafka.bootstrap_servers, stack.cfg.kafka.questions_topic, 1)
    questions = [decode_question(record.value) for record in published]
    (question,) = [q for q in questions if q.messages and q.messages[-1].content == messages[0]["content"]]

    async def alone():
        async with Engine(tiny_model, EngineOptions.from_config(stack.cfg, worker="alone")) as engine:
            return await engine.wait(await engine.submit(question))

    answer = run(alone)
    assert completion.usage.completion_tokens == len(answer.token_ids) == answer.usage.completion_tokens
    assert completion.choices[0].message.content == answer.text
    assert completion.usage.prompt_tokens == answer.usage.prompt_tokens


def test_seeded_stream_joins_to_the_same_text_as_the_whole_answer(client):
    params = dict(model=MODEL, messages=SEA, max_tokens=24, temperature=0.9, seed=11)
    whole = client.chat.completions.create(**params).choices[0].message.content
    chunks = list(client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    # Legacy completions stream the same way.
    text = dict(model=MODEL, prompt="Waves", max_tokens=12, temperature=0.9, seed=5)
    whole = client.completions.create(**text).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(**text, stream=True)) == whole


def test_models_list_and_adapters_from_the_control_topic(client, stack):
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="no-such-model", messages=SEA, max_tokens=4)

    kafka = stack.cfg.kafka
    load = ControlEvent(action="load_adapter", name="sea-lora", path="/nowhere/sea-lora")
    run(produce_commands, kafka.bootstrap_servers, kafka.control_topic, [load])
    eventually_sync(lambda: "sea-lora" in [m.id for m in client.models.list()], timeout=10, every=0.1,
                    what="the adapter in /v1/models")
    # The gateway names it as the question's adapter; the worker could not load /nowhere, so it answers
    # unknown_adapter, which an OpenAI client sees as a 404 on `model`.
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="sea-lora", messages=SEA, max_tokens=4)
    assert error.value.body["param"] == "model"
    unload = ControlEvent(action="unload_adapter", name="sea-lora")
    run(produce_commands, kafka.bootstrap_servers, kafka.control_topic, [unload])
    eventually_sync(lambda: "sea-lora" not in [m.id for m in client.models.list()], timeout=10, every=0.1,
                    what="the adapter gone from /v1/models")


def test_bad_key_is_401_and_tenant_comes_from_the_key(stack):
    with openai.OpenAI(base_url=stack.base_url, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=MODEL, messages=SEA, max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    assert post(stack, "/v1/chat/completions", {"model": MODEL, "messages": SEA}, key=None).status_code == 401

    answer = post(stack, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()
    kafka = stack.cfg.kafka
    records = run(partial(read_topic, kafka.bootstrap_servers, kafka.questions_topic, 10**6, timeout=2.0, linger=0))
    asked = [decode_question(r.value) for r in records if r.key == answer["id"].encode()]
    assert [q.tenant for q in asked] == [TENANT]


def test_greedy_n_2_is_a_400_naming_n(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=SEA, n=2, temperature=0)
    assert error.value.status_code == 400 and error.value.body["param"] == "n"


@pytest.mark.parametrize(("body", "status", "param"), [
    (b'{"model": "tiny", "messages": [', 400, None),                                     # malformed JSON
    (b'[1, 2]', 400, None),                                                              # not an object
    ({"model": MODEL, "messages": SEA, "max_tokens": "ten"}, 400, "max_tokens"),         # wrong type
    ({"model": MODEL, "messages": SEA, "tenant": "evil"}, 400, "tenant"),                # unknown field
    ({"model": MODEL}, 400, None),                                                       # no messages
    ({"model": MODEL, "messages": SEA, "temperature": -1}, 400, "temperature"),          # out of range
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2001}]}, 400, "messages"),  # too long
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ({"model": MODEL, "messages": SEA, "top_logprobs": 2}, 400, "top_logprobs"),         # without logprobs
    ({"model": MODEL, "messages": SEA, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": SEA, "n": 17, "temperature": 1}, 400, "n"),
    (b"{" + b" " * 1_000_001 + b"}", 413, None),
])
def test_bad_input_gets_an_openai_error_and_publishes_nothing(stack, body, status, param):
    response = post(stack, "/v1/chat/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_nothing_bad_reaches_the_questions_topic(stack):
    kafka = stack.cfg.kafka
    count = partial(read_topic, kafka.bootstrap_servers, kafka.questions_topic, 10**6, timeout=1.0, linger=0)
    before = len(run(count))
    for body in ({"model": MODEL, "messages": SEA, "n": 3, "temperature": 0},
                 {"model": MODEL, "messages": SEA, "max_tokens": 0},
                 {"model": MODEL, "prompt": ["a", "b"]}):
        assert post(stack, "/v1/chat/completions", body).status_code == 400
    assert post(stack, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}).status_code == 400
    after = len(run(count))
    assert after == before


def test_abandoned_stream_is_cancelled_and_frees_its_kv_blocks(client, stack):
    stream = client.chat.completions.create(model=MODEL, messages=SEA, max_tokens=900, stream=True)
    chunks = [next(stream) for _ in range(4)]
    assert stack.kv_blocks_used() > 0
    stream.close()  # the client hangs up mid-answer

    replies = run(replies_for, stack.cfg.kafka.bootstrap_servers, stack.reply_topic, chunks[0].id)
    answer = decode_answer(msgspec.json.encode(replies[-1]))
    assert answer.finish_reason == "cancelled"
    assert answer.usage.completion_tokens < 900
    eventually_sync(lambda: stack.kv_blocks_used() == 0, timeout=10, what="the cancelled question's KV blocks free")


def test_a_client_that_hangs_up_before_a_whole_answer_cancels_it(stack):
    """Not streamed: the gateway notices the closed connection while it waits for the answer."""
    def cancels() -> float:
        text = httpx.get(stack.url + "/metrics", timeout=10).text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("kev_gateway_cancels_total")))

    before = cancels()
    # The pattern allows no end before max_tokens (900 tokens of letters are far fewer than 20,000 letters):
    # a sampled end-of-text token from the random tiny model must not finish the answer inside the client's
    # 0.5 s (it did, now and then).
    body = {"model": MODEL, "messages": SEA, "max_tokens": 900,
            "response_format": {"type": "regex", "pattern": "[a-z]{20000}"}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5),
                   headers={"authorization": f"Bearer {API_KEY}"})
    eventually_sync(lambda: cancels() > before and stack.kv_blocks_used() == 0, timeout=10,
                    what="the abandoned question cancelled and its KV blocks free")


def test_200_concurrent_requests_half_streamed_each_get_their_own_answer(client, stack):
    prompts = [f"Question {i}: what comes after {i * 7}?" for i in range(20)]
    # Sampled with a per-question seed, so every prompt has its own text (a random tiny model's greedy
    # answers are too alike to show a mix-up); a seeded draw is the same alone or packed.
    params = [dict(max_tokens=8, temperature=1.0, seed=100 + i) for i in range(20)]
    solo = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], **k)
            .choices[0].message.content for p, k in zip(prompts, params)]
    assert len(set(solo)) > 15, solo

    async def ask_all() -> dict[int, str]:
        got: dict[int, str] = {}
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        headers = {"authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=stack.base_url, headers=headers, limits=limits, timeout=120) as http:
            async def one(i: int) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": prompts[i % 20]}], **params[i % 20]}
                if i % 2:
                    response = await http.post("/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    got[i] = response.json()["choices"][0]["message"]["content"]
                    return
                async with http.stream("POST", "/chat/completions", json={**body, "stream": True}) as response:
                    assert response.status_code == 200
                    got[i] = await _sse_text(response)

            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(one, i)
        return got

    started = time.monotonic()
    got = run(ask_all)
    assert sorted(got) == list(range(200))
    mixed = {i: (got[i], solo[i % 20]) for i in got if got[i] != solo[i % 20]}
    assert not mixed, f"{len(mixed)} answers differ from their solo answer, e.g. {list(mixed.items())[:3]}"
    assert time.monotonic() - started < 60


async def _sse_text(response: httpx.Response) -> str:
    text, done = [], False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[len("data: "):])
        assert "error" not in chunk, chunk
        text += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
    assert done
    return "".join(text)


def test_health_and_metrics(stack):
    assert httpx.get(stack.url + "/health").json()["status"] == "ok"
    # The answer routes' POSTs skip Starlette: their errors and metrics must look like every other route's.
    assert post(stack, "/v1/chat/completions", {"model": MODEL, "messages": SEA, "max_tokens": 2}).status_code == 200
    bad = httpx.post(stack.url + "/v1/completions", content=b"{not json",
                     headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    wrong_method = httpx.get(stack.url + "/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    metrics = httpx.get(stack.url + "/metrics").text
    assert 'kev_gateway_requests_total{route="/v1/chat/completions",status="200"}' in metrics
    assert 'kev_gateway_requests_total{route="/v1/completions",status="400"}' in metrics
    assert 'kev_gateway_requests_total{route="/v1/chat/completions",status="405"}' in metrics
    assert "kev_gateway_request_seconds_bucket" in metrics


# -- the broker gone ------------------------------------------------------------------------------------

def test_broker_down_is_a_quick_503():
    broker = EmbeddedBroker().start()
    try:
        cfg = stack_config(kafka_config(broker), publish_timeout_ms=1000)
        with live_stack(cfg, worker=False) as stack:
            broker.stop()
            started = time.monotonic()
            response = post(stack, "/v1/chat/completions", {"model": MODEL, "messages": SEA})
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "broker_unavailable"
            assert time.monotonic() - started < 5
            assert httpx.get(stack.url + "/health").status_code == 503
    finally:
        broker.stop()


# -- the Kafka pieces under the gateway ------------------------------------------------------------------

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_deltas_follow_the_questions_reply_topic(kafka_broker, anyio_backend):
    """A signed question's reply_topic (as the gateway sends it) gets its deltas and its answer."""
    kafka = stack_config(kafka_config(kafka_broker, partitions=1)).kafka  # with the trust key the gateway signs with
    question = {"question_id": "s1", "prompt": "hi", "stream": True,
                "reply_topic": f"kev.replies.{kafka.answers_topic}"}
    await create_topics(kafka, {question["reply_topic"]: 1})
    async with running_worker(kafka):
        await produce_signed(kafka.bootstrap_servers, kafka.questions_topic, [msgspec.json.encode(question)], QUESTION)
        records = await read_topic(kafka.bootstrap_servers, question["reply_topic"], 4)
    replies = [msgspec.json.decode(r.value) for r in records]
    # The stand-in's three deltas and the answer. With exactly_once (the default on Tansu) the answer comes
    # from its partition's transactional producer and the deltas from the worker's other one, so a delta may
    # land after the answer; the gateway's stream then sends the answer's tail (streaming.py).
    deltas = sorted((r for r in replies if "seq" in r), key=lambda r: r["seq"])
    assert [r["seq"] for r in deltas] == [0, 1, 2] and len(replies) == 4
    assert "".join(r["text"] for r in deltas) == "echo: done"
    assert await read_topic(kafka.bootstrap_servers, kafka.deltas_topic, 0, timeout=0.5, linger=0.2) == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_control_reader_skips_old_cancels_and_passes_new_ones(kafka_broker, anyio_backend):
    kafka = stack_config(kafka_config(kafka_broker)).kafka  # commands are signed, as the gateway signs its cancels
    old = [ControlEvent(action="cancel", question_id="old"),
           ControlEvent(action="update_defaults", defaults={"temperature": 0.5})]
    await produce_commands(kafka.bootstrap_servers, kafka.control_topic, old)
    send, receive = anyio.create_memory_object_stream[ControlEvent](16)
    async with anyio.create_task_group() as tg:
        replayed = await tg.start(run_control_reader, kafka, send)
        assert replayed == 1
        assert (await receive.receive()).action == "update_defaults"
        await produce_commands(kafka.bootstrap_servers, kafka.control_topic,
                               [ControlEvent(action="cancel", question_id="new")])
        with anyio.fail_after(10):
            assert (await receive.receive()) == ControlEvent(action="cancel", question_id="new")
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn and aiokafka run on asyncio only
async def test_gateway_connections_send_small_writes_at_once(anyio_backend):
    """TCP_NODELAY on every accepted connection: with Nagle on, a response written in two parts waited for
    the client's delayed ACK and each lone request took 40 ms longer."""
    import asyncio
    import socket

    from kev_async.gateway.server import listen

    sock = listen("127.0.0.1", 0)
    nodelay = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            nodelay.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
    try:
        client = await anyio.connect_tcp(*sock.getsockname()[:2])
        assert await nodelay == 1
        await client.aclose()
    finally:
        server.close()


def test_kev_gateway_help_and_a_clear_refusal_without_brokers(capsys):
    from kev_async.cli import main

    assert main(["gateway", "--help"]) == 0
    assert "OpenAI(base_url=" in capsys.readouterr().out
    assert main(["gateway"]) == 2  # "embedded" is no broker a worker shares
    assert "--bootstrap-servers" in capsys.readouterr().err


def test_kev_gateway_says_in_one_line_why_it_cannot_start(kafka_broker):
    """Brokers it cannot reach, or a port already taken: exit 1 with the reason, not a traceback."""
    import socket

    from serve_fixtures import KEV, ROOT, kev_env

    gateway_key = {"secret": TRUST_SECRET, "scopes": ["questions", "cancel"]}
    trust = {"KEV_KAFKA__TRUST__KEYS": json.dumps({TRUST_KEY_ID: gateway_key})}  # else it refuses before that

    def gateway(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(KEV), "gateway", *args], cwd=ROOT, env=kev_env(**SESSION_ENV, **trust),
                              capture_output=True, text=True, timeout=120)

    unreachable = gateway("--bootstrap-servers", "127.0.0.1:1", "--port", "0")
    assert unreachable.returncode == 1 and "kev gateway: cannot reach the brokers" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr and "Unclosed" not in unreachable.stderr, unreachable.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for processes in ("1", "2"):
            busy = gateway("--bootstrap-servers", kafka_broker.bootstrap_servers, "--port",
                           str(taken.getsockname()[1]), "--processes", processes)
            assert busy.returncode == 1 and "kev gateway: cannot listen" in busy.stderr, busy.stderr
            assert "Traceback" not in busy.stderr, busy.stderr


def test_kev_demo_http_prints_a_curl_line_that_works(tiny_model_dir, tmp_path):
    from serve_fixtures import KevProcess, kev_env, kev_processes, says

    args = ["demo", "--http", "--port", "0", "--questions", "2", "--max-new-tokens", "4", "--model", str(tiny_model_dir)]
    with kev_processes() as children:
        demo = KevProcess(args, kev_env(**SESSION_ENV), tmp_path / "demo.log")
        children.append(demo)
        eventually_sync(lambda: says(demo, "kev: serving until Ctrl-C"), timeout=120, every=0.2, what=demo.describe)
        curl = next(line for line in demo.log().splitlines() if line.startswith("curl "))
        argv = shlex.split(curl)
        if shutil.which("curl"):
            reply = json.loads(subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout)
        else:  # the same request, sent by httpx
            url, body = argv[2], argv[argv.index("-d") + 1]
            reply = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60).json()
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"], reply
        demo.signal(signal.SIGINT)
        assert demo.wait(60) == 0, demo.describe()



def _ready_processes(gateway, timeout: float = 60.0) -> dict:
    """The parent's `gateway.ready` log line (JSON logs) of `kev gateway --processes N`."""
    def ready_line() -> dict | None:
        for line in gateway.log().splitlines():
            if line.startswith("{") and '"gateway.ready"' in line and '"processes"' in line:
                return json.loads(line)
        assert gateway.running(), gateway.describe()
        return None

    return eventually_sync(ready_line, timeout=timeout, every=0.2, what=gateway.describe)


def test_kev_gateway_processes_share_a_port_answer_and_stop_together(stack, tmp_path):
    """`--processes 2`: two gateways behind one port answer the openai client; SIGTERM stops both (exit 0);
    a child that dies stops the other and the parent exits 1, naming it; a killed parent's children stop."""
    import os

    from gateway_fixtures import free_port
    from serve_fixtures import KevProcess, kev_env, kev_processes

    config = tmp_path / "kev.yaml"
    config.write_bytes(msgspec.json.encode(stack.cfg))  # JSON is YAML: the stack's topics, keys and model name
    port = free_port()
    args = ["gateway", "--config", str(config), "--port", str(port), "--processes", "2"]
    with kev_processes() as children:
        gateway = KevProcess(args, kev_env(**SESSION_ENV), tmp_path / "gateway.log")
        children.append(gateway)
        ready = _ready_processes(gateway)
        assert len(ready["pids"]) == 2 and len(set(ready["reply_topics"])) == 2, ready
        assert ready["url"] == f"http://127.0.0.1:{port}"

        def ask(i: int) -> str:  # a client of its own each: a fresh connection, accepted by either process
            with openai.OpenAI(base_url=f"{ready['url']}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
                reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                       max_tokens=3)
                return reply.choices[0].message.content

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        assert all(answers), answers
        gateway.signal(signal.SIGTERM)
        assert gateway.wait(60) == 0, gateway.describe()
        for pid in ready["pids"]:
            assert not _alive(pid), f"gateway process {pid} outlived its parent"

        gateway = KevProcess(args, kev_env(**SESSION_ENV), tmp_path / "gateway2.log")
        children.append(gateway)
        ready = _ready_processes(gateway)
        os.kill(ready["pids"][0], signal.SIGKILL)
        assert gateway.wait(60) == 1, gateway.describe()
        assert f"pid {ready['pids'][0]}) exited with -9" in gateway.log(), gateway.describe()
        assert not _alive(ready["pids"][1])

        gateway = KevProcess(args, kev_env(**SESSION_ENV), tmp_path / "gateway3.log")
        children.append(gateway)
        ready = _ready_processes(gateway)
        gateway.kill()  # SIGKILL: the parent cannot pass anything on; its children see their stdin close
        eventually_sync(lambda: not any(_alive(pid) for pid in ready["pids"]), timeout=30, every=0.2,
                        what=f"gateway processes {ready['pids']} gone after their parent was killed")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- a crash inside the gateway ---------------------------------------------------------------------------

class _PublisherWithABug:
    """Fault injection: publishing raises something that is not an ApiError, as a bug in the gateway would."""

    healthy = True

    async def publish(self, question) -> None:
        raise RuntimeError("a bug")

    async def cancel(self, question_id: str) -> bool:
        return True


def test_a_crash_before_the_response_is_openai_s_500_and_counted():
    from kev_async.gateway.app import create_app
    from kev_async.gateway.auth import Authenticator
    from kev_async.gateway.catalog import ModelCatalog
    from kev_async.gateway.metrics import GatewayMetrics
    from kev_async.gateway.replies import ReplyRouter
    from kev_async.gateway.state import Gateway
    from schemas import KevConfig

    cfg = KevConfig()
    gateway = Gateway(cfg, _PublisherWithABug(), ReplyRouter(cfg.kafka, "kev.replies.test"), ModelCatalog(MODEL),
                      Authenticator.from_config(cfg.gateway), GatewayMetrics())

    async def ask() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)),
                                     base_url="http://gateway") as client:
            body = {"model": MODEL, "messages": SEA, "max_tokens": 2}
            return [await client.post("/v1/chat/completions", json={**body, "stream": stream}) for stream in (False, True)]

    for response in anyio.run(ask):  # whole and streamed: the stream fails before its first byte
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "internal_error" and "bug" not in response.text
    assert 'kev_gateway_requests_total{route="/v1/chat/completions",status="500"} 2.0' in gateway.metrics.render().decode()
