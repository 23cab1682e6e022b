"""Actors on anyio: bounded mailboxes you can measure, and request/reply with `ask`.

An actor is an async function given its inbox (a receive stream) and the outboxes it sends to:

    async def stage(inbox, outbox, *, task_status=anyio.TASK_STATUS_IGNORED):
        task_status.started()                 # ready: `await tg.start(stage, ...)` returns
        async for message in inbox:
            await outbox.send(work(message))  # a full outbox makes this wait: backpressure
        await outbox.aclose()                 # upstream ended, so pass the end downstream

An actor that may be restarted by a supervisor leaves its streams open when it crashes, so its
senders and receivers survive the restart; it closes its outbox only when its inbox has ended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


@dataclass(frozen=True)
class MailboxStats:
    """One reading of a mailbox, for the depth gauges."""

    name: str
    depth: int  # messages sent and not yet received
    capacity: int
    senders_waiting: int  # tasks blocked on a full mailbox: backpressure in action
    receivers_waiting: int  # tasks idle on an empty one
    open_senders: int
    open_receivers: int


class Mailbox(Generic[T]):
    """A named, bounded memory object stream. `send` and `receive` are its two (original) ends.

    Wiring code clones an end per extra producer or consumer and closes the originals it does not
    hand out; `stats()` keeps working after any end is closed.
    """

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = _bounded(name, capacity)
        self.send: MemoryObjectSendStream[T]
        self.receive: MemoryObjectReceiveStream[T]
        self.send, self.receive = anyio.create_memory_object_stream[T](self.capacity)

    def stats(self) -> MailboxStats:
        s = self.send.statistics()
        return MailboxStats(self.name, s.current_buffer_used, self.capacity, s.tasks_waiting_send,
                            s.tasks_waiting_receive, s.open_send_streams, s.open_receive_streams)

    def __repr__(self) -> str:
        return f"Mailbox({self.name!r}, capacity={self.capacity})"


def _bounded(name: str, capacity: Any) -> int:
    # An unbounded mailbox hides overload until memory runs out; the sender should wait instead.
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity == math.inf or capacity < 0:
        raise ValueError(f"mailbox {name!r} needs a whole-number capacity >= 0, not {capacity!r}")
    return capacity


class NoReply(Exception):
    """The actor ended (or dropped the request) without replying."""


class Reply(Generic[T]):
    """A one-shot answer slot: the actor fills it once, the asker waits for it."""

    def __init__(self) -> None:
        self._filled = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._filled.is_set()

    def set(self, value: T) -> None:
        if not self.done:  # a late second answer is ignored: the asker took the first
            self._value = value
            self._filled.set()

    def fail(self, error: BaseException) -> None:
        """Make the asker raise `error` instead of getting a value."""
        if not self.done:
            self._error = error
            self._filled.set()

    async def wait(self) -> T:
        await self._filled.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


@dataclass(frozen=True)
class Request:
    """An envelope for request/reply: the actor answers with `request.reply_to.set(value)`."""

    body: Any
    reply_to: Reply = field(default_factory=Reply)


async def ask(inbox: MemoryObjectSendStream, body: Any, timeout: float | None = None) -> Any:
    """Send `Request(body)` to an actor's inbox and wait for its reply.

    The timeout covers both waiting for room in the inbox and waiting for the reply; past it
    `TimeoutError` is raised. An actor that cannot handle the body fails the reply, and that
    error is raised here.
    """
    request = Request(body)
    with anyio.fail_after(timeout):
        await inbox.send(request)
        return await request.reply_to.wait()
