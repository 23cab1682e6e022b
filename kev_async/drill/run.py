"""`kev drill`: a fault drill on the embedded broker with real `kev serve` processes.

Questions arrive over time while N workers (one consumer group) answer them; mid-stream one worker
is SIGKILLed, a new one is started, another is stopped with SIGTERM. Then the run is checked
(checks.py): every question has exactly one final answer (redelivery duplicates counted and required
identical: the workers run deterministic mode), no offset was committed before its answer was acked,
and every worker that stopped gracefully left its KV pool all free.

Between the two, the broker itself is SIGKILLed and restarted on its data (broker.py: durable storage,
a local object store under the workdir); every question published before it must be answered.

With `exactly_once` (`kev drill --exactly-once`) the workers run `kafka.delivery: exactly_once` and the
answers are read read_committed: through the same faults, every question must show exactly one answer
(0 duplicates, 0 missing), on top of every other check.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import anyio
import msgspec

from consumers import EmbeddedBroker, create_topics, topic_plan
from consumers.route import RouteService
from kev_async.drill.broker import BrokerRestart, drill_broker, restart_broker, restart_summary
from kev_async.drill.checks import DrillResult, check_run, log_events
from kev_async.drill.topics import (
    committed,
    positions,
    publish_over_time,
    read_answers,
    records_on,
    until_committed,
)
from kev_async.drill.workers import Workers
from schemas import DEFAULT_MODEL, KafkaConfig

REJOIN_WAIT_S = 6.0  # a worker's session timeout (consumers/worker.py GROUP_TIMEOUTS)


@dataclass
class DrillOptions:
    questions: int = 400
    workers: int = 3
    partitions: int = 6
    max_new_tokens: int = 16
    spread_s: float = 60.0  # questions arrive evenly over this long
    model: str = DEFAULT_MODEL
    workdir: Path = Path(".cache/drill")  # worker logs, report.json and the broker's data
    faults: bool = True  # False: a plain throughput run (the scaling table)
    pin: bool = False  # pin worker i to core i mod cores (each worker runs one torch thread)
    startup_timeout_s: float = 180.0
    answer_timeout_s: float = 600.0  # then DrillStalled names the unanswered questions
    route: str | None = None  # a strategy: publish to the intake topic and run `kev route`'s loop in process
    system_prompts: tuple[str, ...] = ()  # each question gets one at random (seeded); none when empty
    worker_env: dict[str, str] = field(default_factory=dict)  # extra KEV_* settings for every worker
    exactly_once: bool = False  # kafka.delivery exactly_once, answers read read_committed: no duplicate allowed


@dataclass
class _Run:
    """What one drill has done so far, as its course and its checks read it."""

    kafka: KafkaConfig
    options: DrillOptions
    broker: EmbeddedBroker
    out: Callable[[str], None] = print
    workers: Workers = field(init=False)
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)  # question_id -> (partition, offset)
    answers: list = field(default_factory=list)  # (AnswerEvent, record)
    timeline: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    # SIGKILLed worker -> (its name in answers' audit, when): the duplicate bound's inputs
    killed: dict[str, tuple[str, datetime]] = field(default_factory=dict)
    broker_restart: BrokerRestart | None = None

    def __post_init__(self) -> None:
        self.workers = Workers(self.options, self.kafka, self.note)

    def note(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f}s] {text}"
        self.timeline.append(line)
        self.out(line)

    def answered(self) -> set[str]:
        return {answer.question_id for answer, _ in self.answers}


async def run_drill(options: DrillOptions, out=print) -> DrillResult:
    options.workdir.mkdir(parents=True, exist_ok=True)
    async with drill_broker(options) as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers, group_id="kev-drill",
                            partitions=options.partitions, commit_interval_ms=200)
        await create_topics(kafka, topic_plan(kafka))
        run = _Run(kafka, options, broker, out)
        try:
            await _drill(run)
        finally:
            run.workers.kill_left_running()
        final = await committed(kafka)
        layout = await records_on(kafka)
    logs = {w.name: (w.fate, w.process.returncode, w.log()) for w in run.workers}
    result = check_run(run.sent, run.answers, logs, final, kafka.questions_topic, killed=run.killed,
                       broker_killed_at=run.broker_restart.killed_at if run.broker_restart else None,
                       layout=layout, exactly_once=options.exactly_once)
    result.timeline = run.timeline
    result.broker_restart, held = restart_summary(run.broker_restart, run.answers, options.faults)
    result.ok = result.ok and held
    return result


async def _drill(run: _Run) -> None:
    options, workers = run.options, run.workers
    for _ in range(options.workers):
        workers.spawn()
    with anyio.fail_after(options.startup_timeout_s):
        while not all(log_events(w.log(), "partitions_assigned") for w in workers):
            workers.assert_alive()
            await anyio.sleep(0.2)
    run.note(f"{options.workers} workers in group {run.kafka.group_id}")
    async with anyio.create_task_group() as tg:
        await tg.start(partial(read_answers, run.kafka, run.answers, read_committed=options.exactly_once))
        if options.route:
            await tg.start(RouteService(run.kafka, options.route).run)
        tg.start_soon(publish_over_time, run.kafka, options, run.sent, run.note)
        if options.faults:
            await _faults(run)
        with anyio.move_on_after(options.answer_timeout_s):
            while not _all_answered(run):
                await anyio.sleep(0.2)
        stalled = None if _all_answered(run) else _stalled(run, await _traces(run))
        if stalled is None:
            await _settle(run)
        tg.cancel_scope.cancel()
    if stalled is not None:
        raise stalled
    for worker in workers:
        if worker.fate == "running":
            worker.process.send_signal(signal.SIGTERM)
            worker.fate = "terminated"
    for worker in workers:
        await workers.wait_exit(worker)
    run.note("every worker stopped")


class DrillStalled(RuntimeError):
    """Questions still unanswered at the drill's deadline: which, where they sit, and who was running."""


def _all_answered(run: _Run) -> bool:
    return len(run.sent) >= run.options.questions and set(run.sent) <= run.answered()


def _stalled(run: _Run, traces: str = "") -> DrillStalled:
    missing = sorted(set(run.sent) - run.answered())
    unsent = run.options.questions - len(run.sent)
    parts = []
    if missing:
        where = ", ".join(f"{q} (partition {run.sent[q][0]}, offset {run.sent[q][1]})" for q in missing[:8])
        parts.append(f"{len(missing)} question(s) unanswered: {where}{' ...' if len(missing) > 8 else ''}")
    if unsent:
        parts.append(f"{unsent} never published")
    fates = ", ".join(f"{w.name} {w.fate}{_exit(w)}" for w in run.workers) or "none started"
    parts.append(f"workers: {fates}; their logs: {run.options.workdir}")
    if traces:
        parts.append(traces)
    return DrillStalled(f"after {run.options.answer_timeout_s:.0f} s, " + "; ".join(parts))


def _exit(worker) -> str:
    code = worker.process.poll()
    return "" if code is None or worker.fate != "running" else f" (but it exited {code})"


async def _traces(run: _Run) -> str:
    """For a stall that happens once in many runs (CI keeps no logs): where each unanswered question (the
    first four) sits on the topic, the group's commit on its partition, and what each worker logged of it."""
    missing = sorted(set(run.sent) - run.answered())[:4]
    if not missing:
        return ""
    with anyio.move_on_after(40) as scope:
        layout, commits = await records_on(run.kafka), await committed(run.kafka)
    if scope.cancelled_caught:
        return "the topic and the group's commits could not be read"
    lines = []
    for qid in missing:
        partition = run.sent[qid][0]
        offsets = [offset for offset, key in sorted(layout.get(partition, {}).items()) if key == qid]
        seen = {w.name: events for w in run.workers if (events := _mentions(w.log(), qid))}
        lines.append(f"{qid}: on partition {partition} at offsets {offsets}, the group's commit there "
                     f"{commits.get(partition)}, logged by {seen or 'no worker'}")
    return "; ".join(lines)


def _mentions(log: str, qid: str) -> list[str]:
    """The events a worker's log names `qid` in, in order."""
    events = []
    for line in log.splitlines():
        if qid in line and line.startswith("{"):
            try:
                events.append(msgspec.json.decode(line).get("event", "?"))
            except (msgspec.DecodeError, AttributeError):
                continue
    return events


async def _settle(run: _Run) -> None:
    """Answered is not settled: redelivered questions may still be answered again and committed. Wait
    until the group's commits cover every question (or say it never happened), then for late duplicates."""
    run.note(f"all {run.options.questions} questions answered")
    if run.options.route:  # where the router put each question: the positions the workers commit
        run.sent = await positions(run.kafka)
    settled = await until_committed(run.kafka, run.sent, timeout=120.0)
    run.note("the group's commits cover every question" if settled else
             "the group's commits did not cover every question within 120 s")
    await anyio.sleep(2.0)  # late duplicates from redelivery still count


async def _faults(run: _Run) -> None:
    total, workers = run.options.questions, run.workers
    await _until_answered(run, total // 4)
    victim = workers[0]
    victim.process.send_signal(signal.SIGKILL)
    victim.fate = "killed"
    # As `kev serve` names itself in answers' audit (kev_async.app.worker_name), and when, for the duplicate bound.
    run.killed[victim.name] = (f"{socket.gethostname()}-{victim.process.pid}", datetime.now(timezone.utc))
    run.note(f"SIGKILL {victim.name} (pid {victim.process.pid}) at {len(run.answered())} answered")
    workers.spawn()
    await _until_answered(run, total * 2 // 5)
    await workers.until_settled()
    run.broker_restart = await restart_broker(run)
    restarted = time.monotonic()
    await _until_answered(run, total * 11 // 20)
    # The members find the restarted broker and may rejoin within a session timeout: let that show first.
    await anyio.sleep(max(0.0, REJOIN_WAIT_S - (time.monotonic() - restarted)))
    await workers.until_settled()
    leaving = workers[1]
    leaving.process.send_signal(signal.SIGTERM)
    leaving.fate = "terminated"
    run.note(f"SIGTERM {leaving.name} (pid {leaving.process.pid}) at {len(run.answered())} answered")
    code = await workers.wait_exit(leaving)
    run.note(f"{leaving.name} drained and exited {code}")


async def _until_answered(run: _Run, count: int) -> None:
    while len(run.answered()) < count:
        run.workers.assert_alive()
        await anyio.sleep(0.1)


def result_json(result: DrillResult) -> bytes:
    return msgspec.json.format(msgspec.json.encode(result), indent=2)
