"""The drill's workers: `kev serve` processes in one consumer group on the drill's broker, each logging
JSON to its own file under the workdir, where the drill reads what each one did."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from schemas import KafkaConfig

DRAIN_DEADLINE_S = 120  # a SIGTERMed worker's `--drain-deadline`; the drill waits a little longer for its exit
SETTLE_TIMEOUT_S = 60.0  # how long a fault waits for the group to hold every partition again


@dataclass
class Worker:
    name: str
    process: subprocess.Popen
    log_path: Path
    fate: str = "running"  # running | killed | terminated | hung (outlived its drain deadline)

    def log(self) -> str:
        return self.log_path.read_text("utf-8", "replace")


class Workers:
    """The drill's `kev serve` processes in start order; `note` records what happens to them."""

    def __init__(self, options, kafka: KafkaConfig, note: Callable[[str], None]) -> None:
        self.options, self.kafka, self.note = options, kafka, note
        self.all: list[Worker] = []

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.all)

    def __getitem__(self, index: int) -> Worker:
        return self.all[index]

    def spawn(self) -> Worker:
        """One more `kev serve` in the group; its output goes to <workdir>/worker-N.log."""
        options, kafka = self.options, self.kafka
        index = len(self.all)
        name = f"worker-{index}"
        cores = sorted(os.sched_getaffinity(0))
        cpus = {cores[index % len(cores)]} if options.pin else None  # one core each, as KEV_CORE__THREADS=1 uses
        log_path = options.workdir / f"{name}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "kev_async.cli", "serve", "--model", options.model,
                 "--bootstrap-servers", kafka.bootstrap_servers, "--drain-deadline", str(DRAIN_DEADLINE_S)],
                env=_worker_env(options, kafka), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        worker = Worker(name, process, log_path)
        self.all.append(worker)
        self.note(f"started {name} (pid {process.pid}{f', cpus {cpus}' if cpus else ''})")
        return worker

    def assert_alive(self) -> None:
        """Raise if a worker the drill has not stopped exited on its own."""
        for worker in self.all:
            if worker.fate == "running" and worker.process.poll() is not None:
                raise RuntimeError(f"{worker.name} exited {worker.process.returncode} on its own:\n"
                                   f"{worker.log()[-3000:]}")

    async def wait_exit(self, worker: Worker) -> int:
        """The worker's exit code once it has drained; SIGKILL (fate "hung") if it outlives its drain deadline."""
        deadline = time.monotonic() + DRAIN_DEADLINE_S + 30
        while worker.process.poll() is None and time.monotonic() < deadline:
            await anyio.sleep(0.2)
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()
            worker.fate = "hung"
            self.note(f"{worker.name} did not exit {DRAIN_DEADLINE_S + 30}s after SIGTERM: SIGKILLed")
        return worker.process.returncode

    def kill_left_running(self) -> None:
        for worker in self.all:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()

    async def until_settled(self) -> None:
        """Until the running workers hold every partition between them, each some. One fault at a time: on
        the embedded Tansu a rebalance in which one member leaves while another joins can leave the whole
        group without assignments for good (consumers/worker.py), which no worker can mend."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not self._settled():
            self.assert_alive()
            if time.monotonic() > deadline:
                self.note(f"the group did not settle within {SETTLE_TIMEOUT_S:.0f}s; going on")
                return
            await anyio.sleep(0.2)

    def _settled(self) -> bool:
        held: set[str] = set()
        for worker in self.all:
            if worker.fate != "running":
                continue
            mine = assignment(worker.log(), self.kafka.questions_topic)
            if not mine:
                return False
            held |= mine
        return len(held) == self.kafka.partitions


def _worker_env(options, kafka: KafkaConfig) -> dict[str, str]:
    """This environment without KEV_* settings, plus the drill's."""
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
        "KEV_KV_CACHE__NUM_BLOCKS": "512",
        "KEV_KAFKA__DELIVERY": "exactly_once" if options.exactly_once else "at_least_once",
        **options.worker_env,
    })
    return env


def assignment(log: str, topic: str) -> set[str]:
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
