"""The Batch API through the gateway with the official `openai` client (`client.files.*`,
`client.batches.*`), against a live stack: the embedded Tansu broker, an in-process worker on the tiny
random-weight Llama, the gateway. A batch's answers equal the same requests asked one by one; a cancel
and a gateway restart mid-batch leave exactly one line per custom_id; bad input is a 400 or 404 in
OpenAI's error shape."""

from __future__ import annotations

import datetime
import io
import json
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial

import anyio
import httpx
import openai
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from gateway_fixtures import API_KEY, LiveStack, live_stack, replace, stack_config  # noqa: E402
from kafka_fixtures import kafka_config  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

MODEL = "tiny"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def batch_stack(kafka_broker, tiny_model, tmp_path_factory) -> Iterator[LiveStack]:
    cfg = stack_config(kafka_config(kafka_broker, partitions=2), files_dir=str(tmp_path_factory.mktemp("files")),
                       batch_in_flight=4)
    with live_stack(cfg, tiny_model) as running:
        yield running


def openai_client(stack: LiveStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def client(batch_stack) -> Iterator[openai.OpenAI]:
    with openai_client(batch_stack) as c:
        yield c


def chat_line(i: int, max_tokens: int = 6) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
            "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": body}


def upload(client: openai.OpenAI, lines: list[dict] | bytes) -> str:
    content = lines if isinstance(lines, bytes) else "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)


def finished(batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_each_line_as_the_same_request_asked_alone(client):
    lines = [chat_line(i) for i in range(20)]
    file_id = upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                  metadata={"job": "rivers"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 20
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (20, 0)
    assert batch.error_file_id is None and batch.metadata == {"job": "rivers"}
    output = read_lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
    by_id = {line["custom_id"]: line for line in output}
    for line in lines:
        alone = client.chat.completions.create(**line["body"])
        response = by_id[line["custom_id"]]["response"]
        assert response["status_code"] == 200
        assert response["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert response["body"]["usage"]["completion_tokens"] == alone.usage.completion_tokens
    assert batch.id in [b.id for b in client.batches.list(limit=100)]


def test_a_cancel_mid_way_settles_every_line_once(client):
    lines = [chat_line(i, max_tokens=48) for i in range(24)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="1h")
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    output, errors = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    counts = batch.request_counts
    assert (len(output), len(errors)) == (counts.completed, counts.failed)
    assert counts.completed + counts.failed == counts.total == 24
    assert 2 <= counts.completed < 24, counts
    assert Counter(line["custom_id"] for line in output + errors) == Counter(line["custom_id"] for line in lines)
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_completion_window_expires_with_every_line_accounted_for(client):
    """completion_window is each question's deadline: once it passes nothing more is asked, and the lines never
    asked are batch_expired in the error file."""
    lines = [chat_line(i, max_tokens=96) for i in range(48)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="1s")
    assert batch.expires_at - batch.created_at == 1
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "expired" and batch.expired_at is not None
    output, errors = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert (len(output), len(errors)) == (batch.request_counts.completed, batch.request_counts.failed)
    assert len(output) + len(errors) == 48 and len(errors) > 0
    assert Counter(line["custom_id"] for line in output + errors) == Counter(line["custom_id"] for line in lines)
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}


def test_a_gateway_restart_mid_batch_loses_and_repeats_nothing(batch_stack, kafka_broker):
    """A second gateway on its own batch topic: stopped once some lines are settled, started again on the same
    topic and files, it finishes the batch; the topic holds one result per line, so none was asked twice."""
    topic = f"kev.batches.restart-{time.monotonic_ns()}"
    cfg = replace(batch_stack.cfg, kafka={"batches_topic": topic})
    lines = [chat_line(i, max_tokens=32) for i in range(20)]
    with live_stack(cfg, worker=False) as first, openai_client(first) as client:
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="1h")
        seen = wait_for(client, batch.id, lambda b: b.request_counts.completed >= 3)
    assert seen.request_counts.completed < 20, "the batch finished before the restart"
    with live_stack(cfg, worker=False) as second, openai_client(second) as client:
        batch = wait_for(client, batch.id, finished)
        output = read_lines(client, batch.output_file_id)
    assert batch.status == "completed" and batch.request_counts.completed == 20
    assert Counter(line["custom_id"] for line in output) == Counter(line["custom_id"] for line in lines)
    keys = anyio.run(partial(_keys, kafka_broker, topic), backend="asyncio")
    line_keys = [key for key in keys if key.startswith(f"{batch.id}/") and not key.endswith("/cancel")]
    assert sorted(Counter(line_keys).values()) == [1] * 20


async def _keys(broker, topic: str) -> list[str]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_config(broker).bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        await consumer.seek_to_beginning(partition)
        end, keys = (await consumer.end_offsets([partition]))[partition], []
        while await consumer.position(partition) < end:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                keys += [record.key.decode() for record in records]
        return keys
    finally:
        await consumer.stop()


@pytest.mark.parametrize(("content", "code"), [
    (b"this is not JSON\n", "invalid_jsonl"),
    (json.dumps({**chat_line(0), "url": "/v1/embeddings"}).encode(), "invalid_url"),
    ((json.dumps(chat_line(0)) + "\n" + json.dumps(chat_line(0))).encode(), "duplicate_custom_id"),
    (json.dumps({**chat_line(0), "method": "GET"}).encode(), "invalid_method"),
    (json.dumps({**chat_line(0), "body": {"messages": [], "n": "two"}}).encode(), "invalid_type"),
])
def test_a_bad_input_file_is_a_400_naming_the_problem(client, content, code):
    with pytest.raises(openai.BadRequestError) as refused:
        upload(client, content)
    error = refused.value.body
    assert error["code"] == code and error["message"], error
    assert refused.value.response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_ids_are_404s_and_a_bad_batch_a_400(client):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-" + "0" * 32, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nothing")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-../../etc/passwd")
    file_id = upload(client, [chat_line(0)])
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="48h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    other = openai.OpenAI(base_url=str(client.base_url), api_key="sk-unknown", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        other.files.retrieve(file_id)


def test_files_in_the_object_store_the_durable_broker_uses(batch_stack, tmp_path, monkeypatch):
    """gateway.files_url on the SeaweedFS store of consumers/broker/object_store.py, given the broker's environment:
    the batch's input and output are blobs there, and the batch runs as with a directory."""
    from consumers.broker.object_store import BUCKET, LocalObjectStore

    store = LocalObjectStore(tmp_path / "store").start()
    try:
        for name, value in store.broker_env().items():
            monkeypatch.setenv(name, value)
        cfg = replace(batch_stack.cfg, kafka={"batches_topic": f"kev.batches.s3-{time.monotonic_ns()}"},
                      gateway={"files_url": f"s3://{BUCKET}/batch-files", "files_dir": None})
        with live_stack(cfg, worker=False) as gateway, openai_client(gateway) as client:
            file_id = upload(client, [chat_line(i) for i in range(3)])
            batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="1h")
            batch = wait_for(client, batch.id, finished)
            assert batch.status == "completed" and len(read_lines(client, batch.output_file_id)) == 3
        for blob in (file_id, f"{file_id}.json", batch.output_file_id):
            assert httpx.get(f"{store.endpoint}/{BUCKET}/batch-files/{blob}", timeout=5).status_code == 200
    finally:
        store.stop()


def test_s3_requests_are_signed_as_aws_documents():
    """AWS's worked example of a Signature Version 4 GET (examplebucket, test.txt, bytes=0-9)."""
    from kev_async.gateway.s3_blobs import sign_v4

    headers = sign_v4("GET", "https://examplebucket.s3.amazonaws.com", "/test.txt", b"",
                      key_id="AKIAIOSFODNN7EXAMPLE", secret="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                      region="us-east-1", now=datetime.datetime(2013, 5, 24, tzinfo=datetime.timezone.utc),
                      extra={"Range": "bytes=0-9"})
    assert headers["authorization"].endswith(
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_a_gateway_with_run_batches_false_serves_what_another_runs(batch_stack):
    """Two gateways on one batch topic: the one with gateway.run_batches false leaves a batch made through it
    unstarted until the other starts, and then shows the other's progress, read back from the topic."""
    topic = f"kev.batches.fleet-{time.monotonic_ns()}"
    cfg = replace(batch_stack.cfg, kafka={"batches_topic": topic})
    lines = [chat_line(i) for i in range(4)]
    with live_stack(replace(cfg, gateway={"run_batches": False}), worker=False) as front, \
            openai_client(front) as client:
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="1h")
        time.sleep(1.0)
        assert client.batches.retrieve(batch.id).status == "validating"
        with live_stack(cfg, worker=False):
            batch = wait_for(client, batch.id, finished)
        assert batch.status == "completed" and batch.request_counts.completed == 4
        assert len(read_lines(client, batch.output_file_id)) == 4
