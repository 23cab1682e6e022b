"""deploy.mode multi: one parent keeps `deploy.workers` `kev serve` processes running on this host.

Each worker is a plain `kev serve` (deploy.mode single) in the same consumer group, so Kafka spreads
the partitions and moves a dead worker's partitions to the others; the parent adds only what one
host needs: a device or a share of the cores per worker, and restarts.

- GPUs: worker i sees one GPU through CUDA_VISIBLE_DEVICES (round robin over the visible ones), as
  `cuda` (a configured `cuda:N` becomes `cuda`); workers sharing a GPU split kv_cache.memory_fraction.
- CPU: the cores this process may use are split into `workers` contiguous shares; worker i gets
  torch threads = its share's size and, with deploy.pin_cpus, os.sched_setaffinity to that share.
- A worker that exits when the parent did not ask it to is restarted after restart_backoff_s, doubled
  for each fast crash in a row (one sooner than fast_crash_s after its start), up to 60 s. After
  max_fast_crashes fast crashes in a row the parent stops every worker and exits 1 with the reason.
- SIGINT/SIGTERM: every worker gets SIGTERM and drains (its questions answered and committed).
- kafka.bootstrap_servers "embedded": the parent starts the broker, so all workers share it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import msgspec
import structlog
import torch

from consumers import EMBEDDED, EmbeddedBroker, ensure_topics
from schemas import KevConfig

log = structlog.get_logger("kev.deploy")
MAX_BACKOFF_S = 60.0
POLL_S = 0.2
FRACTION_ENV = "KEV_KV_CACHE__MEMORY_FRACTION"


class CrashLoop(RuntimeError):
    """A worker kept dying right after it started: restarting it again would not help."""


@dataclass
class WorkerPlan:
    index: int
    env: dict[str, str]  # added to the parent's environment
    cpus: frozenset[int] | None  # sched_setaffinity set, or None (no pinning)


@dataclass
class _Slot:
    plan: WorkerPlan
    process: subprocess.Popen | None = None
    started: float = 0.0
    fast_crashes: int = 0
    restarts: int = 0
    next_start: float = 0.0
    history: list[int] = field(default_factory=list)  # exit codes


def plan_workers(cfg: KevConfig, gpus: list[str], cpus: list[int]) -> list[WorkerPlan]:
    """What each worker gets: its GPU, or its share of `cpus`, its metrics port, mode single."""
    n = cfg.deploy.workers
    plans = []
    for i in range(n):
        env = {"KEV_DEPLOY__MODE": "single", "KEV_DEPLOY__WORKERS": "1"}
        if cfg.metrics.port:
            env["KEV_METRICS__PORT"] = str(cfg.metrics.port + i)  # one host, one port each
        share = None
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            env.update(gpu_worker_settings(cfg, sharing=len(range(i % len(gpus), n, len(gpus)))))
        else:
            share = frozenset(cpu_share(cpus, i, n))
            if cfg.core.threads is None:
                env["KEV_CORE__THREADS"] = str(len(share))
        plans.append(WorkerPlan(i, env, share if share and cfg.deploy.pin_cpus else None))
    return plans


def worker_device(configured: str) -> str:
    """The core.device of a worker that sees one GPU through CUDA_VISIBLE_DEVICES: that GPU is its
    `cuda` (index 0), so a configured `cuda:N` (N counts the parent's GPUs) becomes `cuda`."""
    return "cuda" if configured.startswith("cuda:") else configured


def kv_memory_fraction(fraction: float, sharing: int) -> float:
    """Each worker's kv_cache.memory_fraction when `sharing` workers share one GPU: together they take
    what one would (each measures free memory at its own start, so the shares never add up to more)."""
    return fraction / sharing


def gpu_worker_settings(cfg: KevConfig, sharing: int) -> dict[str, str]:
    """The environment overrides of a worker pinned to one GPU that `sharing` workers use."""
    env = {}
    device = worker_device(cfg.core.device)
    if device != cfg.core.device:
        env["KEV_CORE__DEVICE"] = device
    # A byte budget or a block count is the operator's own figure per worker; only the fraction is shared.
    if sharing > 1 and cfg.kv_cache.num_blocks is None and cfg.kv_cache.memory_budget_bytes is None:
        env[FRACTION_ENV] = repr(kv_memory_fraction(cfg.kv_cache.memory_fraction, sharing))
    return env


def cpu_share(cpus: list[int], index: int, workers: int) -> list[int]:
    """Worker `index`'s contiguous share of `cpus`; with more workers than cores, one core each, shared."""
    cpus = sorted(cpus)
    if workers >= len(cpus):
        return [cpus[index % len(cpus)]]
    return cpus[index * len(cpus) // workers:(index + 1) * len(cpus) // workers]


def visible_gpus(device: str) -> list[str]:
    """GPU ids a worker may be pinned to: those CUDA_VISIBLE_DEVICES allows, else torch's count; none on CPU."""
    if device not in ("auto", "cuda") and not device.startswith("cuda"):
        return []
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (listed or [str(i) for i in range(count)])[:count] if count else []


async def run_multi(cfg: KevConfig, shutdown, *, serve_args: list[str], drain_deadline: float = 30.0,
                    task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Keep the workers running until shutdown; raise CrashLoop if one cannot stay up."""
    async with _shared_broker(cfg) as bootstrap:
        gpus = visible_gpus(cfg.core.device)
        plans = plan_workers(cfg, gpus, sorted(os.sched_getaffinity(0)))
        slots = [_Slot(plan) for plan in plans]
        argv = [sys.executable, "-m", "kev_async.cli", "serve", "--bootstrap-servers", bootstrap,
                "--drain-deadline", str(drain_deadline), *serve_args]
        log.info("deploy.multi", workers=len(slots), gpus=gpus or None, bootstrap_servers=bootstrap,
                 cpus=[sorted(p.cpus) if p.cpus else None for p in plans])
        log_gpu_settings(cfg, plans)
        try:
            for slot in slots:
                _start(slot, argv)
            task_status.started([slot.process.pid for slot in slots])
            while not shutdown.requested.is_set():
                _supervise(cfg, slots, argv)
                with anyio.move_on_after(POLL_S):
                    await shutdown.requested.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await _stop_all(slots, drain_deadline + 10)


def log_gpu_settings(cfg: KevConfig, plans: list[WorkerPlan]) -> None:
    """One line each for what the workers run with other than the config says (a device, a KV share)."""
    device = plans[0].env.get("KEV_CORE__DEVICE") if plans else None
    if device:
        log.info("deploy.worker_device", configured=cfg.core.device, used=device,
                 reason="each worker sees its one GPU through CUDA_VISIBLE_DEVICES, as cuda:0")
    fractions = [float(p.env[FRACTION_ENV]) for p in plans if FRACTION_ENV in p.env]
    if fractions:
        log.info("deploy.kv_memory_shared", configured=cfg.kv_cache.memory_fraction,
                 per_worker=sorted(set(fractions)), reason="several workers share a GPU")


def _start(slot: _Slot, argv: list[str]) -> None:
    cpus = slot.plan.cpus
    slot.process = subprocess.Popen(argv, env={**os.environ, **slot.plan.env}, stdin=subprocess.DEVNULL,
                                    preexec_fn=lambda: _child_setup(cpus))
    slot.started = time.monotonic()
    log.info("deploy.worker_started", worker=slot.plan.index, pid=slot.process.pid, restarts=slot.restarts,
             cpus=sorted(cpus) if cpus else None, gpu=slot.plan.env.get("CUDA_VISIBLE_DEVICES"))


def _supervise(cfg: KevConfig, slots: list[_Slot], argv: list[str]) -> None:
    now = time.monotonic()
    for slot in slots:
        if slot.process is None:  # waiting out its backoff
            if now >= slot.next_start:
                slot.restarts += 1
                _start(slot, argv)
            continue
        code = slot.process.poll()
        if code is None:
            continue
        uptime = now - slot.started
        slot.history.append(code)
        slot.process = None
        slot.fast_crashes = slot.fast_crashes + 1 if uptime < cfg.deploy.fast_crash_s else 0
        if slot.fast_crashes >= cfg.deploy.max_fast_crashes:
            message = (f"worker {slot.plan.index} exited {slot.fast_crashes} times in a row within "
                       f"{cfg.deploy.fast_crash_s:g}s of starting (exit codes {slot.history[-slot.fast_crashes:]}); "
                       f"giving up: its log above says why")
            log.error("deploy.crash_loop", worker=slot.plan.index, exit_codes=slot.history[-slot.fast_crashes:])
            raise CrashLoop(message)
        backoff = min(MAX_BACKOFF_S, cfg.deploy.restart_backoff_s * 2 ** max(0, slot.fast_crashes - 1))
        slot.next_start = now + backoff
        log.warning("deploy.worker_exited", worker=slot.plan.index, exit_code=code, uptime_s=round(uptime, 1),
                    restart_in_s=backoff, fast_crashes=slot.fast_crashes)


async def _stop_all(slots: list[_Slot], timeout: float) -> None:
    running = [slot.process for slot in slots if slot.process is not None and slot.process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        await anyio.sleep(POLL_S)
    for process in running:
        if process.poll() is None:
            log.error("deploy.worker_killed", pid=process.pid, reason=f"still draining after {timeout:g}s")
            process.kill()
            process.wait()
    log.info("deploy.stopped", exit_codes=[p.returncode for p in running])


@contextlib.asynccontextmanager
async def _shared_broker(cfg: KevConfig) -> AsyncIterator[str]:
    """The bootstrap servers workers use: the configured ones, or a broker this parent embeds."""
    if cfg.kafka.bootstrap_servers != EMBEDDED:
        yield cfg.kafka.bootstrap_servers
        return
    async with EmbeddedBroker.from_config(cfg.broker) as broker:
        await ensure_topics(msgspec.structs.replace(cfg.kafka, bootstrap_servers=broker.bootstrap_servers))
        yield broker.bootstrap_servers


def _child_setup(cpus: frozenset[int] | None) -> None:
    """In the child before exec: die with the parent; keep to its cores."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: an orphaned worker drains and exits
    if cpus:
        os.sched_setaffinity(0, cpus)


def _find_prctl():
    try:
        return ctypes.CDLL(None).prctl if sys.platform == "linux" else None
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()
