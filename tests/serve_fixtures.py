"""Helpers for the `kev serve` / `kev demo` tests: a tiny model directory, `kev` subprocesses (their
settings, their log lines, waiting for their partitions), an answers reader that runs in the background,
and raw requests to a worker's metrics endpoint.

Load with `pytest_plugins = ["kafka_fixtures", "serve_fixtures"]`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from kafka_fixtures import end_offsets
from polling import eventually

from consumers.broker.embedded import EMBEDDED_FETCH_WAIT_MS
from kev_async.drill.checks import log_events as parse_log_events
from schemas import DEFAULT_MODEL, AnswerEvent, KafkaConfig, decode_answer

ROOT = Path(__file__).resolve().parent.parent
KEV = Path(sys.executable).with_name("kev")  # the venv's console script
# Generous but bounded: a `kev` child imports torch and transformers (seconds on a loaded 2-core box),
# then joins its group (Tansu holds a new group about half a session timeout before assigning).
STARTUP_TIMEOUT = 90.0
# Against a broker it did not start, `serve` keeps aiokafka's 10 s session unless told otherwise; 3 s cuts
# Tansu's waits (first assignment, noticing a dead member) to a few seconds.
FAST_SESSION = {"KEV_KAFKA_SESSION_TIMEOUT_MS": "3000"}


def build_tiny_model_dir(path: Path) -> Path:
    """A random-weight Llama (SmolLM2's vocabulary and tokenizer, 2 layers of width 64) saved as safetensors."""
    import torch
    import transformers

    from engine.model.loader import resolve_model_dir

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from engine import load_model

    return load_model(tiny_model_dir, device="cpu", dtype="fp32")


# -- `kev` as a subprocess ---------------------------------------------------------------------------

def kev_env(**config: str) -> dict[str, str]:
    """The environment for a `kev` child: this one without KEV_* settings, plus `config` (KEV_... names)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEV_") or k == "KEV_CACHE_DIR"}
    env.update({"KEV_LOGGING__JSON": "true", "KEV_CORE__THREADS": "1", "KEV_METRICS__PORT": "0",
                "PYTHONUNBUFFERED": "1"})
    env.update(config)
    return env


def serve_env(k: KafkaConfig, **extra: str) -> dict[str, str]:
    """KEV_* settings for a `kev serve` child on KafkaConfig `k`'s topics and group (bootstrap by flag)."""
    return kev_env(KEV_KAFKA__GROUP_ID=k.group_id, KEV_KAFKA__QUESTIONS_TOPIC=k.questions_topic,
                   KEV_KAFKA__ANSWERS_TOPIC=k.answers_topic, KEV_KAFKA__DELTAS_TOPIC=k.deltas_topic,
                   KEV_KAFKA__DLQ_TOPIC=k.dlq_topic, KEV_KAFKA__CONTROL_TOPIC=k.control_topic,
                   KEV_KAFKA__PARTITIONS=str(k.partitions), KEV_KAFKA__COMMIT_INTERVAL_MS="200",
                   KEV_KV_CACHE__NUM_BLOCKS="512", **FAST_SESSION, **extra)


class KevProcess:
    """A `kev` child process whose output goes to a log file (read it with `.log()`)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.process = subprocess.Popen([str(KEV), *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text("utf-8", "replace")

    def running(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.returncode is not None:
                self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self._log.close()

    def describe(self, chars: int = 4000) -> str:
        return f"kev {' '.join(self.args)} (pid {self.pid}, rc {self.process.poll()}):\n{self.log()[-chars:]}"


@contextlib.contextmanager
def kev_processes() -> Iterator[list[KevProcess]]:
    """Children appended to the yielded list are SIGKILLed on the way out, whatever happened."""
    children: list[KevProcess] = []
    try:
        yield children
    finally:
        for child in children:
            child.kill()


def says(process: KevProcess, text: str) -> bool:
    """Whether the child's output holds `text` yet; fails at once if the child has exited."""
    assert process.running(), process.describe()
    return text in process.log()


def log_events(process: KevProcess, event: str) -> list[dict]:
    """The child's JSON log lines whose event is `event`."""
    return parse_log_events(process.log(), event)


async def wait_log(process: KevProcess, event: str, timeout: float) -> list[dict]:
    """Until the child has logged `event` (its lines with it); fails at once if the child exits first."""
    def logged() -> list[dict]:
        assert process.running(), f"exited before {event!r}: {process.describe()}"
        return log_events(process, event)

    return await eventually(logged, timeout=timeout, every=0.1, what=lambda: f"{event!r} in {process.describe()}")


async def wait_assigned(children: Iterable[KevProcess], timeout: float = STARTUP_TIMEOUT) -> None:
    """Until every child holds partitions: each has logged an assignment, and its latest one is not empty
    (a rebalance, as the next child joins, may have taken them all back)."""
    for child in children:
        await wait_log(child, "partitions_assigned", timeout)
    await eventually(lambda: all(_assigned_now(child) for child in children), timeout=timeout, every=0.1)


def _assigned_now(process: KevProcess) -> bool:
    assigned = log_events(process, "partitions_assigned")
    return bool(assigned and assigned[-1].get("partitions"))


# -- reading answers as they arrive --------------------------------------------------------------------

class AnswerReader:
    """Reads a topic from the start in the background (no group); `answers` grows as records arrive."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.records: list = []
        self.answers: list[AnswerEvent] = []
        self.positions: dict[TopicPartition, int] = {}  # the next offset to read, per partition
        self._changed = anyio.Event()

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        # Tansu holds every fetch for the whole wait: with aiokafka's 500 ms default, answers would arrive
        # in half-second bursts and "answered before X" would mean "before the last burst".
        consumer = AIOKafkaConsumer(self.topic, bootstrap_servers=self.bootstrap, group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False,
                                    fetch_max_wait_ms=EMBEDDED_FETCH_WAIT_MS)
        await consumer.start()
        task_status.started()
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=100)
                for records in batch.values():
                    for record in records:
                        self.records.append(record)
                        self.answers.append(decode_answer(record.value))
                self.positions = {tp: await consumer.position(tp) for tp in consumer.assignment()}
                if batch:
                    self._changed.set()
                    self._changed = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.stop()

    def question_ids(self) -> set[str]:
        return {answer.question_id for answer in self.answers}

    async def wait_for(self, question_ids, timeout: float, what: str = "answers") -> None:
        """Until every id in `question_ids` has an answer; fails with the ones missing."""
        wanted = set(question_ids)
        with anyio.move_on_after(timeout):
            while not wanted <= self.question_ids():
                await self._changed.wait()
        missing = wanted - self.question_ids()
        assert not missing, f"no {what} after {timeout}s for {len(missing)}: {sorted(missing)[:10]}"

    async def caught_up(self, timeout: float = 20.0) -> None:
        """Until the reader has passed every record the topic holds now: an answer already acked is in
        `answers` (a positive signal that nothing more is there, where a pause would only hope so)."""
        await eventually(lambda: self.positions, timeout=timeout, what=f"an assignment of {self.topic}")
        ends = await end_offsets(self.bootstrap, list(self.positions))
        await eventually(lambda: all(self.positions[tp] >= end for tp, end in ends.items()), timeout=timeout,
                         what=lambda: f"read {self.topic} up to {ends}: at {self.positions}")

    async def wait_count(self, count: int, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            while len(self.question_ids()) < count:
                await self._changed.wait()
        assert len(self.question_ids()) >= count, f"{len(self.question_ids())} answered after {timeout}s"


# -- a worker's metrics endpoint -----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, dict[str, str], str]:
    """(status, headers by lower-case name, body) of one raw HTTP/1.0 request: the endpoint closes the
    connection after it."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"{method} {path} HTTP/1.0\r\nHost: test\r\n\r\n".encode())
        raw = b""
        try:
            while True:
                raw += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, body.decode()
