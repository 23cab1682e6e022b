"""Engine: the long-lived, async face of EngineCore (anyio, so asyncio and trio both work).

The step loop runs on one worker thread that owns the device; async callers only ever wait on events,
never on a forward. Commands go in through a thread-safe queue; each step's results come back to the
event loop in one call.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import anyio.to_thread

from engine.core import EngineCore, QuestionRejected, StepEvents, rejected_answer
from engine.adapters import LoraAdapter
from engine.options import EngineOptions
from engine.prompt import as_question
from schemas import AnswerDelta, AnswerEvent, QuestionEvent

_STOP = object()


@dataclass(eq=False)
class Handle:
    """A submitted question: its streamed deltas so far and, once it ends, its answer."""

    question: QuestionEvent
    deltas: list[AnswerDelta] = field(default_factory=list)
    answer: AnswerEvent | None = None
    cancelling: bool = False  # a cancel is on its way; the answer (finish_reason "cancelled") follows
    _changed: anyio.Event = field(default_factory=anyio.Event)

    @property
    def question_id(self) -> str:
        return self.question.question_id

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


@dataclass(eq=False)
class _Call:
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


class Engine:
    """`async with Engine(model) as engine: h = await engine.submit(q); answer = await engine.wait(h)`."""

    def __init__(self, model=None, options: EngineOptions | None = None, *, core: EngineCore | None = None):
        self.core = core or EngineCore(model, options)
        self.options = self.core.options
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, Handle] = {}
        self._numbers = itertools.count()  # ids for questions given as plain strings or dicts
        # overflow_policy=wait: a submitter waits here for a free place instead of being refused.
        places = self.options.max_batch_size + self.options.max_waiting
        self._places = anyio.Semaphore(places if self.options.overflow_policy == "wait" else 1 << 30)
        self._task_group = None
        self.closed = False

    async def __aenter__(self) -> "Engine":
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._run_device_thread)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        self.close()
        return await self._task_group.__aexit__(*exc)

    # -- the public face ---------------------------------------------------------------------------
    async def submit(self, question, *, arrival: float | None = None, **params) -> Handle:
        """Queue a question; `arrival` (time.monotonic()) is when it really arrived, for its timings."""
        question = as_question(question, next(self._numbers), **params)
        if self.closed:
            raise RuntimeError("the engine is closed")
        await self._places.acquire()
        if self.closed:  # closed while this submitter waited for a place
            self._places.release()
            raise RuntimeError("the engine is closed")
        previous = self._handles.get(question.question_id)
        if previous is not None and previous.cancelling:  # a retry right after a cancel: let it land first
            await self.wait(previous)
        handle = Handle(question)
        if question.question_id in self._handles:
            self._finish(handle, rejected_answer(question, QuestionRejected(
                "duplicate_question_id", f"question {question.question_id!r} is already in flight")), own=True)
            return handle
        self._handles[question.question_id] = handle
        self._commands.put(("add", (question, arrival)))
        return handle

    async def wait(self, handle: Handle, timeout: float | None = None) -> AnswerEvent:
        with anyio.fail_after(timeout):
            while handle.answer is None:
                await handle._changed.wait()
        return handle.answer

    async def stream(self, handle: Handle) -> AsyncIterator[AnswerDelta]:
        sent = 0
        while True:
            while sent < len(handle.deltas):
                sent += 1
                yield handle.deltas[sent - 1]
            if handle.answer is not None:
                return
            await handle._changed.wait()

    def holds(self, question_id: str) -> bool:
        """Whether a question with this id was submitted and has not been answered yet."""
        return question_id in self._handles

    def cancel(self, handle: Handle | str) -> None:
        question_id = handle if isinstance(handle, str) else handle.question_id
        if question_id in self._handles:
            self._handles[question_id].cancelling = True
        self._commands.put(("cancel", question_id))

    async def load_adapter(self, name: str, path) -> LoraAdapter:
        """Hot-load or replace a LoRA adapter between two steps; questions in flight keep their version."""
        return await self._on_device_thread(self.core.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        """New questions naming `name` get `unknown_adapter`; those in flight finish with it."""
        await self._on_device_thread(self.core.unload_adapter, name)

    def update_defaults(self, **changes) -> int:
        """New sampling defaults for questions admitted from now on; returns the new version."""
        return self.core.defaults.update(**changes).version

    def close(self) -> None:
        """Stop the step loop; questions still in flight are cancelled."""
        if not self.closed:
            self.closed = True
            self._commands.put(_STOP)

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    async def _on_device_thread(self, fn, *args):
        """Run `fn(*args)` where the core lives, so it never races a step."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        call = _Call(fn, args)
        if self._task_group is None:  # not started: no device thread, nothing else touches the core
            call.run()
            return call.result()
        self._commands.put(("call", call))
        await call.done.wait()
        return call.result()

    # -- the device thread -------------------------------------------------------------------------
    async def _run_device_thread(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._loop)
        finally:
            self.close()

    def _loop(self) -> None:
        core = self.core
        while True:
            if not self._drain_commands(block_for=core.wait_time() if core.has_work else None):
                break
            if core.has_work and not core.wait_time():
                self._deliver_from_thread(core.step())
        for qid in list(self._handles):  # closing: whatever is left ends as cancelled
            core.cancel(qid)
        self._deliver_from_thread(core.step())
        self._refuse_queued_calls()

    def _drain_commands(self, block_for: float | None) -> bool:
        """Apply every queued command, blocking up to `block_for` seconds (None = until one comes)."""
        try:
            command = self._commands.get(timeout=block_for) if block_for != 0 else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _refuse_queued_calls(self) -> None:
        """Calls queued behind the stop would otherwise wait forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is _STOP:
                continue
            if command[0] == "call":
                command[1].error = RuntimeError("the engine closed before this call ran")
                anyio.from_thread.run_sync(command[1].done.set)
            elif command[0] == "add":  # its submitter is waiting for an answer: give it one
                question = command[1][0]
                closed = QuestionRejected("engine_closed", "the engine closed before this question started")
                self._deliver_from_thread(StepEvents(answers=[rejected_answer(question, closed)]))

    def _apply(self, verb: str, arg) -> None:
        if verb == "cancel":
            self.core.cancel(arg)
            return
        if verb == "call":
            arg.run()
            anyio.from_thread.run_sync(arg.done.set)
            return
        question, arrival = arg
        try:
            self.core.add(question, arrival=arrival)
        except QuestionRejected as exc:
            self._deliver_from_thread(StepEvents(answers=[rejected_answer(question, exc)]))

    def _deliver_from_thread(self, events: StepEvents) -> None:
        if events.deltas or events.answers:
            anyio.from_thread.run_sync(self._deliver, events)

    def _deliver(self, events: StepEvents) -> None:
        touched = {}
        for delta in events.deltas:
            handle = self._handles.get(delta.question_id)
            if handle is not None and delta.text:
                handle.deltas.append(AnswerDelta(delta.question_id, len(handle.deltas), delta.text))
                touched[delta.question_id] = handle
        for answer in events.answers:
            handle = self._handles.get(answer.question_id)
            if handle is not None:
                self._finish(handle, answer)
                touched.pop(answer.question_id, None)
        for handle in touched.values():
            handle._notify()

    def _finish(self, handle: Handle, answer: AnswerEvent, own: bool = False) -> None:
        handle.answer = answer
        # The last delta carries what was held back (a possible stop string, an unfinished character).
        tail = answer.text[sum(len(d.text) for d in handle.deltas):]
        handle.deltas.append(AnswerDelta(answer.question_id, len(handle.deltas), tail, done=True))
        if not own:
            del self._handles[answer.question_id]
        self._places.release()
        handle._notify()
