"""The Kev service: Kafka in, the scheduler actor, Kafka out — wired, started in order, stopped gracefully.

    consumers.KafkaWorker ──Inbound──► [engine.questions] ──► engine_actor ──► [engine.answers] ──Outbound──┐
            ▲                                                                                               │
            └──────────────────────── acked answers, then committed offsets ◄──────────────────────────────┘

aiokafka is asyncio-only, so the service runs on anyio's asyncio backend.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import partial

import anyio
import structlog
from anyio.abc import TaskStatus

from consumers import EMBEDDED, KafkaWorker, Outbound, embedded_kafka
from engine import Engine, EngineOptions, load_model
from kev_async.actors import Mailbox
from kev_async.engine_actor import engine_actor
from kev_async.lifecycle import Shutdown
from kev_async.metrics import Metrics
from kev_async.supervisor import Child, RestartPolicy, Supervisor
from schemas import KevConfig

log = structlog.get_logger("kev.app")

# Fast group membership for the embedded broker: Tansu waits about half the session timeout before
# the first assignment, and a killed member is noticed only when its session expires.
EMBEDDED_CONSUMER_OPTIONS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500,
                             "rebalance_timeout_ms": 6000}
# Not a config key on purpose: an operator's escape hatch, and the tests' way to keep Tansu's waits short
# against a broker `kev serve` did not start. When set, the consumer group uses this session timeout
# (rebalance timeout equal to it, heartbeats at a tenth of it) on any broker.
SESSION_TIMEOUT_ENV = "KEV_KAFKA_SESSION_TIMEOUT_MS"


@dataclass(frozen=True)
class Running:
    """What `serve` reports once it is ready."""

    bootstrap_servers: str
    worker: str
    model: str


def consumer_options(embedded: bool, embedded_options=None, env=os.environ) -> dict | None:
    """Group timings: a caller's embedded_options, else $KEV_KAFKA_SESSION_TIMEOUT_MS, else the fast
    embedded ones for a broker we started, else aiokafka's defaults (None)."""
    if embedded and embedded_options:
        return dict(embedded_options)
    raw = env.get(SESSION_TIMEOUT_ENV)
    if raw:
        try:
            session_ms = int(raw)
        except ValueError:
            raise ValueError(f"{SESSION_TIMEOUT_ENV} must be an integer of milliseconds, got {raw!r}") from None
        if session_ms < 1000:
            raise ValueError(f"{SESSION_TIMEOUT_ENV} must be at least 1000, got {session_ms}")
        return {"session_timeout_ms": session_ms, "heartbeat_interval_ms": max(100, session_ms // 10),
                "rebalance_timeout_ms": session_ms}
    return dict(EMBEDDED_CONSUMER_OPTIONS) if embedded else None


def worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def serve(cfg: KevConfig, shutdown: Shutdown, *, model=None, embedded_options=None,
                task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Run until `shutdown` is requested, then drain: every question taken is answered and committed."""
    name = worker_name()
    group_options = consumer_options(cfg.kafka.bootstrap_servers == EMBEDDED, embedded_options)
    if model is None:
        model = await anyio.to_thread.run_sync(
            partial(load_model, cfg.core.model_path, device=cfg.core.device, dtype=cfg.core.precision))
    options = EngineOptions.from_config(cfg, worker=name)
    capacity = 2 * cfg.router.max_parallel_queries
    questions, answers = Mailbox("engine.questions", capacity), Mailbox("engine.answers", capacity)
    metrics = Metrics(log_prompts=cfg.logging.log_prompts)
    metrics.watch_mailboxes(questions, answers)
    async with metrics.endpoint(cfg.metrics.port), embedded_kafka(cfg.kafka) as kafka_cfg:
        worker = KafkaWorker(kafka_cfg, questions.send, answers.receive, consumer_options=group_options)
        metrics.watch_kafka(worker)
        supervisor = Supervisor("kev", [
            # The scheduler starts first and is restarted alone if it crashes (its questions get error
            # answers); a broken Kafka connection is not retried here: the process exits non-zero and
            # Kafka redelivers whatever was not committed.
            Child("scheduler", partial(engine_actor, wrap=metrics.wrap(Outbound),
                                       engine_factory=lambda: metrics.watch_engine(Engine(model, options))),
                  (questions.receive, answers.send), RestartPolicy(max_restarts=3, within_s=60)),
            Child("kafka", worker.run, policy=RestartPolicy(restart="temporary")),
        ])
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            log.info("kev.ready", bootstrap_servers=kafka_cfg.bootstrap_servers, worker=name,
                     model=model.name, questions_topic=kafka_cfg.questions_topic)
            task_status.started(Running(kafka_cfg.bootstrap_servers, name, model.name))
            await shutdown.requested.wait()
            worker.stop_intake()  # the engine drains, answers are acked, offsets committed; then run() returns
