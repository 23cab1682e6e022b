"""The device thread: the one thread that owns the device and the EngineCore.

Between two steps it applies the commands the event loop queued (add, withdraw, cancel, a call), then
runs the next step when one is due; each step's events go back to the event loop in one call
(`deliver`). Nothing else touches the core while the thread runs, so no command ever races a step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import sniffio
import structlog

from engine.core import EngineCore
from engine.intake import QuestionRejected
from engine.kernels.omp_pool import release_thread_pool
from engine.output.answers import rejected_answers
from engine.output.handle import Handle
from engine.output.processor import StepEvents
from schemas import QuestionEvent

_STOP = object()
CLOSED = ("engine_closed", "the engine closed before this question started")  # why a question never started
log = structlog.get_logger("kev.engine")


@dataclass(eq=False)
class DeviceCall:
    """A function to run on the device thread between two steps, and its outcome for the caller."""

    fn: object
    args: tuple
    done: anyio.Event = field(default_factory=anyio.Event)
    value: object = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except Exception as exc:  # handed to the caller, who awaits it; the step loop goes on
            self.error = exc

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


class DeviceThread:
    """Runs `core`'s steps and the commands queued for it (`put`, `call`, `stop`) on the thread that calls
    `run`. `handles`: the engine's questions in flight (read: a cancel may be on its way behind an add);
    `deliver`: hands a step's events to the event loop without waiting for it."""

    def __init__(self, core: EngineCore, handles: dict[str, Handle], deliver: Callable[[StepEvents], None]):
        self.core = core
        self.handles = handles
        self.deliver = deliver
        self._commands: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, verb: str, arg) -> None:
        """Queue a command: ("add", (question, prompt_ids, arrival, published, principal)),
        ("withdraw", (question, arrival)) or ("cancel", question_id)."""
        self._commands.put((verb, arg))

    async def call(self, fn, *args):
        """Run `fn(*args)` on the device thread between two steps and return its result."""
        call = DeviceCall(fn, args)
        self._commands.put(("call", call))
        await call.done.wait()
        return call.result()

    def stop(self) -> None:
        """End `run` once the commands queued before this one are applied."""
        self._commands.put(_STOP)

    def run(self) -> None:
        core = self.core
        while True:
            if not self._drain_commands(block_for=core.wait_time() if core.has_work else None):
                break
            if core.has_work and not core.wait_time():
                self.deliver(core.step())
        for qid in list(self.handles):  # closing: whatever is left ends as cancelled
            core.cancel(qid)
        self.deliver(core.step())
        core.constraints.close()
        self._refuse_queued_calls()
        release_thread_pool()  # this thread goes back to anyio's pool: its workers would slow the next engine's

    def _drain_commands(self, block_for: float | None) -> bool:
        """Apply every queued command, blocking up to `block_for` seconds (None = until one comes)."""
        try:
            first = self._commands.get(timeout=block_for) if block_for != 0 else self._commands.get_nowait()
        except queue.Empty:
            return True
        for command in itertools.chain([first], self._queued()):
            if command is _STOP:
                return False
            self._apply(*command)
        return True

    def _queued(self):
        """The commands queued now, taken one by one without waiting."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _refuse_queued_calls(self) -> None:
        """Calls queued behind the stop would otherwise wait forever."""
        for command in self._queued():
            if command is _STOP:
                continue
            if command[0] == "call":
                command[1].error = RuntimeError("the engine closed before this call ran")
                anyio.from_thread.run_sync(command[1].done.set)
            elif command[0] in ("add", "withdraw"):  # its submitter is waiting for an answer: give it one
                closed = rejected_answers(command[1][0], QuestionRejected(*CLOSED))
                self.deliver(StepEvents(answers=closed))

    def _apply(self, verb: str, arg) -> None:
        if verb == "cancel":
            self.core.cancel(arg)
            return
        if verb == "withdraw":
            self._withdraw(*arg)
            return
        if verb == "call":
            arg.run()
            anyio.from_thread.run_sync(arg.done.set)
            return
        question, prompt_ids, arrival, published, principal = arg
        try:
            self.core.add(question, prompt_ids, arrival=arrival, published=published, principal=principal)
            handle = self.handles.get(question.question_id)
            if handle is not None and handle.cancelling:  # a cancel on its way behind it: apply it now
                self.core.cancel(question.question_id)
        except QuestionRejected as exc:
            self.deliver(StepEvents(answers=rejected_answers(question, exc)))
        except Exception as exc:  # noqa: BLE001 - one question's failure is its own: the device thread goes on
            log.exception("engine.add_failed", question_id=question.question_id)
            failed = QuestionRejected("internal_error", f"the question could not be queued: {type(exc).__name__}")
            self.deliver(StepEvents(answers=rejected_answers(question, failed)))

    def _withdraw(self, question: QuestionEvent, arrival: float) -> None:
        try:
            self.core.withdraw(question, arrival)
        except Exception as exc:  # noqa: BLE001 - as in _apply: its answer says so, the device thread goes on
            log.exception("engine.withdraw_failed", question_id=question.question_id)
            failed = QuestionRejected("internal_error", f"the question could not be ended: {type(exc).__name__}")
            self.deliver(StepEvents(answers=rejected_answers(question, failed)))


def loop_poster():
    """The running event loop's thread-safe "call this soon", for the device thread (asyncio or trio)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    return asyncio.get_running_loop().call_soon_threadsafe
