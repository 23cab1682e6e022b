"""What the engine actor does with each message: questions into the engine, their answers out to the
outbox, cancels, and control commands applied once each (kev_async/engine_actor.py runs it).

A question taken from the inbox gets its own task at once, which prepares it (engine.submit: tokenize,
compile its response_format under its principal's budget) and then forwards its answer; the inbox is
read on while earlier questions are prepared, so a plain question never waits behind another's grammar.
Taking still waits for one of `max_in_flight` places, which a question holds until its answer is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from engine import Engine
from kev_async.early_cancels import EarlyCancels
from kev_async.engine_messages import Cancel, LoadAdapter, Submit, UnloadAdapter, UpdateDefaults
from kev_async.engine_state import ControlState
from kev_async.runtime.actors import Reply, Request
from schemas import QuestionEvent, error_answer
from schemas.principal import ANONYMOUS, Principal

log = structlog.get_logger("kev.engine_actor")  # the actor's lines, whichever of its modules writes them
CONTROL = (Cancel, UpdateDefaults, LoadAdapter, UnloadAdapter)


@dataclass(eq=False)
class Taken:
    """A question the actor took: answered exactly once, by its own task or, if the actor crashes, by
    `answer_abandoned`."""

    question: QuestionEvent
    source: Any
    published_ms: int | None
    principal: Principal
    cancelled: bool = False  # a cancel came before the engine knew the question: it must still land
    sent: set[int] = field(default_factory=set)  # the samples (params.n) whose answer went to the outbox


def is_control(message: Any) -> bool:
    return isinstance(message.body if isinstance(message, Request) else message, CONTROL)


class MessageHandler:
    def __init__(self, engine: Engine, outbox: MemoryObjectSendStream, max_in_flight: int, wrap,
                 state: ControlState) -> None:
        self.engine, self.outbox, self.max_in_flight = engine, outbox, max_in_flight
        self.places = anyio.Semaphore(max_in_flight)
        self.taken: dict[Taken, None] = {}  # taken, answer not yet sent (a dict: ordered)
        self.wrap = wrap or (lambda event, _source: event)
        self.early_cancels = EarlyCancels()
        self.state = state
        self.applied = state.applied  # control command_id -> (succeeded, reply or error)

    async def take(self, message: Any, questions: TaskGroup) -> None:
        """A message from the question inbox: a question waits for a place, then goes to its own task in
        `questions`. A control message that came this way is applied in the inbox's order."""
        if is_control(message):
            await self.command(message)
            return
        match message:
            case Submit(question=question, source=source, published_ms=published_ms, principal=principal):
                taken = Taken(question, source, published_ms, principal)
            case object(question=QuestionEvent() as question):  # an envelope from another protocol
                taken = Taken(question, message, getattr(message, "published_ms", None),
                              getattr(message, "principal", ANONYMOUS))
            case _:
                log.error("engine_actor.unknown_message", message=repr(message)[:200])
                return
        self.taken[taken] = None  # out of the inbox: from here on it gets an answer, even if the actor crashes
        await self.places.acquire()
        taken.cancelled = self.early_cancels.take(question.question_id)
        if taken.cancelled:
            log.info("engine_actor.cancelled_on_arrival", question_id=question.question_id)
        questions.start_soon(self._answer, taken)

    async def command(self, message: Any) -> None:
        """A cancel or a control command (plainly or as a Request)."""
        command, reply_to = (message.body, message.reply_to) if isinstance(message, Request) else (message, None)
        if isinstance(command, (UpdateDefaults, LoadAdapter, UnloadAdapter)) and self._repeat(command, reply_to):
            return
        match command:
            case Cancel(question_id=question_id):
                self._cancel(question_id)
                if reply_to is not None:
                    reply_to.set(None)
            case UpdateDefaults() if reply_to is not None:
                self._update_defaults(command, reply_to)
            case LoadAdapter() | UnloadAdapter():
                await self._adapter_command(command, reply_to)
            case _:
                log.error("engine_actor.unknown_message", message=repr(message)[:200])

    async def answer_abandoned(self) -> None:
        """Every question taken and not yet answered (being prepared or computed) gets an "engine_failed"
        error answer. Best effort, shielded: the outbox itself may be what failed.

        Bounded by 10 s: an abandoned question left without an answer holds its Kafka offset back
        until the worker restarts and the question is delivered again, so it is worth waiting for a
        slow outbox, but not forever.
        """
        with anyio.move_on_after(10.0, shield=True):
            for taken in list(self.taken):
                question = taken.question
                failed = error_answer(question.question_id, question.request_id, "engine_failed",
                                      "the engine failed while answering; the question was not finished")
                try:
                    for index in range(question.params.n):  # each sample not answered yet
                        if index not in taken.sent:
                            await self.outbox.send(self.wrap(msgspec.structs.replace(failed, index=index),
                                                             taken.source))
                            taken.sent.add(index)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    break
                del self.taken[taken]
        if self.taken:
            log.error("engine_actor.abandoned_unanswered",
                      question_ids=sorted(taken.question.question_id for taken in self.taken))

    # -- questions ---------------------------------------------------------------------------------------
    async def _answer(self, taken: Taken) -> None:
        """Prepare one question (its own task: others are prepared meanwhile), then send its deltas (if it
        streams) and its answer; free its place after."""
        question = taken.question
        try:
            # Timings start when the question reached this worker, not when the engine got to it; its
            # deadline counts from when it was published. The engine tokenizes and compiles it off the
            # device thread.
            cancelled = taken.cancelled
            handle = await self.engine.submit(
                question, arrival=getattr(taken.source, "received_at", None), published_ms=taken.published_ms,
                cancelled=cancelled, principal=taken.principal)
            if taken.cancelled and not cancelled:  # the cancel came while engine.submit waited for a place
                self.engine.cancel(handle)
            log.debug("engine_actor.submitted", question_id=question.question_id)  # tokenized and queued
            if question.stream:
                async for delta in self.engine.stream(handle):
                    await self.outbox.send(self.wrap(delta, taken.source))
            for answer in await handle.wait_all():  # params.n: one answer per sample, sent together
                await self.outbox.send(self.wrap(answer, taken.source))
                taken.sent.add(answer.index)
            del self.taken[taken]
            self.early_cancels.answered(question.question_id)
        finally:
            self.places.release()

    def _cancel(self, question_id: str) -> None:
        """At once: the engine applies it at its next step (or stops preparing the question)."""
        if self.engine.holds(question_id):
            self.engine.cancel(question_id)
            return
        mine = [t for t in self.taken if t.question.question_id == question_id]
        for taken in mine:  # taken, and the engine does not know it yet (or it is answered already)
            taken.cancelled = True
        if not mine:  # not taken yet: cancel it when it comes
            self.early_cancels.remember(question_id)

    # -- control commands --------------------------------------------------------------------------------
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
