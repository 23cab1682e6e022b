"""Start a service, and stop it gracefully on SIGINT/SIGTERM.

    async def serve(shutdown: Shutdown, *, task_status):
        ...start the actors...
        task_status.started()                 # ready
        with shutdown.intake():               # cancelled at the first signal: stop taking work
            await consume_forever()
        await drain_in_flight()               # then finish what was taken, and return

    exit_code = anyio.run(partial(run_service, serve, drain_deadline=30, final=commit_offsets))

First signal: intake stops and the service has `drain_deadline` seconds to finish in-flight work
(past it, the service is cancelled). Then `final` (flush, commit) runs shielded under its own
`final_timeout`, even when the service was cancelled; `run_service` returns 0.
Second signal: the process exits at once with 128 + the signal number (130 for SIGINT, 143 for
SIGTERM, as shells report), skipping the drain and the final step; at-least-once delivery makes that
safe, since whatever was not committed is delivered again.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

import anyio
import structlog
from anyio.abc import TaskStatus

log = structlog.get_logger("kev.lifecycle")

DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Shutdown:
    """What a service sees of shutdown: `requested` is set once, and every intake scope is cancelled."""

    def __init__(self, drain_deadline: float) -> None:
        self.drain_deadline = drain_deadline
        self.requested = anyio.Event()
        self.reason: str | None = None
        self.drain_scope = anyio.CancelScope()  # around the service; gets its deadline at the request
        self._intakes: list[anyio.CancelScope] = []

    def intake(self) -> anyio.CancelScope:
        """A scope for the code that takes new work; it is cancelled when shutdown is requested."""
        scope = anyio.CancelScope()
        if self.requested.is_set():
            scope.cancel()
        else:
            self._intakes.append(scope)
        return scope

    def request(self, reason: str) -> None:
        """Begin a graceful shutdown (the first signal calls this; a service may too)."""
        if self.requested.is_set():
            return
        self.reason = reason
        self.requested.set()
        self.drain_scope.deadline = anyio.current_time() + self.drain_deadline
        for scope in self._intakes:
            scope.cancel()
        log.warning("shutdown.requested", reason=reason, drain_deadline_s=self.drain_deadline)


def exit_now(code: int) -> None:
    """The second signal's way out: flush what was logged, then leave without unwinding."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def run_service(
    serve: Callable[..., Awaitable[None]],
    *,
    drain_deadline: float = 30.0,
    final: Callable[[], Awaitable[None]] | None = None,
    final_timeout: float = 10.0,
    signals: Sequence[signal.Signals] = DEFAULT_SIGNALS,
    force_exit: Callable[[int], None] = exit_now,
    task_status: TaskStatus = anyio.TASK_STATUS_IGNORED,
) -> int:
    """Run `serve(shutdown, task_status=...)` until it returns; see the module docstring. Returns 0.

    Must run in the main thread (signal handlers live there). An error from `serve` propagates
    (wrapped in an ExceptionGroup, as task groups do) after the final step has run.
    """
    shutdown = Shutdown(drain_deadline)
    async with anyio.create_task_group() as tg:
        await tg.start(_watch_signals, shutdown, signals, force_exit)
        try:
            with shutdown.drain_scope:
                await serve(shutdown, task_status=task_status)
        finally:
            _report_drain(shutdown)
            await _final_step(final, final_timeout)
            tg.cancel_scope.cancel()  # done: stop listening for signals
    return 0


async def _watch_signals(shutdown: Shutdown, signals: Sequence[signal.Signals],
                         force_exit: Callable[[int], None], *, task_status: TaskStatus) -> None:
    with anyio.open_signal_receiver(*signals) as received:
        task_status.started()
        async for signum in received:
            name = signal.Signals(signum).name
            if not shutdown.requested.is_set():
                shutdown.request(name)
            else:
                log.error("shutdown.forced", signal=name, exit_code=128 + signum)
                force_exit(128 + signum)


def _report_drain(shutdown: Shutdown) -> None:
    if shutdown.drain_scope.cancelled_caught:
        log.error("shutdown.drain_deadline_passed", drain_deadline_s=shutdown.drain_deadline)
    elif shutdown.requested.is_set():
        log.info("shutdown.drained", reason=shutdown.reason)


async def _final_step(final: Callable[[], Awaitable[None]] | None, timeout: float) -> None:
    """Flush and commit; shielded, so a cancelled service (deadline, outer cancel) still gets it."""
    if final is None:
        return
    with anyio.move_on_after(timeout, shield=True) as scope:
        await final()
    if scope.cancelled_caught:
        log.error("shutdown.final_step_timed_out", final_timeout_s=timeout)
    else:
        log.info("shutdown.final_step_done")
