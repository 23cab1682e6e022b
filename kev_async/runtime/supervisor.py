"""Supervision, one-for-one: a crashed child restarts alone; too many crashes escalate to the parent.

    supervisor = Supervisor("app", [Child("publisher", publisher, (results,)),
                                    Child("worker", worker, (jobs, results_out))])
    await tg.start(supervisor.run)   # returns once every child called task_status.started()

Children start in the order given, each ready before the next starts; `stop()` stops them in the
reverse order. A child is any `async def run(*args, task_status)`, a Supervisor's `run` included,
so supervisors nest: a child supervisor that gives up crashes, and its parent's policy decides.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import structlog
from anyio.abc import TaskStatus

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = structlog.get_logger("kev.supervisor")


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a child, and how often before giving up.

    restart: "transient" restarts after a crash only; "permanent" also after a normal return;
    "temporary" never (its crash is still logged). At most `max_restarts` within `within_s`
    seconds; the n-th recent restart waits `backoff_s * backoff_factor**n`, capped.
    """

    restart: Literal["permanent", "transient", "temporary"] = "transient"
    max_restarts: int = 3
    within_s: float = 5.0
    backoff_s: float = 0.05
    backoff_factor: float = 2.0
    max_backoff_s: float = 2.0

    def delay(self, recent_restarts: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * self.backoff_factor ** recent_restarts)


@dataclass(frozen=True)
class Child:
    name: str
    run: Callable[..., Awaitable[Any]]  # async def run(*args, task_status)
    args: tuple = ()
    policy: RestartPolicy = RestartPolicy()
    context: Mapping[str, Any] = field(default_factory=dict)  # bound into this child's log lines


class Escalated(Exception):
    """A child crashed more often than its policy allows; its supervisor gives up."""

    def __init__(self, supervisor: str, child: str, restarts: int, within_s: float) -> None:
        super().__init__(f"supervisor {supervisor!r} gave up on {child!r} after {restarts} restarts "
                         f"within {within_s}s")
        self.supervisor, self.child, self.restarts = supervisor, child, restarts


class _RestartWindow:
    """Restart times within the policy's window; says how long to back off, or None to give up."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        while self.times and now - self.times[0] > self.policy.within_s:
            self.times.popleft()
        if len(self.times) >= self.policy.max_restarts:
            return None
        delay = self.policy.delay(len(self.times))
        self.times.append(now)
        return delay


class ReadyOnce:
    """Hands the first `started()` on to the supervisor; restarts need not announce themselves again."""

    def __init__(self, task_status: TaskStatus) -> None:
        self._task_status = task_status
        self.ready = False

    def started(self, value: Any = None) -> None:
        if not self.ready:
            self.ready = True
            self._task_status.started(value)


@dataclass
class _Running:
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)
    restarts: int = 0


class Supervisor:
    def __init__(self, name: str, children: Sequence[Child]) -> None:
        self.name = name
        self.children = list(children)
        self._running: dict[str, _Running] = {}

    @property
    def restarts(self) -> dict[str, int]:
        return {name: running.restarts for name, running in self._running.items()}

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every child until each has ended for good; raise Escalated when one is past its limit."""
        try:
            async with anyio.create_task_group() as tg:
                for child in self.children:
                    await tg.start(self._supervise, child)
                log.info("supervisor.ready", supervisor=self.name, children=[c.name for c in self.children])
                task_status.started()
        except BaseExceptionGroup as group:
            escalated = _only(group, Escalated)
            if escalated is None:
                raise
            raise escalated  # keeps its cause: the child's last crash

    async def stop(self) -> None:
        """Cancel the children one by one, last started first, each ended before the next is told."""
        for child in reversed(self.children):
            running = self._running.get(child.name)
            if running is not None:
                running.scope.cancel()
                await running.ended.wait()

    async def _supervise(self, child: Child, *, task_status: TaskStatus) -> None:
        running = self._running[child.name] = _Running()
        ready, window = ReadyOnce(task_status), _RestartWindow(child.policy)
        try:
            with running.scope:
                while True:
                    crash = await self._run_once(child, ready)
                    if not _restarts_after(child.policy, crash):
                        return
                    await self._back_off(child, running, window, crash)
        finally:
            running.ended.set()

    async def _run_once(self, child: Child, ready: ReadyOnce) -> Exception | None:
        try:
            await child.run(*child.args, task_status=ready)
        except Exception as crash:  # noqa: BLE001 - logged here, then restarted or escalated
            log.error("actor.crashed", supervisor=self.name, actor=child.name, error=repr(crash),
                      exc_info=crash, **child.context)
            return crash
        log.info("actor.exited", supervisor=self.name, actor=child.name, **child.context)
        return None

    async def _back_off(self, child: Child, running: _Running, window: _RestartWindow,
                        crash: Exception | None) -> None:
        delay = window.next_delay(anyio.current_time())
        if delay is None:
            log.error("actor.gave_up", supervisor=self.name, actor=child.name, restarts=running.restarts,
                      within_s=child.policy.within_s, **child.context)
            raise Escalated(self.name, child.name, running.restarts, child.policy.within_s) from crash
        running.restarts += 1
        log.warning("actor.restarting", supervisor=self.name, actor=child.name, restart=running.restarts,
                    delay_s=round(delay, 4), **child.context)
        await anyio.sleep(delay)


def _restarts_after(policy: RestartPolicy, crash: Exception | None) -> bool:
    if policy.restart == "temporary":
        return False
    return crash is not None or policy.restart == "permanent"


def _only(group: BaseExceptionGroup, kind: type[BaseException]) -> BaseException | None:
    """The first `kind` in the group if the group holds nothing else, else None."""
    matching, rest = group.split(kind)
    if matching is None or rest is not None:
        return None
    while isinstance(matching, BaseExceptionGroup):
        matching = matching.exceptions[0]
    return matching
