"""`kev gateway --processes N` (gateway.processes): N whole gateways accepting on one port.

One gateway serves all its requests from one event loop, so at high concurrency a request's latency
includes the loop's CPU for every request queued ahead of it (~0.4 ms each at 64 concurrent). N
processes split that queue; each is a whole gateway, with its own producer, reply topic and catalog.

    running = await tg.start(partial(run_gateway_processes, cfg, shutdown))
    print(running.url, [child.pid for child in running.children])

The parent opens one listening socket per child on the port (SO_REUSEPORT on Linux, where the kernel
spreads new connections over them by address hash; elsewhere one shared socket) and starts the
children (`python -m kev_async.gateway.processes`), each with its socket inherited and the resolved
config on its stdin (the API keys file read once, by the parent, so every child knows the same keys);
the parent accepts nothing. The children share one SlotTable (slot_table.py), inherited like the
sockets, so a tenant's gateway.max_concurrent_per_tenant holds for all of them together. A keep-alive connection stays with its child, so
/metrics and /health describe the child that holds the connection (/health names its pid).

Stopping: the parent's first SIGINT/SIGTERM becomes one SIGTERM per child, and each drains as a lone
gateway does. The children run in their own session, so a terminal's Ctrl-C reaches the parent only
(a second signal would make a child skip its drain). A child that exits by itself, or fails its
drain, stops the others and the parent fails with ChildExited (`kev gateway` exits 1). A child whose
parent is gone sees its stdin close and stops.
"""

from __future__ import annotations

import contextlib
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

from kev_async.gateway.auth import Authenticator, read_keys_file
from kev_async.gateway.server import listen, run_gateway, run_until_stopped, socket_url
from kev_async.gateway.slot_table import SlotTable
from kev_async.logs import configure_logging
from schemas import KevConfig

log = structlog.get_logger("kev.gateway.processes")

LISTEN_FD_ENV = "KEV_GATEWAY_LISTEN_FD"
SLOTS_FD_ENV = "KEV_GATEWAY_SLOTS_FD"
RUNS_BATCHES_ENV = "KEV_GATEWAY_RUNS_BATCHES"  # "1" in the one child that asks the Batch API's lines
START_TIMEOUT_S = 60.0  # a child imports, connects to the brokers and makes its reply topic in a few seconds
CHILD_DRAIN_S = 10.0  # a child's own drain deadline, as `kev gateway`'s
# A child's whole stop: its drain, then the producer's flush and the reply topic's deletion (3 s).
CHILD_STOP_S = CHILD_DRAIN_S + 5.0
PARENT_DRAIN_S = CHILD_STOP_S + 2.0  # the parent outwaits its children's stops


class GatewayChild(msgspec.Struct, frozen=True):
    """One gateway process, as it tells its parent on stdout once it serves."""

    pid: int
    reply_topic: str
    model: str


@dataclass(frozen=True)
class GatewayProcesses:
    url: str
    children: tuple[GatewayChild, ...]


class ChildExited(RuntimeError):
    """A gateway process stopped while the others were serving."""


async def run_gateway_processes(cfg: KevConfig, shutdown: Any, *,
                                task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve with cfg.gateway.processes children until `shutdown.requested`; ChildExited if one stops early
    or fails its drain."""
    cfg = with_keys_read(cfg)
    table = SlotTable.create(Authenticator.from_config(cfg.gateway).tenants)
    sockets = listen_sockets(cfg.gateway.host, cfg.gateway.port, cfg.gateway.processes)
    url = socket_url(sockets[0])
    exits: list[str] = []
    try:
        async with anyio.create_task_group() as tg:
            children = []
            for index, sock in enumerate(sockets):
                if shutdown.requested.is_set():
                    break
                children.append(await tg.start(_supervise, cfg, sock, table, index, shutdown, exits))
                sock.close()  # the child holds it; a parent's copy would only outlive a dead child
            if children:
                log.info("gateway.ready", url=url, processes=len(children), pids=[c.pid for c in children],
                         reply_topics=[c.reply_topic for c in children])
                task_status.started(GatewayProcesses(url, tuple(children)))
    finally:
        for sock in sockets:
            sock.close()
        table.close()
    if exits:
        raise ChildExited("; ".join(exits))


def with_keys_read(cfg: KevConfig) -> KevConfig:
    """`cfg` with gateway.api_keys_file read into gateway.api_keys: the children must not each read a file
    that may change in between, or their tenants (and so their SlotTable) would differ."""
    keys = {**read_keys_file(cfg.gateway.api_keys_file), **cfg.gateway.api_keys}
    gateway = msgspec.structs.replace(cfg.gateway, api_keys=keys, api_keys_file=None)
    return msgspec.structs.replace(cfg, gateway=gateway)


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per child. On Linux each is its own SO_REUSEPORT socket on the one port, and
    the kernel spreads new connections over them by address hash (a shared socket goes to whichever
    child's loop wakes first, which under a burst can be one child for all). Elsewhere: one shared socket,
    a descriptor of it per child."""
    if not sys.platform.startswith("linux"):
        first = listen(host, port)
        return [first] + [first.dup() for _ in range(count - 1)]
    first = listen(host, port, reuse_port=True)
    try:
        return [first] + [listen(host, first.getsockname()[1], reuse_port=True) for _ in range(count - 1)]
    except OSError:
        first.close()
        raise


async def _supervise(cfg: KevConfig, sock: socket.socket, table: SlotTable, index: int, shutdown: Any,
                     exits: list[str], *, task_status: TaskStatus) -> None:
    """Start child `index`, report it ready, then SIGTERM it (once) at shutdown; an early exit stops all."""
    env = {**os.environ, LISTEN_FD_ENV: str(sock.fileno()), SLOTS_FD_ENV: str(table.fileno()),
           RUNS_BATCHES_ENV: "1" if index == 0 else "0"}
    process = await anyio.open_process(
        [sys.executable, "-m", "kev_async.gateway.processes"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=None, pass_fds=(sock.fileno(), table.fileno()), env=env, start_new_session=True)
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        if not terminated:  # a second SIGTERM would make the child skip its drain
            terminated = True
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)

    try:
        task_status.started(await _start(process, cfg, index))
        async with anyio.create_task_group() as tg:
            async def terminate_at_shutdown() -> None:
                await shutdown.requested.wait()
                terminate()

            tg.start_soon(terminate_at_shutdown)
            code = await process.wait()
            tg.cancel_scope.cancel()
        if not shutdown.requested.is_set():
            exits.append(f"gateway process {index} (pid {process.pid}) exited with {code}")
            log.error("gateway.process_exited", index=index, pid=process.pid, exit_code=code)
            shutdown.request(f"gateway process {index} exited")
        elif code != 0:  # a drain that failed, or a kill during it
            exits.append(f"gateway process {index} (pid {process.pid}) exited with {code} while stopping")
            log.error("gateway.process_stop_failed", index=index, pid=process.pid, exit_code=code)
    finally:
        with anyio.move_on_after(CHILD_STOP_S, shield=True):
            terminate()
            await process.wait()
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()


async def _start(process, cfg: KevConfig, index: int) -> GatewayChild:
    """Hand the child its config, then read its ready line; any failure is ChildExited, naming the child."""
    try:
        await process.stdin.send(msgspec.json.encode(cfg) + b"\n")  # stdin stays open: its end is the parent's end
        line = b""
        with anyio.fail_after(START_TIMEOUT_S):
            async for chunk in process.stdout:
                line += chunk
                if b"\n" in line:
                    return msgspec.json.decode(line.split(b"\n", 1)[0], type=GatewayChild)
    except TimeoutError:
        raise ChildExited(f"gateway process {index} did not serve within {START_TIMEOUT_S:g} s") from None
    except (anyio.BrokenResourceError, msgspec.DecodeError) as error:
        raise ChildExited(f"gateway process {index} failed to start ({type(error).__name__})") from None
    with anyio.move_on_after(5):
        await process.wait()
    raise ChildExited(f"gateway process {index} exited with {process.returncode} before it served")


def main() -> int:
    """A child: the config from stdin, the socket from the inherited descriptor, then one gateway."""
    cfg = msgspec.json.decode(sys.stdin.buffer.readline(), type=KevConfig)
    sock = socket.socket(fileno=int(os.environ.pop(LISTEN_FD_ENV)))
    table = SlotTable(int(os.environ.pop(SLOTS_FD_ENV)), Authenticator.from_config(cfg.gateway).tenants)
    configure_logging(cfg.logging.level, cfg.logging.json)
    return run_until_stopped(partial(_serve_child, cfg, sock, table), CHILD_DRAIN_S,
                             f"kev gateway process {os.getpid()}")


async def _serve_child(cfg: KevConfig, sock: socket.socket, table: SlotTable, shutdown: Any, *,
                       task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_when_orphaned, shutdown)
        runs_batches = os.environ.pop(RUNS_BATCHES_ENV, "1") == "1"
        running = await tg.start(partial(run_gateway, cfg, shutdown, sock=sock, slot_table=table,
                                         runs_batches=runs_batches))
        ready = GatewayChild(os.getpid(), running.reply_topic, running.model)
        sys.stdout.buffer.write(msgspec.json.encode(ready) + b"\n")
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
