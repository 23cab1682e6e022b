"""The scheduler actor: the only way async code reaches the engine. One per device.

Questions go in as `Submit` messages (or any envelope with a `.question`, such as the Kafka side's
`consumers.Inbound`); answers come out of the outbox in completion order, preceded by their
`AnswerDelta`s when the question asked to stream, each wrapped with its source if `wrap` is given
(`wrap=consumers.Outbound` answers the Kafka worker in its own terms). The engine steps on its own
worker thread (engine.Engine), so the event loop never waits on a forward. Closing the inbox is
the graceful stop: every question already taken is answered, then the outbox is closed.

    questions, answers = Mailbox("engine.in", 64), Mailbox("engine.out", 64)
    await tg.start(partial(engine_actor, questions.receive, answers.send, engine_factory=make_engine))

This module is the actor's life (its device, start, drain, crash); what it does with each message
is kev_async/engine_handler.py, the messages are kev_async/engine_messages.py. `EngineClient`
(kev_async/engine_client.py) adds request/reply on top (`await client.ask(question, timeout)`);
`open_engine_client` wires actor and client at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine import Engine
from kev_async.engine_client import EngineClient
from kev_async.engine_handler import MessageHandler
from kev_async.engine_messages import Cancel, LoadAdapter, Submit, UnloadAdapter, UpdateDefaults
from kev_async.engine_state import ControlState
from kev_async.runtime.actors import Mailbox
from schemas import AnswerDelta, AnswerEvent

# The actor's face: its messages and its client are imported from here by those who drive it.
__all__ = ["Cancel", "DeviceBusy", "EngineClient", "LoadAdapter", "Submit", "UnloadAdapter", "UpdateDefaults",
           "engine_actor", "open_engine_client"]

log = structlog.get_logger("kev.engine_actor")


class DeviceBusy(RuntimeError):
    """A second scheduler actor for a device that already has one."""


_devices_in_use: set[str] = set()


@contextmanager
def _own_device(engine: Engine):
    where = engine.core.model.device
    device = f"{where.type}:{where.index or 0}"  # "cuda" and "cuda:0" are one device
    if device in _devices_in_use:
        raise DeviceBusy(f"device {device} already has a scheduler actor; run one per device")
    _devices_in_use.add(device)
    try:
        yield device
    finally:
        _devices_in_use.discard(device)


async def engine_actor(inbox: MemoryObjectReceiveStream, outbox: MemoryObjectSendStream, *,
                       engine_factory: Callable[[], Engine], max_in_flight: int | None = None,
                       wrap: Callable[[AnswerEvent | AnswerDelta, Any], Any] | None = None,
                       state: ControlState | None = None,
                       task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Own one Engine: take Submit / Cancel / Request(UpdateDefaults) / LoadAdapter / UnloadAdapter
    messages (the last two plainly or as a Request), send answers out.

    `wrap(event, source)` builds what goes into the outbox; without it the bare events go.
    At most `max_in_flight` questions (default: two full batches) are taken and not yet answered;
    past that, and while the outbox is full, the actor stops reading its inbox, so backpressure
    reaches whoever feeds it. If the actor crashes (say the device thread fails), every question it
    had taken gets an "engine_failed" error answer before the crash goes on to the supervisor, so
    no asker waits forever and no source offset is held back.

    `state` holds what control commands changed (adapters, defaults, command ids applied). Give the
    same ControlState to every start of the actor (one made next to its supervisor Child) and a
    restarted actor's new Engine gets it all back before it reads a message.
    """
    engine = engine_factory()
    state = ControlState() if state is None else state
    with _own_device(engine) as device:
        handler = MessageHandler(engine, outbox, max_in_flight or 2 * engine.options.max_batch_size, wrap, state)
        try:
            async with engine, anyio.create_task_group() as forwarders:
                await state.reapply(engine)
                log.info("engine_actor.ready", device=device, max_in_flight=handler.max_in_flight)
                task_status.started()
                async for message in inbox:
                    await handler.handle(message, forwarders)
                inbox.close()  # it has ended; the task group now waits for every taken question's answer
        except Exception:
            await handler.answer_abandoned()
            raise
    await outbox.aclose()
    pool = engine.core.pool  # every question has ended: all blocks should be free again (the drill checks)
    log.info("engine_actor.stopped", device=device, kv_blocks_free=pool.num_free, kv_blocks_total=pool.num_blocks)


@asynccontextmanager
async def open_engine_client(engine_factory: Callable[[], Engine], *, capacity: int = 64,
                             max_in_flight: int | None = None) -> AsyncIterator[EngineClient]:
    """An engine actor and its client, running until the block ends (then drained gracefully)."""
    questions, answers = Mailbox("engine.questions", capacity), Mailbox("engine.answers", capacity)
    # Closing is idempotent: this only tidies up ends left open when something failed.
    with questions.send, questions.receive, answers.send, answers.receive:
        async with anyio.create_task_group() as tg:
            await tg.start(partial(engine_actor, questions.receive, answers.send,
                                   engine_factory=engine_factory, max_in_flight=max_in_flight))
            client = EngineClient(questions.send, answers.receive, mailboxes=(questions, answers))
            await tg.start(client.run)
            try:
                yield client
            finally:
                await client.aclose()
