"""`kev drill`: a fault drill on the embedded broker with real `kev serve` processes.

Questions arrive over time while N workers (one consumer group) answer them; mid-stream one worker
is SIGKILLed, a new one is started, another is stopped with SIGTERM. Then the run is checked
(kev_async/drill_checks.py): every question has exactly one final answer (redelivery duplicates
counted and required identical: the workers run deterministic mode), no offset was committed before
its answer was acked, and every worker that stopped gracefully left its KV pool all free.

Between the two, the broker itself is SIGKILLed and restarted on its data (kev_async/drill_broker.py:
durable storage, a local object store under the workdir); every question published before it must be
answered.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from consumers import EmbeddedBroker, create_topics, topic_plan
from kev_async.bench.questions import QUESTIONS
from kev_async.drill_broker import BrokerRestart, drill_broker, restart_broker, restart_summary
from kev_async.drill_checks import DrillResult, check_run, log_events
from schemas import KafkaConfig, Params, QuestionEvent, decode_answer, encode

DRAIN_DEADLINE_S = 120  # a SIGTERMed worker's `--drain-deadline`; the drill waits a little longer for its exit
SETTLE_TIMEOUT_S = 60.0  # how long a fault waits for the group to hold every partition again
REJOIN_WAIT_S = 6.0  # a worker's session timeout (consumers/worker.py GROUP_TIMEOUTS)


@dataclass
class DrillOptions:
    questions: int = 400
    workers: int = 3
    partitions: int = 6
    max_new_tokens: int = 16
    spread_s: float = 60.0  # questions arrive evenly over this long
    model: str = "smollm2-135m-instruct"
    workdir: Path = Path("kev-drill")
    faults: bool = True  # False: a plain throughput run (the scaling table)
    pin: bool = False  # pin worker i to core i mod cores (each worker runs one torch thread)
    startup_timeout_s: float = 180.0
    answer_timeout_s: float = 600.0
    route: str | None = None  # a strategy: publish to the intake topic and run `kev route`'s loop in process
    system_prompts: tuple[str, ...] = ()  # each question gets one at random (seeded); none when empty
    worker_env: dict[str, str] = field(default_factory=dict)  # extra KEV_* settings for every worker


@dataclass
class _Worker:
    name: str
    process: subprocess.Popen
    log_path: Path
    fate: str = "running"  # running | killed | terminated | hung (outlived its drain deadline)

    def log(self) -> str:
        return self.log_path.read_text("utf-8", "replace")


@dataclass
class _Run:
    kafka: KafkaConfig
    options: DrillOptions
    workers: list[_Worker] = field(default_factory=list)
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)  # question_id -> (partition, offset)
    answers: list = field(default_factory=list)  # (AnswerEvent, record)
    timeline: list[str] = field(default_factory=list)
    started: float = 0.0
    # SIGKILLed worker -> (its name in answers' audit, when): the duplicate bound's inputs
    killed: dict[str, tuple[str, datetime]] = field(default_factory=dict)
    broker: EmbeddedBroker | None = None
    broker_restart: BrokerRestart | None = None

    def note(self, text: str, out) -> None:
        line = f"[{time.monotonic() - self.started:6.1f}s] {text}"
        self.timeline.append(line)
        out(line)

    def answered(self) -> set[str]:
        return {answer.question_id for answer, _ in self.answers}


async def run_drill(options: DrillOptions, out=print) -> DrillResult:
    options.workdir.mkdir(parents=True, exist_ok=True)
    async with drill_broker(options) as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers, group_id="kev-drill",
                            partitions=options.partitions, commit_interval_ms=200)
        await create_topics(kafka.bootstrap_servers, topic_plan(kafka))
        run = _Run(kafka, options, started=time.monotonic(), broker=broker)
        try:
            await _drill(run, out)
        finally:
            for worker in run.workers:
                if worker.process.poll() is None:
                    worker.process.kill()
                    worker.process.wait()
        committed = await _committed(kafka)
    logs = {w.name: (w.fate, w.process.returncode, w.log()) for w in run.workers}
    result = check_run(run.sent, run.answers, logs, committed, kafka.questions_topic, killed=run.killed,
                       broker_killed_at=run.broker_restart.killed_at if run.broker_restart else None)
    result.timeline = run.timeline
    result.broker_restart, held = restart_summary(run.broker_restart, run.answers, options.faults)
    result.ok = result.ok and held
    return result


async def _drill(run: _Run, out) -> None:
    options = run.options
    for _ in range(options.workers):
        _spawn(run, out)
    with anyio.fail_after(options.startup_timeout_s):
        while not all(log_events(w.log(), "partitions_assigned") for w in run.workers):
            _assert_alive(run)
            await anyio.sleep(0.2)
    run.note(f"{options.workers} workers in group {run.kafka.group_id}", out)
    async with anyio.create_task_group() as tg:
        await tg.start(_read_answers, run)
        if options.route:
            from consumers.route import RouteService

            await tg.start(RouteService(run.kafka, options.route).run)
        tg.start_soon(_publish_over_time, run, out)
        if options.faults:
            await _faults(run, out)
        with anyio.fail_after(options.answer_timeout_s):
            while len(run.sent) < options.questions or not set(run.sent) <= run.answered():
                await anyio.sleep(0.2)
        run.note(f"all {options.questions} questions answered", out)
        if options.route:  # where the router put each question: the positions the workers commit
            run.sent = await _positions(run.kafka, options.questions)
        # Answered is not settled: redelivered questions may still be answered again and committed.
        # Stop the workers once the group's commits cover every question (or say it never happened).
        settled = await _until_committed(run, timeout=120.0)
        run.note("the group's commits cover every question" if settled else
                 "the group's commits did not cover every question within 120 s", out)
        await anyio.sleep(2.0)  # late duplicates from redelivery still count
        tg.cancel_scope.cancel()
    for worker in run.workers:
        if worker.fate == "running":
            worker.process.send_signal(signal.SIGTERM)
            worker.fate = "terminated"
    for worker in run.workers:
        await _wait_exit(run, worker, out)
    run.note("every worker stopped", out)


async def _faults(run: _Run, out) -> None:
    total = run.options.questions
    await _until_answered(run, total // 4)
    victim = run.workers[0]
    victim.process.send_signal(signal.SIGKILL)
    victim.fate = "killed"
    # As `kev serve` names itself in answers' audit (kev_async.app.worker_name), and when, for the duplicate bound.
    run.killed[victim.name] = (f"{socket.gethostname()}-{victim.process.pid}", datetime.now(timezone.utc))
    run.note(f"SIGKILL {victim.name} (pid {victim.process.pid}) at {len(run.answered())} answered", out)
    _spawn(run, out)
    await _until_answered(run, total * 2 // 5)
    await _until_group_settled(run, out)
    run.broker_restart = await restart_broker(run, out)
    restarted = time.monotonic()
    await _until_answered(run, total * 11 // 20)
    # The members find the restarted broker and may rejoin within a session timeout: let that show first.
    await anyio.sleep(max(0.0, REJOIN_WAIT_S - (time.monotonic() - restarted)))
    await _until_group_settled(run, out)
    leaving = run.workers[1]
    leaving.process.send_signal(signal.SIGTERM)
    leaving.fate = "terminated"
    run.note(f"SIGTERM {leaving.name} (pid {leaving.process.pid}) at {len(run.answered())} answered", out)
    code = await _wait_exit(run, leaving, out)
    run.note(f"{leaving.name} drained and exited {code}", out)


async def _until_group_settled(run: _Run, out) -> None:
    """Until the running workers hold every partition between them, each some. One fault at a time: on
    the embedded Tansu a rebalance in which one member leaves while another joins can leave the whole
    group without assignments for good (consumers/worker.py), which no worker can mend."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not _group_settled(run):
        _assert_alive(run)
        if time.monotonic() > deadline:
            run.note(f"the group did not settle within {SETTLE_TIMEOUT_S:.0f}s; going on", out)
            return
        await anyio.sleep(0.2)


def _group_settled(run: _Run) -> bool:
    held: set[str] = set()
    for worker in run.workers:
        if worker.fate != "running":
            continue
        mine = _assignment(worker.log(), run.kafka.questions_topic)
        if not mine:
            return False
        held |= mine
    return len(held) == run.kafka.partitions


def _assignment(log: str, topic: str) -> set[str]:
    """The worker's questions partitions after its last assignment or revocation (eager rebalancing)."""
    current: set[str] = set()
    for line in log.splitlines():
        if not line.startswith("{") or "partitions_" not in line:
            continue
        try:
            entry = msgspec.json.decode(line)
        except msgspec.DecodeError:
            continue
        event, listed = entry.get("event"), entry.get("partitions")
        if event not in ("partitions_assigned", "partitions_revoked") or not isinstance(listed, list):
            continue  # partitions_paused and _resumed log a count
        parts = {p for p in listed if isinstance(p, str) and p.startswith(topic + ":")}
        current = parts if event == "partitions_assigned" else current - parts
    return current


async def _wait_exit(run: _Run, worker: _Worker, out) -> int:
    """The worker's exit code once it has drained; SIGKILL (fate "hung") if it outlives its drain deadline."""
    deadline = time.monotonic() + DRAIN_DEADLINE_S + 30
    while worker.process.poll() is None and time.monotonic() < deadline:
        await anyio.sleep(0.2)
    if worker.process.poll() is None:
        worker.process.kill()
        worker.process.wait()
        worker.fate = "hung"
        run.note(f"{worker.name} did not exit {DRAIN_DEADLINE_S + 30}s after SIGTERM: SIGKILLed", out)
    return worker.process.returncode


async def _until_answered(run: _Run, count: int) -> None:
    while len(run.answered()) < count:
        _assert_alive(run)
        await anyio.sleep(0.1)


def _spawn(run: _Run, out) -> None:
    options, kafka = run.options, run.kafka
    index = len(run.workers)
    name = f"worker-{index}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEV_") or k == "KEV_CACHE_DIR"}
    env.update({
        "KEV_LOGGING__JSON": "true",
        "KEV_AGGREGATOR__TIMEOUT_MS": "3600000",  # a backlog must not turn answers into timeouts mid-drill
        "KEV_CORE__THREADS": "1", "KEV_METRICS__PORT": "0", "PYTHONUNBUFFERED": "1",
        # With faults, a redelivered question is answered twice: deterministic mode makes the two bitwise equal.
        # Without, default mode: that run measures throughput.
        "KEV_ISOLATION__DETERMINISTIC": "true" if options.faults else "false",
        "KEV_KAFKA__GROUP_ID": kafka.group_id, "KEV_KAFKA__PARTITIONS": str(kafka.partitions),
        "KEV_KAFKA__COMMIT_INTERVAL_MS": str(kafka.commit_interval_ms), "KEV_KAFKA_SESSION_TIMEOUT_MS": "3000",
        "KEV_KV_CACHE__NUM_BLOCKS": "512", **options.worker_env,
    })
    cores = sorted(os.sched_getaffinity(0))
    cpus = {cores[index % len(cores)]} if options.pin else None  # one core each, as KEV_CORE__THREADS=1 uses
    log_path = options.workdir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "kev_async.cli", "serve", "--model", options.model,
             "--bootstrap-servers", kafka.bootstrap_servers, "--drain-deadline", str(DRAIN_DEADLINE_S)],
            env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    run.workers.append(_Worker(name, process, log_path))
    run.note(f"started {name} (pid {process.pid}{f', cpus {cpus}' if cpus else ''})", out)


def _assert_alive(run: _Run) -> None:
    for worker in run.workers:
        if worker.fate == "running" and worker.process.poll() is not None:
            raise RuntimeError(f"{worker.name} exited {worker.process.returncode} on its own:\n{worker.log()[-3000:]}")


async def _publish_over_time(run: _Run, out) -> None:
    options = run.options
    producer = AIOKafkaProducer(bootstrap_servers=run.kafka.bootstrap_servers, acks="all", enable_idempotence=False)
    await producer.start()
    try:
        gap = options.spread_s / max(1, options.questions)
        chooser = random.Random(0)  # random, not cyclic: a cycle would line up with round_robin's own cycle
        begin = time.monotonic()
        for i in range(options.questions):
            qid = f"drill-{i:04d}"
            system = chooser.choice(options.system_prompts) if options.system_prompts else None
            question = QuestionEvent(question_id=qid, prompt=QUESTIONS[i % len(QUESTIONS)], system=system,
                                     params=Params(max_new_tokens=options.max_new_tokens, temperature=0.0))
            topic = run.kafka.intake_topic if options.route else run.kafka.questions_topic
            meta = await producer.send_and_wait(topic, encode(question), key=qid.encode())
            run.sent[qid] = (meta.partition, meta.offset)
            await anyio.sleep(max(0.0, begin + (i + 1) * gap - time.monotonic()))
        run.note(f"published {options.questions} questions over {time.monotonic() - begin:.1f}s", out)
    finally:
        await producer.stop()


async def _read_answers(run: _Run, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    consumer = AIOKafkaConsumer(run.kafka.answers_topic, bootstrap_servers=run.kafka.bootstrap_servers,
                                group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    task_status.started()
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            for records in batch.values():
                run.answers += [(decode_answer(record.value), record) for record in records]
    finally:
        with anyio.CancelScope(shield=True):
            await consumer.stop()


async def _until_committed(run: _Run, timeout: float) -> bool:
    ends = {}
    for partition, offset in run.sent.values():
        ends[partition] = max(ends.get(partition, 0), offset + 1)
    with anyio.move_on_after(timeout):
        while True:
            committed = await _committed(run.kafka)
            if all((committed.get(p) or 0) >= end for p, end in ends.items()):
                return True
            await anyio.sleep(0.5)
    return False


async def _positions(kafka: KafkaConfig, count: int) -> dict[str, tuple[int, int]]:
    """question_id (the record key) -> (partition, offset) of every question on the questions topic."""
    consumer = AIOKafkaConsumer(kafka.questions_topic, bootstrap_servers=kafka.bootstrap_servers, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    positions = {}
    try:
        with anyio.move_on_after(30):
            while len(positions) < count:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    positions.update({r.key.decode(): (r.partition, r.offset) for r in records})
    finally:
        await consumer.stop()
    return positions


async def _committed(kafka: KafkaConfig) -> dict[int, int | None]:
    from aiokafka import TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=kafka.group_id,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        return {p: await consumer.committed(TopicPartition(kafka.questions_topic, p)) for p in range(kafka.partitions)}
    finally:
        await consumer.stop()


def result_json(result: DrillResult) -> bytes:
    return msgspec.json.format(msgspec.json.encode(result), indent=2)
