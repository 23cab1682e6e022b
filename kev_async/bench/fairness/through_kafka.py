"""A scenario through Kafka: `kev serve` in this process on an embedded broker, each question published at
its arrival time, signed by the bench's key under its tenant (so the tenant is its principal's), its latency
from its publish to its answer's record timestamp (stamped by the worker's producer as it sends). The
scheduler's service per tenant is scraped from the worker's metrics endpoint (kev_tenant_*) every SAMPLE_S:
the same report the in-process path reads from the scheduler (only where a scenario's shares are read)."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable
from functools import partial

import anyio
import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kev_async.bench.fairness.in_process import BENCH_KEY, SAMPLE_S, Outcome, Samples
from kev_async.bench.fairness.scenarios import Scenario
from kev_async.logs import quieted
from schemas import KevConfig, Params, QuestionEvent, decode_answer, encode
from schemas.config import TenantConfig
from schemas.kafka_config import EMBEDDED_BROKER, TrustConfig
from schemas.signing import QUESTION, Signer

BENCH_SECRET = "kev-bench-fairness-key"  # HMAC, this process only: the worker verifies what the bench signs
WARM_UP = QuestionEvent(question_id="warm-up", prompt="Say hi.", params=Params(max_new_tokens=2, temperature=0.0))
ANSWER_FETCH_WAIT_MS = 100  # the reader's fetch wait: latency ends at the answer's timestamp, not when read


def kafka_path(model, base: KevConfig) -> Callable[..., tuple[list[Outcome], Samples]]:
    """A scenario runner through Kafka: each run on a fresh embedded broker that its `kev serve` starts (with
    the fast group timings serve gives a broker of its own)."""
    def run(scenario: Scenario, policy: str, *, sample: bool = False) -> tuple[list[Outcome], Samples]:
        kafka = msgspec.structs.replace(base.kafka, bootstrap_servers=EMBEDDED_BROKER,
                                        trust=TrustConfig(keys={BENCH_KEY: BENCH_SECRET}))
        cfg = _for_scenario(msgspec.structs.replace(base, kafka=kafka), scenario, policy)
        with quieted("warning"):  # the worker logs every answer and commit at info: the tables would drown
            return anyio.run(_run, model, cfg, scenario, sample, backend="asyncio")

    return run


def _for_scenario(base: KevConfig, scenario: Scenario, policy: str) -> KevConfig:
    """`base` with the scenario's tenants and `policy`, a metrics port of its own, and no default deadline (the
    in-process path has none)."""
    tenants = {name: TenantConfig(weight=weight) for name, weight in scenario.weights.items()}
    replace = msgspec.structs.replace
    return replace(base, tenants=tenants,
                   scheduler=replace(base.scheduler, policy=policy),
                   aggregator=replace(base.aggregator, timeout_ms=3_600_000),
                   metrics=replace(base.metrics, port=_free_port()))


async def _run(model, cfg: KevConfig, scenario: Scenario, sample: bool) -> tuple[list[Outcome], Samples]:
    from consumers.kafka_client.topics import ensure_topics
    from kev_async.app import serve
    from kev_async.runtime.lifecycle import Shutdown

    shutdown = Shutdown(drain_deadline=60)
    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(serve, cfg, shutdown, model=model))
        kafka = msgspec.structs.replace(cfg.kafka, bootstrap_servers=running.bootstrap_servers)
        await ensure_topics(kafka)  # before the reader subscribes: it would not see a topic made after it
        outcomes, samples = await _ask_and_read(msgspec.structs.replace(cfg, kafka=kafka), scenario, sample)
        shutdown.request("bench finished")
    return outcomes, samples


async def _ask_and_read(cfg: KevConfig, scenario: Scenario, sample: bool) -> tuple[list[Outcome], Samples]:
    from consumers.kafka_client.clients import open_consumer, open_producer

    kafka = cfg.kafka
    signer = Signer.hmac(BENCH_KEY, BENCH_SECRET)
    outcomes: list[Outcome] = []
    samples = Samples()
    tenant_of = {a.question.question_id: a for a in scenario.asked}
    published: dict[str, float] = {}  # time.time(), the clock of the answers' record timestamps
    async with open_producer(kafka, linger_ms=0) as producer, \
            open_consumer(kafka, kafka.answers_topic, fetch_max_wait_ms=ANSWER_FETCH_WAIT_MS) as consumer:
        await _warm_up(producer, consumer, kafka)
        t0, t0_wall = time.monotonic(), time.time()

        async def publish() -> None:
            for asked in sorted(scenario.asked, key=lambda a: a.arrival_s):
                await anyio.sleep_until(t0 + asked.arrival_s)
                value, key = encode(asked.question), asked.question.question_id.encode()
                published[asked.question.question_id] = time.time()
                await producer.send(kafka.questions_topic, value, key=key,
                                    headers=signer.headers(QUESTION, kafka.questions_topic, key, value))

        async with anyio.create_task_group() as tg:
            tg.start_soon(publish)
            if sample:  # a scrape costs the worker's loop some CPU: only where the shares are read
                tg.start_soon(_sample, cfg.metrics.port, t0, samples, outcomes, len(scenario.asked))
            while len(outcomes) < len(scenario.asked):
                batch = await consumer.getmany(timeout_ms=100)
                for record in (r for records in batch.values() for r in records):
                    answer = decode_answer(record.value)
                    asked = tenant_of.get(answer.question_id)
                    if asked is None or answer.question_id not in published:
                        continue  # the warm-up's
                    outcomes.append(Outcome(asked.tenant, answer.question_id, asked.arrival_s,
                                            record.timestamp / 1000 - t0_wall, answer.usage.completion_tokens,
                                            answer.token_ids, answer.error.code if answer.error else None))
    return outcomes, samples


async def _warm_up(producer, consumer, kafka, timeout_s: float = 300.0) -> None:
    """A warm-up question on every partition until one is answered: the worker holds its partitions and has
    run a step."""
    with anyio.fail_after(timeout_s):
        for attempt in itertools.count():
            warm_up = msgspec.structs.replace(WARM_UP, question_id=f"warm-up-{attempt}")
            for partition in range(kafka.partitions):
                await producer.send(kafka.questions_topic, encode(warm_up), partition=partition)
            with anyio.move_on_after(2.0):
                while True:
                    batch = await consumer.getmany(timeout_ms=100)
                    if any(decode_answer(r.value).question_id.startswith("warm-up")
                           for records in batch.values() for r in records):
                        return  # the other warm-ups' answers are read and passed over with the scenario's


async def _sample(port: int, t0: float, samples: Samples, outcomes: list[Outcome], expected: int) -> None:
    """kev_tenant_service_tokens and kev_tenant_questions{state="waiting"} per tenant, as the in-process path's
    sampler reads them from the scheduler."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
        while len(outcomes) < expected:
            now = time.monotonic() - t0
            samples.points.append((now, _tenant_report((await client.get("/metrics")).text)))
            await anyio.sleep(SAMPLE_S)


def _tenant_report(text: str) -> dict[str, dict]:
    report: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tenant = sample.labels.get("tenant")
            if tenant is None:
                continue
            entry = report.setdefault(tenant, {"served": 0, "waiting": 0})
            if sample.name == "kev_tenant_service_tokens_total":
                entry["served"] = int(sample.value)
            elif sample.name == "kev_tenant_questions" and sample.labels.get("state") == "waiting":
                entry["waiting"] = int(sample.value)
    return report


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
