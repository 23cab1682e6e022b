"""The scheduler actor: the only way async code reaches the engine. One per device.

Questions go in as `Submit` messages (or any envelope with a `.question`, such as the Kafka side's
`consumers.Inbound`); answers come out of the outbox in completion order, preceded by their
`AnswerDelta`s when the question asked to stream, each wrapped with its source if `wrap` is given
(`wrap=consumers.Outbound` answers the Kafka worker in its own terms). The engine steps on its own
worker thread (engine.Engine), so the event loop never waits on a forward. Closing the inbox is
the graceful stop: every question already taken is answered, then the outbox is closed.

    questions, answers = Mailbox("engine.in", 64), Mailbox("engine.out", 64)
    await tg.start(partial(engine_actor, questions.receive, answers.send, engine_factory=make_engine))

`EngineClient` adds request/reply on top (`await client.ask(question, timeout)`), routing each
answer by question_id to the task that asked; `open_engine_client` wires actor and client at once.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine import Engine, Handle
from kev_async.early_cancels import EarlyCancels
from kev_async.engine_state import ControlState
from kev_async.runtime.actors import Mailbox, NoReply, Reply, Request, ask
from schemas import AnswerDelta, AnswerEvent, QuestionEvent, error_answer

log = structlog.get_logger("kev.engine_actor")


@dataclass(frozen=True)
class Submit:
    question: QuestionEvent
    source: Any = None  # handed back with the answer when the actor has a `wrap`
    published_ms: int | None = None  # when it was published (ms since the epoch): its deadline counts from it


@dataclass(frozen=True)
class Cancel:
    """End a question now (finish_reason "cancelled"); its KV blocks return to the pool that step."""

    question_id: str


@dataclass(frozen=True)
class UpdateDefaults:
    """New sampling defaults for questions admitted from now on; send with `ask`, reply = the version."""

    changes: Mapping[str, Any] = field(default_factory=dict)
    command_id: int | None = None  # see LoadAdapter


@dataclass(frozen=True)
class LoadAdapter:
    """Load (or replace: a new version) a PEFT LoRA adapter; questions taken after it may name it.

    Applied between two steps, and awaited before the actor reads its next message, so a question
    behind it in the inbox sees it. Send it plainly (a failure is logged) or with `ask` (reply = the
    engine's LoraAdapter, or the error raised)."""

    name: str
    path: str | os.PathLike
    # The kev.control record's offset. An engine applies each id once: a replay of the topic (the control
    # actor restarted) gets the first outcome again instead of loading a new version.
    command_id: int | None = None


@dataclass(frozen=True)
class UnloadAdapter:
    """New questions naming the adapter get `unknown_adapter`; those in flight finish with it.
    Plainly or with `ask` (reply = None, or the error: KeyError for a name that is not loaded)."""

    name: str
    command_id: int | None = None  # see LoadAdapter


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
        actor = _SchedulerActor(engine, outbox, max_in_flight or 2 * engine.options.max_batch_size, wrap, state)
        try:
            async with engine, anyio.create_task_group() as forwarders:
                await state.reapply(engine)
                log.info("engine_actor.ready", device=device, max_in_flight=actor.max_in_flight)
                task_status.started()
                async for message in inbox:
                    await actor.handle(message, forwarders)
                inbox.close()  # it has ended; the task group now waits for every taken question's answer
        except Exception:
            await actor.answer_abandoned()
            raise
    await outbox.aclose()
    pool = engine.core.pool  # every question has ended: all blocks should be free again (the drill checks)
    log.info("engine_actor.stopped", device=device, kv_blocks_free=pool.num_free, kv_blocks_total=pool.num_blocks)


class _SchedulerActor:
    def __init__(self, engine: Engine, outbox: MemoryObjectSendStream, max_in_flight: int, wrap,
                 state: ControlState) -> None:
        self.engine, self.outbox, self.max_in_flight = engine, outbox, max_in_flight
        self.places = anyio.Semaphore(max_in_flight)
        self.in_flight: dict[Handle, Any] = {}  # taken, answer not yet sent -> its source
        self.wrap = wrap or (lambda event, _source: event)
        self.early_cancels = EarlyCancels()
        self.state = state
        self.applied = state.applied  # control command_id -> (succeeded, reply or error)

    async def handle(self, message: Any, forwarders) -> None:
        command, reply_to = (message.body, message.reply_to) if isinstance(message, Request) else (message, None)
        if isinstance(command, (UpdateDefaults, LoadAdapter, UnloadAdapter)) and self._repeat(command, reply_to):
            return
        match message:
            case Submit(question=question, source=source, published_ms=published_ms):
                await self._submit(question, source, forwarders, published_ms)
            case object(question=QuestionEvent() as question):  # an envelope from another protocol
                await self._submit(question, message, forwarders, getattr(message, "published_ms", None))
            case Cancel(question_id=question_id):
                self._cancel(question_id)
            case Request(body=UpdateDefaults() as command, reply_to=reply_to):
                self._update_defaults(command, reply_to)
            case LoadAdapter() | UnloadAdapter():
                await self._adapter_command(message, None)
            case Request(body=LoadAdapter() | UnloadAdapter() as command, reply_to=reply_to):
                await self._adapter_command(command, reply_to)
            case _:
                log.error("engine_actor.unknown_message", message=repr(message)[:200])

    async def _submit(self, question: QuestionEvent, source: Any, forwarders, published_ms: int | None) -> None:
        await self.places.acquire()
        # Timings start when the question reached this worker, not when the engine got to it; its
        # deadline counts from when it was published. The engine tokenizes it off the device thread.
        cancelled = self.early_cancels.take(question.question_id)
        if cancelled:
            log.info("engine_actor.cancelled_on_arrival", question_id=question.question_id)
        handle = await self.engine.submit(question, arrival=getattr(source, "received_at", None),
                                          published_ms=published_ms, cancelled=cancelled)
        self.in_flight[handle] = source
        forwarders.start_soon(self._forward, handle)

    def _cancel(self, question_id: str) -> None:
        if self.engine.holds(question_id):
            self.engine.cancel(question_id)
        else:
            self.early_cancels.remember(question_id)

    def _update_defaults(self, command: UpdateDefaults, reply_to: Reply) -> None:
        try:
            version = self.engine.update_defaults(**command.changes)
        except (TypeError, ValueError) as bad_change:  # the asker's mistake: it gets the error
            self._remember(command, False, bad_change)
            reply_to.fail(bad_change)
            return
        self._remember(command, True, version)
        self.state.defaults_updated(self.engine.defaults)
        reply_to.set(version)

    def _repeat(self, command, reply_to: Reply | None) -> bool:
        """A control command this engine has applied already: reply as the first time, apply nothing."""
        if command.command_id is None or command.command_id not in self.applied:
            return False
        succeeded, outcome = self.applied[command.command_id]
        log.info("engine_actor.command_replayed", command=type(command).__name__, command_id=command.command_id)
        if reply_to is not None:
            reply_to.set(outcome) if succeeded else reply_to.fail(outcome)
        return True

    def _remember(self, command, succeeded: bool, outcome: Any) -> None:
        if command.command_id is not None:
            self.applied[command.command_id] = (succeeded, outcome)

    async def _adapter_command(self, command: LoadAdapter | UnloadAdapter, reply_to: Reply | None) -> None:
        """Load or unload now; a failure (bad files, unknown name, engine closed) never ends the actor."""
        try:
            if isinstance(command, LoadAdapter):
                result = await self.engine.load_adapter(command.name, command.path)
            else:
                result = await self.engine.unload_adapter(command.name)
        except Exception as error:  # noqa: BLE001 - the sender's mistake, not the actor's: log, reply
            # A KeyError's str is just the quoted key; say what it means.
            reason = f"adapter {command.name!r} is not loaded" if isinstance(error, KeyError) else str(error)
            log.warning("engine_actor.adapter_failed", command=type(command).__name__, adapter=command.name,
                        error=reason, error_type=type(error).__name__)
            self._remember(command, False, error)
            if reply_to is not None:
                reply_to.fail(error)
            return
        self._remember(command, True, result)
        if isinstance(command, LoadAdapter):
            self.state.adapter_loaded(command.name, result.path, result.version)
        else:
            self.state.adapter_unloaded(command.name)
        if reply_to is not None:
            reply_to.set(result)

    async def _forward(self, handle: Handle) -> None:
        """Send one question's deltas (if it streams) and then its answer; free its place after."""
        source = self.in_flight[handle]
        try:
            if handle.question.stream:
                async for delta in self.engine.stream(handle):
                    await self.outbox.send(self.wrap(delta, source))
            await self.outbox.send(self.wrap(await self.engine.wait(handle), source))
            del self.in_flight[handle]
            self.early_cancels.answered(handle.question_id)
        finally:
            self.places.release()

    async def answer_abandoned(self) -> None:
        """Best effort, shielded: the outbox itself may be what failed.

        Bounded by 10 s: an abandoned question left without an answer holds its Kafka offset back
        until the worker restarts and the question is delivered again, so it is worth waiting for a
        slow outbox, but not forever.
        """
        with anyio.move_on_after(10.0, shield=True):
            for handle, source in list(self.in_flight.items()):
                question = handle.question
                failed = error_answer(question.question_id, question.request_id, "engine_failed",
                                      "the engine failed while answering; the question was not finished")
                try:
                    await self.outbox.send(self.wrap(failed, source))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    break
                del self.in_flight[handle]
        if self.in_flight:
            log.error("engine_actor.abandoned_unanswered", question_ids=sorted(h.question_id for h in self.in_flight))


class EngineClient:
    """Request/reply over the engine actor. It sends into the actor's inbox and reads its outbox."""

    def __init__(self, inbox: MemoryObjectSendStream, outbox: MemoryObjectReceiveStream, *,
                 cancel_timeout: float = 1.0, mailboxes: tuple[Mailbox, ...] = ()) -> None:
        self._inbox, self._outbox = inbox, outbox
        self.mailboxes = mailboxes  # for the depth gauges
        self._waiting: dict[str, Reply[AnswerEvent]] = {}
        self.cancel_timeout = cancel_timeout

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Route every answer to the task that asked for it, until the actor closes its outbox."""
        task_status.started()
        async with self._outbox:
            async for event in self._outbox:
                self._route(event)
        for reply in self._waiting.values():
            reply.fail(NoReply("the engine actor stopped before answering"))

    def _route(self, event: AnswerEvent | AnswerDelta) -> None:
        if isinstance(event, AnswerDelta):
            return  # ask() wants the whole answer; streaming consumers read the outbox directly
        reply = self._waiting.get(event.question_id)
        if reply is None:  # its asker gave up (timeout, cancel) before the answer came
            log.debug("engine_client.unclaimed_answer", question_id=event.question_id)
        else:
            reply.set(event)

    async def ask(self, question: QuestionEvent, timeout: float | None = None) -> AnswerEvent:
        """Submit `question` and wait for its answer. On timeout (TimeoutError) or cancellation the
        question is cancelled in the engine too, so its KV blocks are freed."""
        question_id = question.question_id
        if question_id in self._waiting:
            raise ValueError(f"question {question_id!r} is already being asked")
        reply = self._waiting[question_id] = Reply()
        submitted = False
        try:
            with anyio.fail_after(timeout):
                await self._inbox.send(Submit(question))
                submitted = True
                return await reply.wait()
        finally:
            del self._waiting[question_id]
            if submitted and not reply.done:
                await self._cancel_shielded(question_id)

    async def cancel(self, question_id: str) -> None:
        await self._inbox.send(Cancel(question_id))

    async def update_defaults(self, timeout: float | None = None, **changes: Any) -> int:
        return await ask(self._inbox, UpdateDefaults(changes), timeout)

    async def aclose(self) -> None:
        """Stop asking: the actor answers what it has taken, then ends."""
        await self._inbox.aclose()

    async def _cancel_shielded(self, question_id: str) -> None:
        # The asker is leaving (maybe cancelled); the engine must still hear of it, or the question
        # keeps its KV blocks until it finishes on its own.
        with anyio.move_on_after(self.cancel_timeout, shield=True) as scope:
            await self.cancel(question_id)
        if scope.cancelled_caught:
            log.warning("engine_client.cancel_not_sent", question_id=question_id)


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
