"""What the engine actor does with each message: questions into the engine, their answers out to the
outbox, cancels, and control commands applied once each (kev_async/engine_actor.py runs it)."""

from __future__ import annotations

from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from engine import Engine, Handle
from kev_async.early_cancels import EarlyCancels
from kev_async.engine_messages import Cancel, LoadAdapter, Submit, UnloadAdapter, UpdateDefaults
from kev_async.engine_state import ControlState
from kev_async.runtime.actors import Reply, Request
from schemas import QuestionEvent, error_answer

log = structlog.get_logger("kev.engine_actor")  # the actor's lines, whichever of its modules writes them


class MessageHandler:
    def __init__(self, engine: Engine, outbox: MemoryObjectSendStream, max_in_flight: int, wrap,
                 state: ControlState) -> None:
        self.engine, self.outbox, self.max_in_flight = engine, outbox, max_in_flight
        self.places = anyio.Semaphore(max_in_flight)
        self.in_flight: dict[Handle, Any] = {}  # taken, answer not yet sent -> its source
        self.wrap = wrap or (lambda event, _source: event)
        self.early_cancels = EarlyCancels()
        self.state = state
        self.applied = state.applied  # control command_id -> (succeeded, reply or error)

    async def handle(self, message: Any, forwarders: TaskGroup) -> None:
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

    async def answer_abandoned(self) -> None:
        """Every question taken and not yet answered gets an "engine_failed" error answer. Best effort,
        shielded: the outbox itself may be what failed.

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

    # -- questions ---------------------------------------------------------------------------------------
    async def _submit(self, question: QuestionEvent, source: Any, forwarders: TaskGroup,
                      published_ms: int | None) -> None:
        await self.places.acquire()
        # Timings start when the question reached this worker, not when the engine got to it; its
        # deadline counts from when it was published. The engine tokenizes it off the device thread.
        cancelled = self.early_cancels.take(question.question_id)
        if cancelled:
            log.info("engine_actor.cancelled_on_arrival", question_id=question.question_id)
        handle = await self.engine.submit(question, arrival=getattr(source, "received_at", None),
                                          published_ms=published_ms, cancelled=cancelled)
        log.debug("engine_actor.submitted", question_id=question.question_id)  # tokenized and queued
        self.in_flight[handle] = source
        forwarders.start_soon(self._forward, handle)

    def _cancel(self, question_id: str) -> None:
        if self.engine.holds(question_id):
            self.engine.cancel(question_id)
        else:
            self.early_cancels.remember(question_id)

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
