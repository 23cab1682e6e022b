"""The scheduler actor: the only way async code reaches the engine. One per device.

Questions go in as `Submit` messages (or any envelope with a `.question`, such as the Kafka side's
`consumers.Inbound`); answers come out of the outbox in completion order, preceded by their
`AnswerDelta`s when the question asked to stream, each wrapped with its source if `wrap` is given
(`wrap=consumers.Outbound` answers the Kafka worker in its own terms). The engine steps on its own
worker thread (engine.Engine), so the event loop never waits on a forward. Closing the inbox is
the graceful stop: every question already taken is answered, then the outbox is closed.

Cancels and control commands come in their own mailbox, `control`, read by a task of their own: a
cancel reaches the engine at once even while the question inbox waits for a place (backpressure)
or is full, and the engine applies it at its next step. Each question taken is prepared in its own
task (kev_async/engine_handler.py), so one question's tokenizing or grammar compile holds up no other.

    questions, answers = Mailbox("engine.in", 64), Mailbox("engine.out", 64)
    control = Mailbox("engine.control", 64)
    await tg.start(partial(engine_actor, questions.receive, answers.send, control=control.receive,
                           engine_factory=make_engine))

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
                       engine_factory: Callable[[], Engine], control: MemoryObjectReceiveStream | None = None,
                       max_in_flight: int | None = None,
                       wrap: Callable[[AnswerEvent | AnswerDelta, Any], Any] | None = None,
                       state: ControlState | None = None,
                       task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Own one Engine: take questions from `inbox` and Cancel / Request(UpdateDefaults) / LoadAdapter /
    UnloadAdapter messages (the last two plainly or as a Request) from `control`, send answers out.
    Without `control` (or besides it) the inbox takes control messages too, applied in its order: behind
    the questions before them, and not while it waits for a place.

    `wrap(event, source)` builds what goes into the outbox; without it the bare events go.
    At most `max_in_flight` questions (default: the channel pool, router.channel_pool_size) are taken and not
    yet answered (those still being prepared count); past that, and while the outbox is full, the actor stops
    reading its inbox, so backpressure reaches whoever feeds it. If the actor crashes (say the device
    thread fails), every question it had taken, prepared or not, gets an "engine_failed" error answer
    before the crash goes on to the supervisor, so no asker waits forever and no source offset is
    held back.

    `state` holds what control commands changed (adapters, defaults, command ids applied). Give the
    same ControlState to every start of the actor (one made next to its supervisor Child) and a
    restarted actor's new Engine gets it all back before it reads a message.
    """
    engine = engine_factory()
    state = ControlState() if state is None else state
    with _own_device(engine) as device:
        handler = MessageHandler(engine, outbox, max_in_flight or engine.options.max_in_flight, wrap, state)
        try:
            async with engine, anyio.create_task_group() as commands:
                await state.reapply(engine)
                log.info("engine_actor.ready", device=device, max_in_flight=handler.max_in_flight)
                if control is not None:
                    commands.start_soon(_read_control, control, handler)
                task_status.started()
                async with anyio.create_task_group() as questions:
                    async for message in inbox:
                        await handler.take(message, questions)
                    inbox.close()  # it has ended; the task group now waits for every taken question's answer
                commands.cancel_scope.cancel()  # every question is answered: no cancel has anything left to end
        except Exception:
            await handler.answer_abandoned()
            raise
    await outbox.aclose()
    pool = engine.core.pool  # every question has ended: all blocks should be free again (the drill checks)
    log.info("engine_actor.stopped", device=device, kv_blocks_free=pool.num_free, kv_blocks_total=pool.num_blocks)


async def _read_control(control: MemoryObjectReceiveStream, handler: MessageHandler) -> None:
    """Until the actor stops (or every sender of `control` has closed its end). The stream stays open for
    the actor's next start when the supervisor restarts it."""
    async for message in control:
        await handler.command(message)


@asynccontextmanager
async def open_engine_client(engine_factory: Callable[[], Engine], *, capacity: int = 64,
                             max_in_flight: int | None = None) -> AsyncIterator[EngineClient]:
    """An engine actor and its client, running until the block ends (then drained gracefully)."""
    questions, answers = Mailbox("engine.questions", capacity), Mailbox("engine.answers", capacity)
    control = Mailbox("engine.control", capacity)
    # Closing is idempotent: this only tidies up ends left open when something failed.
    with questions.send, questions.receive, control.send, control.receive, answers.send, answers.receive:
        async with anyio.create_task_group() as tg:
            await tg.start(partial(engine_actor, questions.receive, answers.send, control=control.receive,
                                   engine_factory=engine_factory, max_in_flight=max_in_flight))
            client = EngineClient(questions.send, answers.receive, control=control.send,
                                  mailboxes=(questions, control, answers))
            await tg.start(client.run)
            try:
                yield client
            finally:
                await client.aclose()
