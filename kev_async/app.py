"""The Kev service: Kafka in, the scheduler actor, Kafka out — wired, started in order, stopped gracefully.

    consumers.KafkaWorker ──Inbound──► [engine.questions] ──► engine_actor ──► [engine.answers] ──Outbound──┐
            ▲                                                      ▲                                        │
            │ kev.control ─► control_actor ─► [engine.control] ────┘ LoadAdapter / UnloadAdapter /          │
            │                                                        UpdateDefaults (ask), Cancel           │
            └──────────────────────── acked answers, then committed offsets ◄──────────────────────────────┘

Control has its own mailbox, read ahead of and apart from the questions: a cancel (what frees a
hung-up client's KV blocks) never queues behind questions the engine has no place for yet.

aiokafka is asyncio-only, so the service runs on anyio's asyncio backend.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from consumers import EMBEDDED, KafkaWorker, Outbound, embedded_kafka, run_control_audit, run_control_reader
from consumers.control.history import refuse_unverifiable
from engine import Engine, EngineOptions, load_model
from engine.model.loader import cache_dir
from kev_async.engine_actor import engine_actor
from kev_async.engine_messages import Cancel, LoadAdapter, UnloadAdapter, UpdateDefaults
from kev_async.engine_state import ControlState
from kev_async.kafka_loop import KafkaLoopWatch
from kev_async.observe.metrics import Metrics
from kev_async.runtime.actors import Mailbox, ask
from kev_async.runtime.lifecycle import Shutdown
from kev_async.runtime.supervisor import Child, RestartPolicy, Supervisor
from schemas import AdaptersConfig, ControlEvent, KafkaConfig, KevConfig

log = structlog.get_logger("kev.app")

# Fast group membership for the embedded broker: Tansu waits about half the session timeout before
# the first assignment, and a killed member is noticed only when its session expires.
EMBEDDED_CONSUMER_OPTIONS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500,
                             "rebalance_timeout_ms": 6000}
# Not a config key on purpose: an operator's escape hatch, and the tests' way to keep Tansu's waits short
# against a broker `kev serve` did not start. When set, the consumer group uses this session timeout
# (rebalance timeout equal to it, heartbeats at a tenth of it) on any broker.
SESSION_TIMEOUT_ENV = "KEV_KAFKA_SESSION_TIMEOUT_MS"
CONTROL_TIMEOUT_S = 120.0  # the engine actor applies one control command within this, or it is logged as failed
CONTROL_CAPACITY = 64  # cancels and commands waiting for the engine actor; a burst of cancels is cheap to apply


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
            partial(load_model, cfg.core.model_path, device=cfg.core.device, dtype=cfg.core.precision,
                    weights=cfg.core.weights, pack_fp32=cfg.core.pack_fp32,
                    matmul=cfg.core.matmul))
    options = EngineOptions.from_config(cfg, worker=name)
    capacity = 2 * cfg.router.max_parallel_queries
    questions, answers = Mailbox("engine.questions", capacity), Mailbox("engine.answers", capacity)
    control = Mailbox("engine.control", CONTROL_CAPACITY)
    metrics = Metrics(log_prompts=cfg.logging.log_prompts)
    metrics.watch_mailboxes(questions, control, answers)
    async with metrics.endpoint(cfg.metrics.port, cfg.metrics.host), embedded_kafka(cfg.kafka, cfg.broker) as kafka_cfg:
        # Before any actor starts: kept commands signed by keys this worker lacks would revert silently (a key
        # rotation half done), so it refuses to start, naming them (consumers/control/history.py).
        await refuse_unverifiable(kafka_cfg)
        worker = KafkaWorker(kafka_cfg, questions.send, answers.receive, consumer_options=group_options,
                             read_ahead=cfg.kafka.read_ahead or cfg.router.max_parallel_queries,
                             default_timeout_ms=cfg.aggregator.timeout_ms)
        metrics.watch_kafka(worker)
        kafka_watch = KafkaLoopWatch(shutdown)
        supervisor = Supervisor("kev", [
            # The scheduler starts first and is restarted alone if it crashes (its questions get error
            # answers); a broken Kafka connection is not retried here: the process exits non-zero and
            # Kafka redelivers whatever was not committed.
            Child("scheduler", partial(engine_actor, control=control.receive, wrap=metrics.wrap(Outbound),
                                       engine_factory=lambda: metrics.watch_engine(Engine(model, options)),
                                       state=ControlState()),  # shared by every start: adapters, defaults
                  (questions.receive, answers.send), RestartPolicy(max_restarts=3, within_s=60)),
            # Control commands next: it is ready once the commands already on the control topic are applied,
            # so the questions taken after it see those adapters and defaults. A crash restarts it (it
            # replays the topic again); its own clone of the control mailbox's send end closes when it ends.
            Child("control", control_actor, (kafka_cfg, control, shutdown, cfg.adapters),
                  RestartPolicy(max_restarts=3, within_s=60, backoff_s=1.0)),
            # Last, and never restarted in place: if it ends on its own the watch stops the service and
            # raises KafkaLoopFailed (`kev serve` exits 1), so the process is restarted from outside.
            Child("kafka", partial(kafka_watch.run, worker), policy=RestartPolicy(restart="temporary")),
        ])
        async with anyio.create_task_group() as tg:
            kafka_watch.scope = tg.cancel_scope
            await tg.start(supervisor.run)
            log.info("kev.ready", bootstrap_servers=kafka_cfg.bootstrap_servers, worker=name,
                     model=model.name, questions_topic=kafka_cfg.questions_topic)
            task_status.started(Running(kafka_cfg.bootstrap_servers, name, model.name))
            await shutdown.requested.wait()
            worker.stop_intake()  # the engine drains, answers are acked, offsets committed; then run() returns
        kafka_watch.raise_if_failed()


async def control_actor(kafka_cfg: KafkaConfig, control: Mailbox, shutdown: Shutdown,
                        adapters: AdaptersConfig = AdaptersConfig(), *,
                        reader=run_control_reader, audit=run_control_audit, timeout: float = CONTROL_TIMEOUT_S,
                        task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Apply the control topic's signed commands through the engine actor's control mailbox until shutdown
    is requested (its question inbox works too, as in tests: the commands then queue behind questions).

    Sends on a clone of the mailbox's send end, closed when this actor ends, so a question inbox given
    here still ends once the Kafka intake closes the original (the engine's graceful stop). Ready once
    every command already on the topic has been applied; each command is sent with `ask` and applied
    before the next.
    Adapters load only from under `adapters.root`. Once ready it also joins the control audit
    (consumers/control/audit.py: dead letters for rejected commands, one per record for the fleet, and
    tombstones for old cancels); `audit=None` leaves it out. The audit retries its own failures and
    never raises, so a broker that is briefly away never restarts this actor (and its replay).
    """
    started = False
    with shutdown.intake():
        try:
            inbox = control.send.clone()
        except anyio.ClosedResourceError:  # the mailbox has closed: the engine is stopping
            inbox = None
        if inbox is not None:
            with inbox:
                applier = _ControlApplier(inbox, timeout, adapters_root(adapters))
                send, receive = anyio.create_memory_object_stream[tuple[ControlEvent, int]](16)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(applier.run, receive)
                    # With its offset: the command's id, so a replay into this engine applies nothing twice.
                    replayed = await tg.start(partial(reader, wrap=lambda event, offset: (event, offset)),
                                              kafka_cfg, send)
                    await applier.wait_applied(replayed)
                    log.info("control.ready", topic=kafka_cfg.control_topic, replayed=replayed)
                    if audit is not None:
                        tg.start_soon(partial(audit, kafka_cfg, consumer_options=consumer_options(False)))
                    started = True
                    task_status.started()
    if not started:  # shut down before it was ready: still let the supervisor go on
        task_status.started()


def adapters_root(adapters: AdaptersConfig) -> Path:
    """Where load_adapter may read from: `adapters.root`, else `adapters` in Kev's cache directory."""
    return Path(adapters.root).expanduser() if adapters.root else cache_dir() / "adapters"


class AdapterPathRefused(ValueError):
    """A load_adapter path that resolves outside adapters.root."""


def adapter_path(root: Path, requested: str) -> Path:
    """The command's path resolved (symlinks followed; a relative one under `root`), if it lies under root."""
    resolved_root = root.resolve()
    path = (root / requested).resolve()  # an absolute `requested` replaces root
    if not path.is_relative_to(resolved_root):
        raise AdapterPathRefused(f"path {requested[:200]!r} resolves to {str(path)[:200]!r}, outside "
                                 f"adapters.root {str(resolved_root)!r}: set adapters.root to the directory "
                                 f"that holds your adapters (a relative path is taken under it)")
    return path


class _ControlApplier:
    """Turns each ControlEvent into the engine actor's message and waits for its outcome."""

    def __init__(self, inbox: MemoryObjectSendStream, timeout: float, root: Path) -> None:
        self.inbox, self.timeout, self.root = inbox, timeout, root
        self.applied = 0  # commands handled, whatever their outcome
        self._progress = anyio.Event()

    async def run(self, receive: MemoryObjectReceiveStream[tuple[ControlEvent, int]]) -> None:
        async with receive:
            async for event, offset in receive:
                await self.apply(event, offset)
                self.applied += 1
                self._progress.set()
                self._progress = anyio.Event()

    async def wait_applied(self, count: int) -> None:
        while self.applied < count:
            await self._progress.wait()

    async def apply(self, event: ControlEvent, offset: int | None = None) -> None:
        if event.action == "cancel":
            # Every worker hears every cancel; the engine ignores an id it does not hold. Nothing to wait for.
            await self.inbox.send(Cancel(event.question_id))
            log.info("control.cancel", question_id=event.question_id)
            return
        try:
            if event.action == "load_adapter":
                body = LoadAdapter(event.name, adapter_path(self.root, event.path), command_id=offset)
            elif event.action == "unload_adapter":
                body = UnloadAdapter(event.name, command_id=offset)
            else:
                body = UpdateDefaults(dict(event.defaults or {}), command_id=offset)
            result = await ask(self.inbox, body, self.timeout)
        except Exception as error:  # noqa: BLE001 - a bad command is logged; the next one still applies
            reason = f"adapter {event.name!r} is not loaded" if isinstance(error, KeyError) else str(error)
            log.warning("control.failed", action=event.action, name=event.name, error=reason or repr(error),
                        error_type=type(error).__name__)
            return
        version = getattr(result, "version", result)  # the adapter's version, the defaults' version, None
        log.info("control.applied", action=event.action, name=event.name, version=version,
                 **({"defaults": event.defaults} if event.defaults else {}))
