"""`kev gateway --processes N` (gateway.processes): N whole gateways accepting on one listening socket.

One gateway serves all its requests from one event loop, so at high concurrency a request's latency
includes the loop's CPU for every request queued ahead of it (~0.4 ms each at 64 concurrent). N
processes split that queue; each is a whole gateway, with its own producer, reply topic and catalog.

    running = await tg.start(partial(run_gateway_processes, cfg, shutdown))
    print(running.url, [child.pid for child in running.children])

The parent listens and starts the children (`python -m kev_async.gateway.processes`), each with the
listening socket inherited and the resolved config on its stdin, then accepts nothing itself: the
kernel gives each new connection to whichever child accepts first, and a keep-alive connection stays
with its child. So /metrics and /health describe the child that accepted the connection.

Stopping: the parent's first SIGINT/SIGTERM becomes one SIGTERM per child, and each drains as a lone
gateway does. The children run in their own session, so a terminal's Ctrl-C reaches the parent only
(a second signal would make a child skip its drain). A child that exits by itself stops the others and
the parent fails with ChildExited. A child whose parent is gone sees its stdin close and stops.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus

from kev_async.gateway.server import GRACEFUL_TIMEOUT_S, listen, socket_url
from schemas import KevConfig

log = structlog.get_logger("kev.gateway.processes")

LISTEN_FD_ENV = "KEV_GATEWAY_LISTEN_FD"
START_TIMEOUT_S = 60.0  # a child imports, connects to the brokers and makes its reply topic in a few seconds


@dataclass(frozen=True)
class Child:
    pid: int
    reply_topic: str


@dataclass(frozen=True)
class GatewayProcesses:
    url: str
    model: str
    children: tuple[Child, ...]


class ChildExited(RuntimeError):
    """A gateway process stopped while the others were serving."""


class _Ready(msgspec.Struct, frozen=True):
    """What a child tells its parent on stdout once it serves."""

    pid: int
    reply_topic: str
    model: str


async def run_gateway_processes(cfg: KevConfig, shutdown: Any, *,
                                task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve with cfg.gateway.processes children until `shutdown.requested`; ChildExited if one stops early."""
    sock = listen(cfg.gateway.host, cfg.gateway.port)
    exits: list[str] = []
    try:
        async with anyio.create_task_group() as tg:
            children = []
            for index in range(cfg.gateway.processes):
                children.append(await tg.start(_supervise, cfg, sock, index, shutdown, exits))
            url = socket_url(sock)
            log.info("gateway.ready", url=url, processes=len(children), pids=[c.pid for c in children],
                     reply_topics=[c.reply_topic for c in children])
            sock.close()  # the children hold it; the parent must not look like a listener that never accepts
            task_status.started(GatewayProcesses(url, children[0].model,
                                                 tuple(Child(c.pid, c.reply_topic) for c in children)))
    finally:
        sock.close()
    if exits:
        raise ChildExited("; ".join(exits))


async def _supervise(cfg: KevConfig, sock: socket.socket, index: int, shutdown: Any, exits: list[str], *,
                     task_status: TaskStatus) -> None:
    """Start child `index`, report it ready, then SIGTERM it at shutdown or stop all if it exits first."""
    process = await anyio.open_process(
        [sys.executable, "-m", "kev_async.gateway.processes"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=None, pass_fds=(sock.fileno(),), env={**os.environ, LISTEN_FD_ENV: str(sock.fileno())},
        start_new_session=True)
    try:
        await process.stdin.send(msgspec.json.encode(cfg) + b"\n")  # stdin stays open: its end is the parent's end
        ready = await _ready_line(process, index)
        task_status.started(ready)
        async with anyio.create_task_group() as tg:
            async def terminate_at_shutdown() -> None:
                await shutdown.requested.wait()
                process.send_signal(signal.SIGTERM)

            tg.start_soon(terminate_at_shutdown)
            code = await process.wait()
            tg.cancel_scope.cancel()
        if not shutdown.requested.is_set():
            exits.append(f"gateway process {index} (pid {process.pid}) exited with {code}")
            log.error("gateway.process_exited", index=index, pid=process.pid, exit_code=code)
            shutdown.request(f"gateway process {index} exited")
    finally:
        with anyio.move_on_after(GRACEFUL_TIMEOUT_S + 5, shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            await process.wait()
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()


async def _ready_line(process, index: int) -> _Ready:
    line = b""
    with anyio.fail_after(START_TIMEOUT_S):
        async for chunk in process.stdout:
            line += chunk
            if b"\n" in line:
                return msgspec.json.decode(line.split(b"\n", 1)[0], type=_Ready)
    code = await process.wait()
    raise ChildExited(f"gateway process {index} exited with {code} before it served")


def main() -> int:
    """A child: the config from stdin, the socket from the inherited descriptor, then one gateway."""
    from kev_async.gateway.server import has_uvloop
    from kev_async.logs import configure_logging
    from kev_async.runtime.lifecycle import run_service

    cfg = msgspec.json.decode(sys.stdin.buffer.readline(), type=KevConfig)
    sock = socket.socket(fileno=int(os.environ.pop(LISTEN_FD_ENV)))
    configure_logging(cfg.logging.level, cfg.logging.json)
    return anyio.run(partial(run_service, partial(_serve_child, cfg, sock), drain_deadline=10.0),
                     backend="asyncio", backend_options={"use_uvloop": has_uvloop()})


async def _serve_child(cfg: KevConfig, sock: socket.socket, shutdown: Any, *,
                       task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    from kev_async.gateway.server import run_gateway

    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_when_orphaned, shutdown)
        running = await tg.start(partial(run_gateway, cfg, shutdown, sock=sock))
        sys.stdout.buffer.write(msgspec.json.encode(_Ready(os.getpid(), running.reply_topic, running.model)) + b"\n")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nobody reads the pipe past that line: it must not fill
        task_status.started()


async def _stop_when_orphaned(shutdown: Any) -> None:
    """The parent holds our stdin open; end of file means it is gone, and nobody would stop us."""
    stdin = sys.stdin.fileno()
    with shutdown.intake():
        while True:
            await anyio.wait_readable(stdin)
            if not os.read(stdin, 4096):
                shutdown.request("the gateway's parent process exited")
                return


if __name__ == "__main__":
    raise SystemExit(main())
