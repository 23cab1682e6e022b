"""deploy.mode multi: `kev serve` keeps deploy.workers worker processes up on one host (real processes,
the embedded broker, a tiny model): each gets its own cores, a killed one is restarted, SIGTERM drains
them all, and a worker that cannot start makes the parent give up with a clear error."""

from __future__ import annotations

import os
import signal
from collections import Counter

import anyio
import msgspec
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import kafka_config  # noqa: E402
from polling import eventually  # noqa: E402
from serve_fixtures import AnswerReader, KevProcess, kev_env, kev_processes  # noqa: E402

from consumers import create_topics, topic_plan  # noqa: E402
from kev_async.deploy import cpu_share, plan_workers  # noqa: E402
from schemas import config_from_dict  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = pytest.mark.anyio
STARTUP_TIMEOUT = 120.0


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_plan_splits_cores_or_gpus_between_workers():
    cfg = config_from_dict({"deploy": {"mode": "multi", "workers": 2}, "metrics": {"port": 9464}})
    plans = plan_workers(cfg, [], [0, 1, 2, 3])
    assert [sorted(p.cpus) for p in plans] == [[0, 1], [2, 3]]
    assert [p.env["KEV_CORE__THREADS"] for p in plans] == ["2", "2"]
    assert [p.env["KEV_METRICS__PORT"] for p in plans] == ["9464", "9465"]
    assert all(p.env["KEV_DEPLOY__MODE"] == "single" for p in plans)  # a worker never starts workers
    assert [cpu_share([0, 1], i, 3) for i in range(3)] == [[0], [1], [0]]  # more workers than cores
    gpu = plan_workers(config_from_dict({"deploy": {"mode": "multi", "workers": 3}}), ["0", "1"], [0, 1])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in gpu] == ["0", "1", "0"]
    assert all(p.cpus is None and "KEV_CORE__THREADS" not in p.env for p in gpu)
    unpinned = plan_workers(config_from_dict({"deploy": {"workers": 2, "pin_cpus": False}}), [], [0, 1])
    assert all(p.cpus is None for p in unpinned)


def events(process: KevProcess, event: str) -> list[dict]:
    """The child's JSON log lines whose event is `event`."""
    from kev_async.drill.checks import log_events as parse

    return parse(process.log(), event)


async def wait_events(process: KevProcess, event: str, count: int, timeout: float) -> list[dict]:
    """The child's `event` lines once there are `count`; fails at once if the child exits first."""
    def enough() -> list[dict]:
        assert process.running(), process.describe()
        found = events(process, event)
        return found if len(found) >= count else []

    return await eventually(enough, timeout=timeout, every=0.2,
                            what=lambda: f"{count} {event!r} in {process.describe()}")


def question(qid: str) -> bytes:
    return msgspec.json.encode({"question_id": qid, "prompt": f"Say {qid}.", "params": {"max_new_tokens": 6}})


async def publish(bootstrap: str, topic: str, ids: list[str]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for qid in ids:
            await producer.send(topic, question(qid), key=qid.encode())
        await producer.flush()
    finally:
        await producer.stop()


@pytest.mark.kafka
async def test_multi_runs_two_pinned_workers_restarts_a_killed_one_and_drains_on_sigterm(
        kafka_broker, tiny_model_dir, tmp_path):
    kafka = kafka_config(kafka_broker, partitions=4)
    await create_topics(kafka, topic_plan(kafka))
    env = kev_env(KEV_DEPLOY__MODE="multi", KEV_DEPLOY__WORKERS="2", KEV_DEPLOY__RESTART_BACKOFF_S="0.2",
                  KEV_KAFKA__GROUP_ID=kafka.group_id, KEV_KAFKA__QUESTIONS_TOPIC=kafka.questions_topic,
                  KEV_KAFKA__ANSWERS_TOPIC=kafka.answers_topic, KEV_KAFKA__DELTAS_TOPIC=kafka.deltas_topic,
                  KEV_KAFKA__DLQ_TOPIC=kafka.dlq_topic, KEV_KAFKA__CONTROL_TOPIC=kafka.control_topic,
                  KEV_KAFKA__PARTITIONS="4", KEV_KV_CACHE__NUM_BLOCKS="256", KEV_KAFKA_SESSION_TIMEOUT_MS="2000")
    del env["KEV_CORE__THREADS"]  # the parent sets each worker's threads from its share of the cores
    reader = AnswerReader(kafka.bootstrap_servers, kafka.answers_topic)
    with kev_processes() as children:
        parent = KevProcess(["serve", "--model", str(tiny_model_dir), "--bootstrap-servers", kafka.bootstrap_servers],
                            env, tmp_path / "multi.log")
        children.append(parent)
        async with anyio.create_task_group() as tg:
            await tg.start(reader.run)
            started = await wait_events(parent, "deploy.worker_started", 2, 30)
            await wait_events(parent, "kev.ready", 2, STARTUP_TIMEOUT)
            multi = events(parent, "deploy.multi")[0]
            assert multi["workers"] == 2
            shares = [record["cpus"] for record in started]
            assert all(shares) and not set(shares[0]) & set(shares[1]), shares  # disjoint cores

            first = [f"a{i}" for i in range(12)]
            await publish(kafka.bootstrap_servers, kafka.questions_topic, first)
            await reader.wait_for(first, 90, f"answers: {parent.describe()}")

            victim = started[0]["pid"]
            os.kill(victim, signal.SIGKILL)
            exited = await wait_events(parent, "deploy.worker_exited", 1, 30)
            assert exited[0]["exit_code"] == -signal.SIGKILL
            restarted = (await wait_events(parent, "deploy.worker_started", 3, 30))[2]
            assert restarted["worker"] == started[0]["worker"] and restarted["restarts"] == 1
            assert restarted["cpus"] == started[0]["cpus"]  # the same share of cores
            await wait_events(parent, "kev.ready", 3, STARTUP_TIMEOUT)

            second = [f"b{i}" for i in range(12)]
            await publish(kafka.bootstrap_servers, kafka.questions_topic, second)
            await reader.wait_for(second, 90, f"answers: {parent.describe()}")
            parent.signal(signal.SIGTERM)
            rc = await anyio.to_thread.run_sync(parent.wait, 60)
            tg.cancel_scope.cancel()
    assert rc == 0, parent.describe()
    assert events(parent, "deploy.stopped")[0]["exit_codes"] == [0, 0], parent.describe()
    workers = Counter(answer.audit.worker for answer in reader.answers)
    assert len(workers) >= 2, workers  # both original workers answered (the restarted one may too)
    assert {a.question_id for a in reader.answers} == set(first) | set(second)


@pytest.mark.kafka
def test_multi_gives_up_on_a_worker_that_keeps_crashing(kafka_broker, tmp_path):
    env = kev_env(KEV_DEPLOY__MODE="multi", KEV_DEPLOY__WORKERS="1", KEV_DEPLOY__RESTART_BACKOFF_S="0.1",
                  KEV_DEPLOY__MAX_FAST_CRASHES="2")
    broken = tmp_path / "broken.gguf"  # there (so the start's check passes), but no model: every worker crashes
    broken.write_bytes(b"not a GGUF")
    parent = KevProcess(["serve", "--model", str(broken), "--bootstrap-servers",
                         kafka_broker.bootstrap_servers], env, tmp_path / "crash.log")
    try:
        rc = parent.wait(STARTUP_TIMEOUT)
    finally:
        parent.kill()
    assert rc == 1, parent.describe()
    assert "worker 0 exited 2 times in a row" in parent.log() and "giving up" in parent.log(), parent.describe()
    assert len(events(parent, "deploy.worker_started")) == 2
