"""`kev gateway` and `kev serve` as child processes of `kev bench gateway`, as deployed, and the CPU a
process and its children have used (the gateway's CPU per request)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import asynccontextmanager

import anyio
import httpx
import torch

from kev_async.gateway.exposure import trust_env
from kev_async.gateway.metrics import process_of


async def run_gateway_process(cfg, processes: int, shutdown, *, task_status) -> None:
    """`kev gateway` as a child process on a free port; started once /metrics answers, stopped with SIGTERM.
    With processes > 1 it is the parent of that many gateway processes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {"KEV_GATEWAY__SERVED_MODEL_NAME": "bench", **trust_env(cfg)}
    argv = ["gateway", "--bootstrap-servers", cfg.kafka.bootstrap_servers, "--port", str(port),
            "--processes", str(processes)]
    async with _kev_process(argv, env) as process:
        seen: set[str | None] = set()  # gateway processes that answered: ready once all have
        with anyio.fail_after(60):
            while len(seen) < processes:
                if process.returncode is not None:
                    raise RuntimeError(f"`kev gateway` exited with {process.returncode} before it was ready")
                try:
                    async with httpx.AsyncClient() as client:  # a new connection each time: any process may take it
                        scraped = await client.get(f"{url}/metrics")  # it names the process that answered
                    if scraped.status_code == 200:
                        seen.add(process_of(scraped.text))
                        continue
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.2)
        task_status.started((url, process.pid))
        await shutdown.requested.wait()


async def run_worker_process(cfg, model, shutdown, *, task_status) -> None:
    """`kev serve` as a child process with the bench's model, threads and router limit; stopped with SIGTERM.

    Started at once: the warm-up round waits while it loads the model and joins the consumer group.
    """
    env = {"KEV_CORE__MODEL_PATH": str(model.path), "KEV_CORE__THREADS": str(torch.get_num_threads()),
           "KEV_ROUTER__MAX_PARALLEL_QUERIES": str(cfg.router.max_parallel_queries), "KEV_METRICS__PORT": "0",
           # the embedded broker holds a fetch for its whole wait, so the bench's broker came with a short one
           "KEV_KAFKA__FETCH_MAX_WAIT_MS": str(cfg.kafka.fetch_max_wait_ms), **trust_env(cfg)}
    async with _kev_process(["serve", "--bootstrap-servers", cfg.kafka.bootstrap_servers], env) as process:
        task_status.started()
        async with anyio.create_task_group() as tg:
            async def exited() -> None:
                await process.wait()
                if not shutdown.requested.is_set():
                    raise RuntimeError(f"`kev serve` exited with {process.returncode} during the bench")

            tg.start_soon(exited)
            await shutdown.requested.wait()
            tg.cancel_scope.cancel()


@asynccontextmanager
async def _kev_process(argv: list[str], env: dict[str, str]):
    """`python -m kev_async.cli <argv>` with warnings-only logs; SIGTERM (then SIGKILL after 15 s) on the way out."""
    env = {**os.environ, "KEV_LOGGING__LEVEL": "warning", **env}
    process = await anyio.open_process([sys.executable, "-m", "kev_async.cli", *argv], env=env,
                                       stdout=subprocess.DEVNULL, stderr=None)
    try:
        yield process
    finally:
        with anyio.move_on_after(15, shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            await process.wait()
        if process.returncode is None:
            process.kill()


def cpu_seconds(pid: int) -> float:
    """CPU a process, its threads and its child processes (`--processes N`) have used, in seconds."""
    return _own_cpu_seconds(pid) + sum(cpu_seconds(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                children += [int(child) for child in listed.read().split()]
        except (OSError, ValueError):
            pass
    return children


def _own_cpu_seconds(pid: int) -> float:
    """CPU a process's threads have used, in seconds: nanoseconds from /proc/<pid>/task/*/schedstat, else
    /proc/<pid>/stat's 10 ms ticks; 0 off Linux (the CPU column then reads 0)."""
    try:
        total_ns = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as schedstat:
                total_ns += int(schedstat.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
