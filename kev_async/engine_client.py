"""Request/reply over the engine actor: `await client.ask(question, timeout)` submits a question and
waits for its answer, routed back by question_id to the task that asked. Cancels and defaults go to
the actor's control mailbox when the client has one, so they never wait behind questions."""

from __future__ import annotations

from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kev_async.engine_messages import Cancel, Submit, UpdateDefaults
from kev_async.runtime.actors import Mailbox, NoReply, Reply, ask
from schemas import AnswerDelta, AnswerEvent, QuestionEvent

log = structlog.get_logger("kev.engine_actor")  # the actor's lines, whichever of its modules writes them


class EngineClient:
    """Request/reply over the engine actor. It sends questions into the actor's inbox, cancels and control
    commands into its control mailbox (`control`; without one, the inbox), and reads its outbox."""

    def __init__(self, inbox: MemoryObjectSendStream, outbox: MemoryObjectReceiveStream, *,
                 control: MemoryObjectSendStream | None = None, cancel_timeout: float = 1.0,
                 mailboxes: tuple[Mailbox, ...] = ()) -> None:
        self._inbox, self._outbox = inbox, outbox
        self._control = inbox if control is None else control
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
        await self._control.send(Cancel(question_id))

    async def update_defaults(self, timeout: float | None = None, **changes: Any) -> int:
        return await ask(self._control, UpdateDefaults(changes), timeout)

    async def aclose(self) -> None:
        """Stop asking: the actor answers what it has taken, then ends (a control mailbox still takes cancels)."""
        await self._inbox.aclose()

    async def _cancel_shielded(self, question_id: str) -> None:
        # The asker is leaving (maybe cancelled); the engine must still hear of it, or the question
        # keeps its KV blocks until it finishes on its own.
        with anyio.move_on_after(self.cancel_timeout, shield=True) as scope:
            await self.cancel(question_id)
        if scope.cancelled_caught:
            log.warning("engine_client.cancel_not_sent", question_id=question_id)
