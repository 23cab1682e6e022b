"""Metrics, the canonical answer log line, `kev top` and the Grafana dashboard, on real workloads.

- the engine actor on a tiny random-weight Llama: after a known workload the counters and histograms
  match the answers, the KV pool is back to empty, GET /metrics answers 200, `kev top --once` renders;
- the "answer" log line: never the prompt or the answer text, unless logging.log_prompts;
- `serve` on the embedded broker: engine errors by code, Kafka counters, consumer lag per partition;
- the dashboard only queries metrics Kev exports.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from consumers import Inbound, Outbound
from engine import Engine, EngineOptions
from kev_async.cli import main as kev
from kev_async.engine_actor import engine_actor
from kev_async.observe.metrics import Metrics
from kev_async.runtime.actors import Mailbox
from schemas import AnswerEvent, ErrorInfo, KevConfig, Params, QuestionEvent, Timings, Usage

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import kafka_config, produce, read_topic  # noqa: E402
from serve_fixtures import free_port, http_get  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = EngineOptions(max_parallel_queries=8, batch_window_ms=1, num_blocks=128, block_size=16, max_context=256)
SECRET = "Zanzibar-7731"  # in every prompt: it must never reach a log line unless log_prompts


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def model(harness, smollm2_tokenizer):
    """A random-weight Llama with SmolLM2's vocabulary and tokenizer (2 layers of width 64)."""
    import torch

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                      max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    return harness.kev_model_from_hf(transformers.LlamaForCausalLM(config).eval(), smollm2_tokenizer)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    found = [v for (n, ls), v in scraped.items() if n == name and want <= ls]
    assert found, f"no sample {name}{labels or ''}"
    return sum(found)


def inbound(i: int, prompt: str | None = None, max_new_tokens: int | None = None) -> Inbound:
    question = QuestionEvent(question_id=f"q{i}", request_id=f"r{i}", tenant="acme",
                             prompt=prompt or f"{SECRET}: tell me about otters, part {i}.",
                             params=Params(max_new_tokens=max_new_tokens or 3 + i, temperature=0))
    return Inbound(question, "kev.questions", i % 2, 100 + i, time.monotonic())


async def run_workload(model, metrics: Metrics, count: int, port: int, on_idle=None, options=OPTIONS,
                       prompt: str | None = None, max_new_tokens: int | None = None) -> list[AnswerEvent]:
    """`count` questions through the engine actor (wired as `serve` wires it); `on_idle()` runs once every
    answer is out and the engine is still up."""
    questions, answers = Mailbox("engine.questions", 16), Mailbox("engine.answers", 16)
    metrics.watch_mailboxes(questions, answers)
    got: list[AnswerEvent] = []
    with anyio.fail_after(60):
        async with metrics.endpoint(port), anyio.create_task_group() as tg:
            await tg.start(partial(engine_actor, questions.receive, answers.send, wrap=metrics.wrap(Outbound),
                                   engine_factory=lambda: metrics.watch_engine(Engine(model, options))))
            for i in range(count):
                await questions.send.send(inbound(i, prompt, max_new_tokens))
            async for outbound in answers.receive:
                assert isinstance(outbound, Outbound) and outbound.source.offset >= 100
                got.append(outbound.event)
                if len(got) == count:
                    if on_idle:
                        await on_idle()
                    await questions.send.aclose()
    return got


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the endpoint is uvicorn, on asyncio as `kev serve`
async def test_a_workload_moves_the_metrics_and_top_shows_them(model, capsys):
    metrics, port, count = Metrics(), free_port(), 6
    seen = {}

    async def on_idle():
        status, headers, body = await http_get(port)
        seen.update(status=status, content_type=headers.get("content-type", ""), scraped=samples(body))
        url = f"http://127.0.0.1:{port}/metrics"
        seen["top_rc"] = await anyio.to_thread.run_sync(kev, ["top", "--once", "--url", url, "--interval", "0.1"])
        seen["frame"] = capsys.readouterr().out

    answers = await run_workload(model, metrics, count, port, on_idle)
    assert seen["status"] == 200 and seen["content_type"].startswith("text/plain")
    scraped = seen["scraped"]
    assert [a.error for a in answers] == [None] * count
    assert value(scraped, "kev_answers_total") == count
    assert value(scraped, "kev_answers_total", finish_reason="length") == count  # greedy, max_new_tokens
    completion = sum(a.usage.completion_tokens for a in answers)
    assert completion == sum(3 + i for i in range(count))
    assert value(scraped, "kev_generated_tokens_total") == completion
    assert value(scraped, "kev_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    for histogram in ("kev_time_to_first_token_seconds", "kev_end_to_end_latency_seconds", "kev_queue_time_seconds",
                      "kev_inter_token_latency_seconds"):  # every answer has > 1 token
        assert value(scraped, f"{histogram}_count") == count, histogram
    forwards = value(scraped, "kev_forwards_total")
    assert forwards > 0
    assert value(scraped, "kev_step_batch_size_count") == forwards  # one observation per forward
    assert value(scraped, "kev_step_batch_size_sum") >= completion  # each token came from some question's pass
    assert value(scraped, "kev_kv_blocks_used") == 0
    assert value(scraped, "kev_kv_blocks_free") == OPTIONS.num_blocks
    assert value(scraped, "kev_kv_blocks_cached") == value(scraped, "kev_prefix_cache_hit_rate") == 0  # strict
    assert value(scraped, "kev_cached_prompt_tokens_total") == 0
    assert value(scraped, "kev_running_questions") == value(scraped, "kev_waiting_questions") == 0
    assert value(scraped, "kev_preemptions_total") == 0
    assert value(scraped, "kev_draft_tokens_total") == value(scraped, "kev_accepted_draft_tokens_total") == 0  # off
    for method in ("ngram", "draft_model"):  # every drafter's series, at 0, and no acceptance rate without drafts
        assert value(scraped, "kev_speculative_draft_tokens_total", method=method) == 0
    assert not [n for n, _ in scraped if n == "kev_speculative_acceptance_rate"]
    assert value(scraped, "kev_question_steps_total") == completion  # one token per question per forward
    assert value(scraped, "kev_tokens_per_question_step") == 1.0
    assert value(scraped, "kev_tokens_per_step") == pytest.approx(completion / forwards)
    assert {dict(ls)["mailbox"] for n, ls in scraped if n == "kev_mailbox_depth"} == {"engine.questions",
                                                                                       "engine.answers"}
    assert not [n for n, _ in scraped if n == "kev_errors_total"]  # no error code seen, so no series
    # Unsigned questions are one anonymous principal; each computed its prompt and every token but its last.
    computed = sum(a.usage.prompt_tokens + a.usage.completion_tokens - 1 for a in answers)
    assert value(scraped, "kev_tenant_service_tokens_total", tenant="anonymous") == computed
    assert value(scraped, "kev_tenant_service_share", tenant="anonymous") == 1.0
    assert value(scraped, "kev_tenant_queue_seconds_count", tenant="anonymous") == count
    assert value(scraped, "kev_tenant_throttled_total", tenant="anonymous") == 0
    assert value(scraped, "kev_tenant_questions", tenant="anonymous", state="waiting") == 0

    assert seen["top_rc"] == 0, seen["frame"]
    frame = seen["frame"]
    assert f"127.0.0.1:{port}" in frame
    assert re.search(r"running 0\s+waiting 0", frame), frame
    assert f"used 0   free {OPTIONS.num_blocks}" in frame, frame
    assert f"generated {completion} " in frame, frame
    assert f"length {count}" in frame, frame
    assert "engine.questions 0/16" in frame, frame


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_speculative_metrics_per_drafter_on_the_endpoint(model):
    """Prompt lookup on long answers: drafted and accepted tokens under method="ngram"
    equal the unlabelled totals and the answers' own counts; tokens per question-forward exceed 1 as
    drafts are kept."""
    options = dataclasses.replace(OPTIONS, speculative="ngram", speculative_policy="always")
    metrics, port, count = Metrics(), free_port(), 4
    seen = {}

    async def on_idle():
        seen["body"] = (await http_get(port))[2]

    prompt = "red green blue yellow " * 6
    # Long answers: this random-weight model falls into loops that prompt lookup then drafts from.
    answers = await run_workload(model, metrics, count, port, on_idle, options=options, prompt=prompt,
                                 max_new_tokens=OPTIONS.max_context - 64)
    scraped = samples(seen["body"])
    drafted = sum(a.audit.drafted_tokens for a in answers)
    kept = sum(a.usage.accepted_draft_tokens for a in answers)
    completion = sum(a.usage.completion_tokens for a in answers)
    assert drafted > 0 and kept > 0
    assert value(scraped, "kev_speculative_draft_tokens_total", method="ngram") == drafted
    assert value(scraped, "kev_draft_tokens_total") == drafted  # the unlabelled total, as before
    assert value(scraped, "kev_speculative_accepted_tokens_total", method="ngram") == kept
    assert value(scraped, "kev_accepted_draft_tokens_total") == kept
    assert value(scraped, "kev_speculative_draft_tokens_total", method="draft_model") == 0
    assert value(scraped, "kev_speculative_acceptance_rate", method="ngram") == pytest.approx(kept / drafted)
    assert not [ls for n, ls in scraped if n == "kev_speculative_acceptance_rate" and dict(ls)["method"] == "draft_model"]
    verifications = value(scraped, "kev_speculative_verifications_total", method="ngram")
    steps = value(scraped, "kev_question_steps_total")
    assert 0 < verifications <= steps
    assert steps == completion - kept  # each question-forward emits 1 token plus the drafts it kept
    assert value(scraped, "kev_tokens_per_question_step") == pytest.approx(completion / steps)
    assert completion / steps > 1
    assert value(scraped, "kev_tokens_per_step") == pytest.approx(completion / value(scraped, "kev_forwards_total"))


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_one_answer_line_per_answer_with_prompts_only_when_asked(model, log_prompts):
    with capture_logs() as logs:
        answers = await run_workload(model, Metrics(log_prompts=log_prompts), 3, 0)
    lines = {line["question_id"]: line for line in logs if line["event"] == "answer"}
    assert len(lines) == len([line for line in logs if line["event"] == "answer"]) == 3
    for answer in answers:
        line = lines[answer.question_id]
        i = int(answer.question_id[1:])
        assert line["request_id"] == f"r{i}" and line["tenant"] == "acme"
        assert (line["partition"], line["offset"]) == (i % 2, 100 + i)
        assert line["finish_reason"] == "length" and line["error"] is None
        assert line["prompt_tokens"] == answer.usage.prompt_tokens > 0
        assert line["completion_tokens"] == 3 + i
        assert line["e2e_ms"] == answer.timings.e2e_ms and line["ttft_ms"] == answer.timings.ttft_ms
        assert line["worker"] == answer.audit.worker and line["blocks"] == list(answer.audit.blocks)
        assert line["channel"] == answer.audit.channel and "routing_bucket" in line
        if log_prompts:
            assert line["prompt"] == f"{SECRET}: tell me about otters, part {i}."
            assert line["text"] == answer.text
    if not log_prompts:
        assert all("prompt" not in line and "text" not in line for line in lines.values())
        leaked = [line for line in logs if SECRET in repr(line)]
        assert not leaked, leaked[:1]


def test_answer_timings_become_latencies_and_error_answers_count_by_code():
    metrics = Metrics()
    metrics.observe_answer(AnswerEvent("a", finish_reason="length", usage=Usage(7, 5),
                                       timings=Timings(queued_ms=2.0, ttft_ms=20.0, e2e_ms=100.0)))
    metrics.observe_answer(AnswerEvent("b", finish_reason="length", usage=Usage(7, 1),
                                       timings=Timings(queued_ms=1.0, ttft_ms=30.0, e2e_ms=30.0)))
    metrics.observe_answer(AnswerEvent("c", finish_reason="error", error=ErrorInfo("prompt_too_long", "x")))
    scraped = samples(metrics.render().decode())
    assert value(scraped, "kev_inter_token_latency_seconds_count") == 1  # "b" has one token: no gaps
    assert value(scraped, "kev_inter_token_latency_seconds_sum") == pytest.approx((100 - 20) / 4 / 1000)
    assert value(scraped, "kev_time_to_first_token_seconds_sum") == pytest.approx(0.050)
    assert value(scraped, "kev_end_to_end_latency_seconds_count") == 2  # an error answer never ran
    assert value(scraped, "kev_errors_total", code="prompt_too_long") == 1
    assert value(scraped, "kev_answers_total", finish_reason="error") == 1
    assert value(scraped, "kev_answers_total", finish_reason="stop") == 0  # exists before the first


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the endpoint is uvicorn, on asyncio as `kev serve`
async def test_endpoint_answers_only_get_metrics_and_a_taken_port_is_a_clear_error():
    metrics = Metrics()
    async with metrics.endpoint(free_port()) as port:
        assert (await http_get(port, "/"))[0] == 404
        assert (await http_get(port, "/metrics", "POST"))[0] == 405
        # A liveness probe: healthy or not, nothing more (no Kafka loop watched: nothing to be unhealthy about).
        assert (await http_get(port, "/health"))[::2] == (200, '{"status":"ok"}')
        status, headers, body = await http_get(port, "/metrics", "HEAD")
        assert status == 200 and body == "" and int(headers["content-length"]) > 0
        async with await anyio.connect_tcp("127.0.0.1", port) as rude:  # garbage, then hang up
            await rude.send(b"\x00\x01 nonsense")
        assert (await http_get(port))[0] == 200  # still serving
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127.0.0.1:{port}.*metrics.port"):
            async with metrics.endpoint(port):
                pass
    async with metrics.endpoint(0) as off:
        assert off is None


def test_top_says_clearly_when_the_endpoint_is_unreachable(capsys):
    port = free_port()  # nothing listens there now
    assert kev(["top", "--once", "--url", f"http://127.0.0.1:{port}/metrics"]) == 1
    err = capsys.readouterr().err
    assert f"kev top: cannot reach http://127.0.0.1:{port}/metrics" in err and "metrics.port" in err


def test_the_dashboard_queries_only_metrics_kev_exports():
    dashboard = json.loads((ROOT / "ops" / "grafana-dashboard.json").read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    exported = set()
    for family in Metrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        exported |= {family.name + suffix for suffix in suffixes}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    queried = set()
    for panel in panels:
        assert panel["targets"] and {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bkev_[a-z_]+", target["expr"]))
    assert queried <= exported, queried - exported
    for needed in ("kev_time_to_first_token_seconds_bucket", "kev_inter_token_latency_seconds_bucket",
                   "kev_end_to_end_latency_seconds_bucket", "kev_generated_tokens_total", "kev_step_batch_size_bucket",
                   "kev_kv_blocks_used", "kev_running_questions", "kev_waiting_questions", "kev_answers_total",
                   "kev_errors_total", "kev_mailbox_depth", "kev_consumer_lag"):
        assert needed in queried, needed


# -- the service on the embedded broker ----------------------------------------------------------------

@pytest.mark.kafka
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # aiokafka is asyncio-only
async def test_serve_exports_engine_and_kafka_metrics(kafka_broker, model, monkeypatch, capsys):
    from kev_async.app import serve
    from kev_async.runtime.lifecycle import Shutdown

    monkeypatch.setenv("KEV_KAFKA_SESSION_TIMEOUT_MS", "3000")  # Tansu's first assignment: ~1.5 s
    kafka, port = kafka_config(kafka_broker, partitions=2), free_port()
    cfg = KevConfig(kafka=kafka)
    cfg = msgspec.structs.replace(
        cfg, core=msgspec.structs.replace(cfg.core, max_context=128, device="cpu"),
        router=msgspec.structs.replace(cfg.router, max_parallel_queries=8),
        kv_cache=msgspec.structs.replace(cfg.kv_cache, num_blocks=64),
        metrics=msgspec.structs.replace(cfg.metrics, port=port))

    def question(qid: str, **fields) -> bytes:
        return msgspec.json.encode({"question_id": qid, "prompt": f"{SECRET} {qid}",
                                    "params": {"max_new_tokens": 4}, **fields})

    events = [question(f"q{i}") for i in range(5)]
    events.append(question("no-adapter", adapter="nope"))  # the engine refuses it: an error answer
    events.append(question("too-hot", params={"temperature": 99}))  # invalid: answered by the intake
    shutdown = Shutdown(drain_deadline=20.0)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(serve, cfg, shutdown, model=model))
            await produce(kafka.bootstrap_servers, kafka.questions_topic, events)
            assert len(await read_topic(kafka.bootstrap_servers, kafka.answers_topic, 7, linger=0)) == 7
            while True:  # the last acks and the lag settle a moment after the answers are readable
                status, _, body = await http_get(port)
                scraped = samples(body)
                if (value(scraped, "kev_kafka_published_total") == 7 and value(scraped, "kev_kafka_in_flight") == 0
                        and len([n for n, _ in scraped if n == "kev_consumer_lag"]) == 2):
                    break
                await anyio.sleep(0.1)
            status, headers, body = await http_get(port, "/health")  # the Kafka loop is consuming
            assert (status, body, headers["content-type"]) == (200, '{"status":"ok"}', "application/json")
            url = f"http://127.0.0.1:{port}/metrics"
            top_rc = await anyio.to_thread.run_sync(kev, ["top", "--once", "--url", url, "--interval", "0.1"])
            shutdown.request("test over")

    assert status == 200
    assert value(scraped, "kev_answers_total") == 6  # what the engine answered
    assert value(scraped, "kev_errors_total", code="unknown_adapter") == 1
    assert value(scraped, "kev_generated_tokens_total") == 5 * 4
    assert value(scraped, "kev_kafka_published_total", kind="answers") == 5
    assert value(scraped, "kev_kafka_published_total", kind="error_answers") == 2
    assert value(scraped, "kev_kafka_records_total") == 7
    assert value(scraped, "kev_kafka_assigned_partitions") == 2
    assert value(scraped, "kev_kafka_paused_partitions") == 0
    lag = {dict(ls)["partition"]: v for (n, ls), v in scraped.items() if n == "kev_consumer_lag"}
    assert lag == {"0": 0, "1": 0}, lag
    assert all(dict(ls)["topic"] == kafka.questions_topic for n, ls in scraped if n == "kev_consumer_lag")
    assert value(scraped, "kev_kv_blocks_used") == 0
    frame = capsys.readouterr().out
    assert top_rc == 0 and "assigned 2   paused 0   lag 0" in frame, frame
    assert "unknown_adapter 1" in frame, frame


def test_kev_top_on_an_endpoint_without_worker_metrics_says_so_and_fails(capsys):
    """A gateway's /metrics has Kev metrics but no worker's: `kev top` names the mistake, exit 1."""
    import http.server
    import threading

    from kev_async.cli import main as kev_main

    class GatewayLike(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b"# TYPE kev_gateway_requests_total counter\nkev_gateway_requests_total 3.0\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), GatewayLike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert kev_main(["top", "--once", "--url", url, "--interval", "0.05"]) == 1
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert "serves Kev metrics, but not a worker's" in err and "kev demo" in err
