"""Seed 002's service: `kev serve --config kev.yaml --port 8765` and its check,
`curl -X POST http://localhost:8765/v1/query -d '{"queries": ["问题A", "问题B"], "isolation": "strict"}'`.

- `kev serve --port` (a subprocess on the embedded broker and the tiny random model) answers the seed's curl
  body as printed with one result per query, each the answer the same question gets alone through the API;
- POST /v1/query on a live worker and gateway: an audit tenant's results carry channel and routing bucket,
  and seeded queries of different lengths each get the text they get alone (a swap would show);
- its limits on a gateway no worker reads: too many queries is a 400 before anything is published, a
  request short of its tenant's slots is a 429 as a whole with nothing published, a query left unanswered
  gets its own timeout error, and a client that hangs up has its questions cancelled.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator

import anyio
import httpx
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from gateway_fixtures import API_KEY, SESSION_ENV, LiveStack, free_port, live_stack, stack_config  # noqa: E402
from kafka_fixtures import kafka_config, read_topic  # noqa: E402
from polling import eventually_sync  # noqa: E402

from consumers import create_topics  # noqa: E402
from schemas import decode_question  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

SEED_BODY = '{"queries": ["问题A", "问题B"], "isolation": "strict"}'  # seed 002's curl -d, byte for byte
RESULT_KEYS = {"index", "question_id", "text", "finish_reason", "tokens", "usage", "elapsed_ms", "channel_id",
               "hash_bucket", "error"}


def post(url: str, body, *, key: str | None = API_KEY, timeout: float = 60) -> httpx.Response:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url, content=content, headers=headers, timeout=timeout)


def asked_alone(base: str, text: str, params: dict, *, key: str | None = API_KEY) -> tuple[str, str, int]:
    """The text of `text` asked alone through /v1/query, the same through /v1/chat/completions, and its tokens."""
    alone = post(f"{base}/v1/query", {"queries": [text], **params}, key=key).json()["results"][0]
    chat_params = {"max_tokens": params["max_new_tokens"]} if "max_new_tokens" in params else {}
    chat_params.update({k: v for k, v in params.items() if k in ("temperature", "seed")})
    headers = {"authorization": f"Bearer {key}"} if key else {}
    model = httpx.get(f"{base}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]  # the served one
    chat = post(f"{base}/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                                 **chat_params}, key=key).json()
    return alone["text"], chat["choices"][0]["message"]["content"], alone["tokens"]


# -- seed 002, as its reader runs it ---------------------------------------------------------------------------

def test_kev_serve_port_answers_the_seeds_curl_line(tiny_model_dir, tmp_path):
    from serve_fixtures import KevProcess, kev_env, kev_processes, log_events

    config = tmp_path / "kev.yaml"  # greedy, so each answer is the one its question gets alone
    config.write_text("sampling:\n  temperature: 0\n  max_new_tokens: 8\nkv_cache:\n  num_blocks: 512\n")
    port = free_port()
    args = ["serve", "--config", str(config), "--port", str(port), "--model", str(tiny_model_dir)]
    with kev_processes() as children:
        serve = KevProcess(args, kev_env(**SESSION_ENV), tmp_path / "serve.log")
        children.append(serve)
        def ready() -> bool:
            assert serve.running(), serve.describe()
            return bool(log_events(serve, "gateway.ready") and log_events(serve, "partitions_assigned"))

        eventually_sync(ready, timeout=120, every=0.2, what=serve.describe)
        assert log_events(serve, "gateway.ready")[0]["url"] == f"http://127.0.0.1:{port}"
        url = f"http://localhost:{port}/v1/query"
        if shutil.which("curl"):
            argv = ["curl", "-s", "-X", "POST", url, "-H", "Content-Type: application/json", "-d", SEED_BODY]
            reply = json.loads(subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout)
        else:  # the same request, sent by httpx
            reply = post(url.replace("localhost", "127.0.0.1"), SEED_BODY, key=None).json()
        results = reply["results"]
        assert [r["index"] for r in results] == [0, 1], reply
        assert all(RESULT_KEYS <= set(r) and r["error"] is None and r["tokens"] > 0 for r in results), reply
        assert results[0]["question_id"] != results[1]["question_id"]
        assert all(r["question_id"].startswith(reply["request_id"]) for r in results)
        for question, result in zip(["问题A", "问题B"], results):
            alone, chat, tokens = asked_alone(f"http://127.0.0.1:{port}", question, {}, key=None)
            assert result["text"] == alone == chat and result["tokens"] == tokens, (question, result)
            assert result["channel_id"] is None  # Kev's audit is for gateway.audit_tenants, never anonymous
        serve.signal(signal.SIGINT)
        assert serve.wait(60) == 0, serve.describe()


# -- POST /v1/query on a live worker ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(kafka_broker, tiny_model) -> Iterator[LiveStack]:
    cfg = stack_config(kafka_config(kafka_broker, partitions=2))
    with live_stack(cfg, tiny_model) as running:
        yield running


def test_each_query_gets_the_answer_it_gets_alone_and_an_audit_tenant_sees_its_channel(stack):
    queries = ["Hi", "Why is the sky blue? Answer in one sentence.", "Name three primes, then stop."]
    params = {"temperature": 1.0, "seed": 7, "max_new_tokens": 6}  # seeded: texts that tell the queries apart
    reply = post(f"{stack.url}/v1/query", {"queries": queries, "isolation": "strict", **params})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == reply.json()["request_id"], reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert len({r["text"] for r in results}) == 3, results  # a result in the wrong place would show
    for text, result in zip(queries, results):
        alone, chat, tokens = asked_alone(stack.url, text, params)
        assert result["text"] == alone == chat and result["tokens"] == tokens == 6, (text, result, alone, chat)
        assert result["finish_reason"] == "length" and result["error"] is None
        assert isinstance(result["channel_id"], int) and isinstance(result["hash_bucket"], int), result
        assert result["usage"]["completion_tokens"] == 6 and result["elapsed_ms"] > 0
        if "started_ms" in result:  # workers that stamp when they took and ended the question
            assert result["started_ms"] <= result["finished_ms"]


def test_bad_queries_are_400s_naming_the_field(stack):
    def error(body) -> dict:
        reply = post(f"{stack.url}/v1/query", body)
        assert reply.status_code == 400, reply.text
        return reply.json()["error"]

    assert error({"queries": ["a"], "isolation": "shared"})["param"] == "isolation"
    assert "isolation.level" in error({"queries": ["a"], "isolation": "shared"})["message"]
    assert error({"queries": ["a"], "isolation": "loose"})["param"] == "isolation"
    assert error({"queries": ["a"], "stream": True}) == {
        "message": "Unrecognized request argument supplied: stream", "type": "invalid_request_error",
        "param": "stream", "code": "unrecognized_argument"}
    assert error({"queries": ["a", "  "]})["param"] == "queries[1]"
    assert error({"queries": ["a", "x" * 2001]})["code"] == "context_length_exceeded"  # gateway.max_prompt_chars
    assert error({"queries": ["a"], "temperature": -1})["param"] == "temperature"
    assert error({"queries": []})["param"] == "queries"
    assert error({"queries": "a"})["param"] == "queries"


# -- limits, on a gateway no worker reads ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gated(kafka_broker) -> Iterator[LiveStack]:
    """Up to 3 queries in flight for the tenant, 4 per request; questions wait (no worker), 1.5 s deadlines."""
    cfg = stack_config(kafka_config(kafka_broker), max_concurrent_per_tenant=3, max_queries_per_request=4,
                       request_timeout_ms=1500)
    anyio.run(create_topics, cfg.kafka, {cfg.kafka.questions_topic: 1, cfg.kafka.control_topic: 1},
              backend="asyncio")
    with live_stack(cfg, worker=False) as running:
        yield running


def published(stack: LiveStack, topic: str, at_least: int = 0) -> list:
    return anyio.run(lambda: read_topic(stack.cfg.kafka.bootstrap_servers, topic, at_least, linger=1.0),
                     backend="asyncio")


def test_limits_too_many_queries_400_short_of_slots_429_and_unanswered_ones_time_out(gated):
    url, questions_topic = f"{gated.url}/v1/query", gated.cfg.kafka.questions_topic
    too_many = post(url, {"queries": ["q"] * 5})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "queries", too_many.text
    assert "gateway.max_queries_per_request" in too_many.json()["error"]["message"]
    never = post(url, {"queries": ["q"] * 4})  # within the request limit, beyond what the tenant may ever hold
    assert never.status_code == 400 and "gateway.max_concurrent_per_tenant" in never.json()["error"]["message"]
    assert published(gated, questions_topic) == []

    held: dict = {}
    holder = threading.Thread(target=lambda: held.setdefault("reply", post(url, {"queries": ["one", "two"]})))
    holder.start()  # two of the tenant's three slots, until its questions' deadline
    waiting = published(gated, questions_topic, at_least=2)
    refused = post(url, {"queries": ["three", "four"]})  # one slot left: not enough for both
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "none of them was asked" in refused.json()["error"]["message"]
    assert sorted(decode_question(r.value).prompt for r in published(gated, questions_topic)) == \
        sorted(decode_question(r.value).prompt for r in waiting) == ["one", "two"]  # nothing of the refused one

    holder.join(30)
    reply = held["reply"]
    assert reply.status_code == 200, reply.text
    assert [(r["finish_reason"], r["error"]["code"]) for r in reply.json()["results"]] == [("timeout", "timeout")] * 2
    with pytest.raises(httpx.ReadTimeout):  # the slots are back: admitted, then the client hangs up
        post(url, {"queries": ["five", "six", "seven"]}, timeout=1.0)
    asked = {decode_question(r.value).prompt: decode_question(r.value).question_id
             for r in published(gated, questions_topic, 5)}
    gone = [asked[prompt] for prompt in ("five", "six", "seven")]
    cancelled: set[str] = set()

    def all_cancelled() -> bool:
        cancelled.update(json.loads(r.value)["question_id"] for r in published(gated, gated.cfg.kafka.control_topic))
        return set(gone) <= cancelled

    eventually_sync(all_cancelled, timeout=15, every=0,
                    what=lambda: f"every question of the client that left cancelled: {gone}, cancelled: {cancelled}")
