"""Engine: the long-lived, async face of EngineCore (anyio, so asyncio and trio both work).

The step loop runs on one worker thread that owns the device (engine/device_thread.py); async callers
only ever wait on events, never on a forward. Commands go in through a thread-safe queue; each step's
results come back to the event loop in one call.

`submit` prepares a question before the device thread sees it: its prompt is tokenized on one worker
thread, and its response_format compiled on the compile threads under its principal's budget
(engine/compile_budget.py). Many submits may prepare at once; one that needs no compile never waits
for a compile. A question cancelled while it is prepared stops there and ends "cancelled", never
compiled or computed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread

from engine.adapters.files import LoraAdapter
from engine.compile_budget import CompileBudget, compile_threads
from engine.compile_threads import CompileThreads, CompileThreadsClosed
from engine.core import EngineCore
from engine.device_thread import CLOSED, DeviceThread, loop_poster
from engine.sampling_defaults import Defaults
from engine.intake import QuestionRejected
from engine.kernels.omp_pool import release_thread_pool
from engine.options import EngineOptions
from engine.output.answers import rejected_answers
from engine.output.handle import Handle
from engine.output.processor import StepEvents
from engine.prompt import as_question
from engine.schedule.deadlines import published_at
from schemas import AnswerDelta, AnswerEvent
from schemas.principal import ANONYMOUS, Principal

# Prompts are rendered and tokenized on one worker thread at a time, in arrival order; the tokenizer
# is shared with the device thread's detokenizing, and one thread keeps encodes from contending.
TOKENIZING_THREADS = 1
# response_format grammars compile on their own threads, below the step's priority, each principal a few
# at a time (engine/compile_budget.py): a slow schema holds up neither the steps nor the questions behind it.


class Engine:
    """`async with Engine(model) as engine: h = await engine.submit(q); answer = await engine.wait(h)`."""

    def __init__(self, model=None, options: EngineOptions | None = None, *, core: EngineCore | None = None):
        self.core = core or EngineCore(model, options)
        self.options = self.core.options
        self._handles: dict[str, Handle] = {}
        self._device = DeviceThread(self.core, self._handles, self._deliver_from_thread)
        self._numbers = itertools.count()  # ids for questions given as plain strings or dicts
        # overflow_policy=wait: a submitter waits here for a free place instead of being refused.
        places = self.options.max_parallel_queries + self.options.max_waiting
        self._places = anyio.Semaphore(places if self.options.overflow_policy == "wait" else 1 << 30)
        self._task_group = None
        self._tokenizing: anyio.CapacityLimiter | None = None
        self.compiles: CompileBudget | None = None
        self._preparing: dict[str, anyio.CancelScope] = {}  # question_id -> its preparation, which a cancel ends
        self.closed = False

    async def __aenter__(self) -> "Engine":
        release_thread_pool()  # the math runs on the device thread: this thread's OpenMP workers would slow it
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._post = loop_poster()
        self._task_group.start_soon(self._run_device_thread)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        self.close()
        return await self._task_group.__aexit__(*exc)

    # -- the public face ---------------------------------------------------------------------------
    async def submit(self, question, *, arrival: float | None = None, published_ms: int | None = None,
                     cancelled: bool = False, principal: Principal = ANONYMOUS, **params) -> Handle:
        """Queue a question. `arrival` (time.monotonic()) is when it really arrived, for its timings;
        `published_ms` (ms since the epoch, a Kafka record's timestamp) is when it was published, for
        its deadline (see engine/schedule/deadlines.py); `cancelled`: a cancel came before it, so it ends
        "cancelled" without computing; `principal`: who asked, whose fair share and quotas it takes and
        whose compile budget its response_format uses. Its prompt is rendered and tokenized here, on a worker thread, so a huge prompt never holds
        up a step; a prompt over the limits, or a response_format that does not compile, is answered here.
        Keys Kev does not know (a misspelt keyword, a dict's extra key) go as intake.unknown_fields says:
        listed in the answer's audit and logged, or refused here with QuestionRejected (engine/prompt.py)."""
        question = as_question(question, next(self._numbers), on_unknown=self.options.unknown_fields, **params)
        if self.closed:
            raise RuntimeError("the engine is closed")
        await self._places.acquire()
        if self.closed:  # closed while this submitter waited for a place
            self._places.release()
            raise RuntimeError("the engine is closed")
        previous = self._handles.get(question.question_id)
        if previous is not None and previous.cancelling:  # a retry right after a cancel: let it land first
            await self.wait(previous)
        handle = Handle(question, cancelling=cancelled)
        if question.question_id in self._handles:
            self._end(handle, rejected_answers(question, QuestionRejected(
                "duplicate_question_id", f"question {question.question_id!r} is already in flight")))
            return handle
        self._handles[question.question_id] = handle  # from now on holds() and cancel() know it
        arrival = time.monotonic() if arrival is None else arrival
        published = published_at(published_ms)
        try:
            prompt_ids = await self._prepare(handle, arrival, published, principal)
        except QuestionRejected as rejected:
            if not handle.cancelling:  # cancelled meanwhile: "cancelled" is what its asker waits for
                self._drop(handle, rejected_answers(question, rejected))
                return handle
            prompt_ids = None
        except BaseException:  # the submitter was cancelled while its question was prepared
            self._drop(handle, None)
            raise
        if self.closed:  # closed while it was prepared: the step loop may have stopped reading commands
            self._drop(handle, rejected_answers(question, QuestionRejected(*CLOSED)))
            return handle
        if handle.cancelling:  # before or while it was prepared: it ends "cancelled" at the next step
            self._device.put("withdraw", (question, arrival))
        else:
            self._device.put("add", (question, prompt_ids, arrival, published, principal))
        return handle

    async def _prepare(self, handle: Handle, arrival: float, published: float | None,
                       principal: Principal) -> list[int] | None:
        """Its prompt ids, tokenized off the device thread, and its response_format compiled (or found
        cached); None when its deadline has already passed (the engine answers it "timeout" without
        tokenizing or computing anything) or when it was cancelled meanwhile (`handle.cancelling`)."""
        question = handle.question
        ends_at = self.core.deadline(question, arrival, published)
        if handle.cancelling or (ends_at is not None and time.monotonic() >= ends_at):
            return None
        if self._tokenizing is None:  # made here: a CapacityLimiter needs a running event loop
            self._tokenizing = anyio.CapacityLimiter(TOKENIZING_THREADS)
            self.compiles = CompileBudget(CompileThreads(compile_threads(), loop_poster()),
                                          self.options.compiles_per_principal)
        # A cancel ends the wait for the tokenizer, a compile place or a compile at once (a compile
        # already running finishes unread; its grammar is cached); a tokenize already running finishes first.
        with anyio.CancelScope() as self._preparing[question.question_id]:
            try:
                prompt_ids = await anyio.to_thread.run_sync(self.core.prepare, question, limiter=self._tokenizing)
                if question.params.response_format is not None:
                    await self.compiles.run(principal, self.core.constraints.prepare, question)
            except CompileThreadsClosed:  # the engine closed while it waited for a compile place
                raise QuestionRejected(*CLOSED) from None
            finally:
                del self._preparing[question.question_id]
        return None if handle.cancelling else prompt_ids

    def _drop(self, handle: Handle, answers: list[AnswerEvent] | None) -> None:
        """A question that never reached the core: answer it here (or just forget it) and free its place."""
        del self._handles[handle.question_id]
        self._end(handle, answers)

    async def wait(self, handle: Handle, timeout: float | None = None) -> AnswerEvent:
        return await handle.wait(timeout)

    async def stream(self, handle: Handle) -> AsyncIterator[AnswerDelta]:
        async for delta in handle.stream():
            yield delta

    def holds(self, question_id: str) -> bool:
        """Whether a question with this id was submitted and has not been answered yet."""
        return question_id in self._handles

    def cancel(self, handle: Handle | str) -> None:
        question_id = handle if isinstance(handle, str) else handle.question_id
        if question_id in self._handles:
            self._handles[question_id].cancelling = True
        preparing = self._preparing.get(question_id)
        if preparing is not None:  # not queued yet: it stops preparing, and submit withdraws it
            preparing.cancel()
        self._device.put("cancel", question_id)

    async def load_adapter(self, name: str, path, version: int | None = None) -> LoraAdapter:
        """Hot-load or replace a LoRA adapter between two steps; questions in flight keep their version.
        `version`: serve it under this version (re-applying a load after a restart); default the next."""
        return await self._on_device_thread(self.core.load_adapter, name, path, version)

    async def unload_adapter(self, name: str) -> None:
        """New questions naming `name` get `unknown_adapter`; those in flight finish with it."""
        await self._on_device_thread(self.core.unload_adapter, name)

    def update_defaults(self, **changes) -> int:
        """New sampling defaults for questions admitted from now on; returns the new version."""
        return self.core.defaults.update(**changes).version

    @property
    def defaults(self) -> Defaults:
        """The sampling defaults questions admitted now get, with their version."""
        return self.core.defaults.current

    def restore_defaults(self, defaults: Defaults) -> None:
        """Serve `defaults`, version included: a restarted engine takes up where its predecessor was."""
        self.core.defaults.restore(defaults)

    def close(self) -> None:
        """Stop the step loop; questions still in flight are cancelled."""
        if not self.closed:
            self.closed = True
            self._device.stop()
            if self.compiles is not None:
                self.compiles.close()

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    async def _on_device_thread(self, fn, *args):
        """Run `fn(*args)` where the core lives, so it never races a step."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        if self._task_group is None:  # not started: no device thread, nothing else touches the core
            return fn(*args)
        return await self._device.call(fn, *args)

    # -- the device thread -------------------------------------------------------------------------
    async def _run_device_thread(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._device.run)
        finally:
            self.close()

    def _deliver_from_thread(self, events: StepEvents) -> None:
        # Posted, not waited for: the device thread goes on to the next step while the event loop hands
        # the tokens out, so a loop busy with other work (a Kafka worker's fetches) never holds a step back.
        # The loop runs posted calls in order, and before it learns the thread has ended.
        if events.deltas or events.answers:
            self._post(self._deliver, events)

    def _deliver(self, events: StepEvents) -> None:
        touched = {}
        for delta in events.deltas:
            handle = self._handles.get(delta.question_id)
            if handle is not None and delta.text:
                handle.add_text(delta.text, delta.index, delta.logprobs)
                touched[delta.question_id] = handle
        for answer in events.answers:
            handle = self._handles.get(answer.question_id)
            if handle is None:
                continue
            handle.end(answer)
            touched[answer.question_id] = handle
            if handle.complete:  # every sample answered
                del self._handles[answer.question_id]
                self._places.release()
        for handle in touched.values():
            handle._notify()

    def _end(self, handle: Handle, answers: list[AnswerEvent] | None) -> None:
        """Hand the handle its answers (None: the submitter is gone, nobody waits for them) and free its place."""
        for answer in answers or ():
            handle.end(answer)
        self._places.release()
        handle._notify()
