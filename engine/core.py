"""EngineCore: the synchronous engine. One `step()` is one packed forward over every scheduled question.

Single-threaded by design; `Engine` (engine/engine.py) runs it on its own thread for async callers,
and `IsolatedBatchPipeline` drives it in a plain loop.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from engine.audit import forward_summary, violations
from engine.kv.block_pool import BlockPool
from engine.schedule.deadlines import deadline, expired_message
from engine.defaults import DefaultsRegistry
from engine.output.detokenizer import TextStream
from engine.kernels.flash import FlashAttention, flash_available
from engine.kv.cache import KVCache, cache_dtype, plan_num_blocks
from engine.adapters.pool import AdapterPoolFull, LoraPool, UnknownAdapter
from engine.adapters.files import AdapterError, LoraAdapter
from engine.intake import QuestionRejected, prepare_prompt
from engine.options import EngineOptions
from engine.kv.prefix_cache import prefix_salt
from engine.schedule.routing import Router
from engine.model.runner import ModelRunner
from engine.schedule.scheduler import Overloaded, PromptTooLong, Scheduler, SchedulerLimits
from engine.schedule.sequence import Sequence, Status
from schemas import AnswerEvent, Audit, ErrorInfo, QuestionEvent, Timings, Usage, error_answer

log = structlog.get_logger("kev.engine")


@dataclass(frozen=True)
class TokenDelta:
    question_id: str
    token_id: int
    text: str  # newly settled text (may be empty while a character or stop string is pending)


@dataclass
class StepEvents:
    deltas: list[TokenDelta] = field(default_factory=list)
    answers: list[AnswerEvent] = field(default_factory=list)  # questions that ended this step


class EngineCore:
    def __init__(self, model, options: EngineOptions | None = None, attention=None):
        """`attention`: a backend class taking the KVCache; default flash-attn on CUDA, else torch SDPA."""
        options = options or EngineOptions()
        self.model = model
        self.options = options
        kv_dtype = cache_dtype(options.kv_dtype, model.dtype)
        # flash-attn reads its cache raw; an int8 cache is read (dequantised) by the torch backend.
        if attention is None and flash_available(model.device) and options.kv_dtype != "int8":
            attention = FlashAttention
        self.block_size = _block_size(options, attention)
        num_blocks = plan_num_blocks(model.spec, kv_dtype, model.device, self.block_size,
                                     num_blocks=options.num_blocks, budget_bytes=options.kv_budget_bytes,
                                     memory_fraction=options.memory_fraction)
        self.pool = BlockPool(num_blocks, self.block_size)
        key_center = model.key_means() if options.kv_dtype == "int8" else None
        self.kv = KVCache(model.spec, num_blocks, self.block_size, kv_dtype, model.device, model.dtype, key_center)
        # Each engine gets its own view of the shared weights: its deterministic mode is its own.
        weights = copy.copy(model.weights)
        weights.set_deterministic(options.deterministic)
        self.runner = ModelRunner(model, self.kv, attention=attention(self.kv) if attention else None,
                                  weights=weights)
        self.scheduler = Scheduler(self.pool, _limits(options, model.spec.max_position))
        self.defaults = DefaultsRegistry(options.defaults)
        self.loras = LoraPool(model, options.max_loras)
        self.stop_token_ids = tuple(model.spec.eos_token_ids)
        self.router = Router(options.routing_strategy, options.routing_buckets)
        self._questions: dict[str, QuestionEvent] = {}
        self._streams: dict[str, TextStream] = {}
        self._sequences: dict[str, Sequence] = {}
        self.num_forwards = 0
        self.num_generated = 0
        # Called with the batch size (questions in the pass) after each forward, on the device thread.
        self.step_observer: Callable[[int], None] | None = None

    # -- intake --------------------------------------------------------------------------------
    def add(self, question: QuestionEvent, prompt_ids: list[int] | None = None,
            arrival: float | None = None, published: float | None = None) -> Sequence:
        """Queue a question; raises QuestionRejected with a code the caller turns into an error answer.

        `arrival` (time.monotonic()) is when it reached this worker: its timings count from there.
        `published` (the same clock; engine.schedule.deadlines.published_at) is when it was published: its
        deadline counts from there. A question already past its deadline is not computed: it ends
        "timeout" at the next step, with no prefill. Without `prompt_ids` the prompt is encoded here.
        """
        qid = question.question_id
        if qid in self._sequences:
            raise QuestionRejected("duplicate_question_id", f"question {qid!r} is already in flight")
        arrival = time.monotonic() if arrival is None else arrival
        start = arrival if published is None else min(published, arrival)
        timeout_ms = question.timeout_ms or self.options.default_timeout_ms
        ends_at = deadline(start, timeout_ms)
        now = time.monotonic()
        if ends_at is not None and now >= ends_at:
            return self._expire(question, arrival, expired_message(start, arrival, timeout_ms, now))
        if prompt_ids is None:
            prompt_ids = self.prepare(question)
        if not prompt_ids:
            raise QuestionRejected("empty_prompt", "the prompt has no tokens")
        lora = self._acquire_adapter(question.adapter)
        seq = Sequence(
            question_id=qid,
            prompt_ids=list(prompt_ids),
            params=self.defaults.resolve(question.params, self.stop_token_ids),
            priority=question.priority,
            deadline=ends_at,
            arrival=arrival,
            adapter=question.adapter,
            lora=lora,
        )
        if self.options.prefix_caching:
            seq.cache_salt = self._prefix_salt(question, seq)
        seq.routing_bucket = self.router.bucket(question, seq.num_prompt_tokens)
        try:
            self.scheduler.add(seq)
        except (PromptTooLong, Overloaded) as exc:
            self.loras.release(lora)
            raise QuestionRejected("prompt_too_long" if isinstance(exc, PromptTooLong) else "overloaded",
                                   str(exc)) from None
        self._track(question, seq)
        return seq

    def prepare(self, question: QuestionEvent) -> list[int]:
        """The prompt's token ids within this engine's limits, or QuestionRejected.

        Reads only the tokenizer and fixed limits: safe on any thread (Engine calls it on a worker
        thread, so tokenizing never holds up a step).
        """
        return prepare_prompt(self.model.tokenizer, question, self.scheduler.max_tokens_per_question)

    def _expire(self, question: QuestionEvent, arrival: float, why: str) -> Sequence:
        """End a question that is past its deadline on arrival: answered at the next step, never computed."""
        seq = Sequence(question_id=question.question_id, prompt_ids=[],
                       params=self.defaults.resolve(question.params, self.stop_token_ids),
                       priority=question.priority, arrival=arrival, adapter=question.adapter)
        seq.error = why
        self.scheduler.finish(seq, Status.TIMEOUT)
        self._track(question, seq)
        log.info("question.expired", question_id=question.question_id, why=why)
        return seq

    def _track(self, question: QuestionEvent, seq: Sequence) -> None:
        qid = question.question_id
        self._questions[qid], self._sequences[qid] = question, seq
        self._streams[qid] = TextStream(self.model.tokenizer, seq.params.stop)

    def _prefix_salt(self, question: QuestionEvent, seq: Sequence) -> bytes:
        tenant = question.tenant if self.options.prefix_scope == "tenant" else None
        return prefix_salt(str(self.model.path), tenant, question.cache_salt, seq.cache_namespace)

    def cancel(self, question_id: str) -> bool:
        return self.scheduler.cancel(question_id)

    # -- adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, path, version: int | None = None) -> LoraAdapter:
        """Register or replace a PEFT LoRA adapter; questions admitted from now on get this version
        (the next one, or `version` when re-applying a load this engine's predecessor made)."""
        return self.loras.load(name, path, version)

    def unload_adapter(self, name: str) -> None:
        """New questions naming it get `unknown_adapter`; those already admitted finish with it."""
        self.loras.unload(name)

    def _acquire_adapter(self, name: str | None) -> LoraAdapter | None:
        if not name:
            return None
        try:
            return self.loras.acquire(name)
        except UnknownAdapter:
            raise QuestionRejected("unknown_adapter", f"adapter {name!r} is not loaded") from None
        except AdapterPoolFull as exc:
            raise QuestionRejected("overloaded", str(exc)) from None
        except AdapterError as exc:  # evicted, and its files changed or went away since it was loaded
            raise QuestionRejected("adapter_error", str(exc)) from None

    def has_room(self) -> bool:
        return self.scheduler.has_room()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def wait_time(self) -> float | None:
        return self.scheduler.wait_time()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> StepEvents:
        plan = self.scheduler.schedule()
        events = StepEvents()
        if plan:
            out = self.runner.execute(plan)
            if self.step_observer is not None:
                self.step_observer(len(plan.chunks))
            self._audit(plan, out.segments)
            new_tokens = self.scheduler.update(plan, out.sampled)
            events.deltas = self._detokenize(new_tokens)
        events.answers = [self._answer(seq) for seq in self.scheduler.take_finished()]
        return events

    def _detokenize(self, new_tokens: list[tuple[Sequence, int]]) -> list[TokenDelta]:
        deltas = []
        self.num_generated += len(new_tokens)
        for seq, token in new_tokens:
            stream = self._streams[seq.question_id]
            try:
                deltas.append(TokenDelta(seq.question_id, token, stream.push(token)))
            except Exception as exc:  # this question's failure is its own: the batch goes on
                seq.error = f"detokenizing failed: {exc}"
                self.scheduler.finish(seq, Status.ERROR)
                continue
            if stream.stopped and seq.status == Status.LENGTH:  # ended by both on one token: the stop string counts
                seq.status = Status.STOPPED
            elif stream.stopped:  # a stop string ended it: free its blocks this very step
                self.scheduler.finish(seq, Status.STOPPED)
        return deltas

    def _answer(self, seq: Sequence) -> AnswerEvent:
        qid = seq.question_id
        question, stream = self._questions.pop(qid), self._streams.pop(qid)
        del self._sequences[qid]
        self.loras.release(seq.lora)
        stream.finish()
        # A stop string's tokens are not part of the answer: token_ids and usage count what `text` keeps.
        output_ids = tuple(seq.output_ids[:stream.kept_tokens] if stream.stopped else seq.output_ids)
        return AnswerEvent(
            question_id=qid,
            request_id=question.request_id,
            error=_error(seq),
            text=stream.text,
            token_ids=output_ids,
            finish_reason=seq.status.finish_reason,
            usage=Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(output_ids),
                        cached_prompt_tokens=seq.cached_prompt_tokens),
            timings=_timings(seq),
            audit=Audit(worker=self.options.worker, channel=seq.channel, blocks=seq.audit_blocks,
                        steps=seq.steps, batch_sizes=_compact(seq.batch_sizes), adapter=seq.adapter,
                        routing_bucket=seq.routing_bucket,
                        defaults_version=seq.params.defaults_version,
                        cached_prompt_tokens=seq.cached_prompt_tokens),
        )

    def _audit(self, plan, segments) -> None:
        self.num_forwards += 1
        if not self.options.audit:
            return
        record = forward_summary(self.num_forwards, [c.seq.question_id for c in plan.chunks], segments,
                                 self.block_size, routing=self.options.debug,
                                 prefixes=[self.scheduler.shared_prefix(c.seq) for c in plan.chunks])
        problems = violations(record)
        if problems:
            log.error("forward.isolation_violation", problems=problems, **record)
        else:
            log.info("forward.mask", **record)  # audit is on only when asked for: show it at the default level


def rejected_answer(question: QuestionEvent, exc: QuestionRejected) -> AnswerEvent:
    return error_answer(question.question_id, question.request_id, exc.code, exc.message)


def _limits(options: EngineOptions, model_positions: int) -> SchedulerLimits:
    return SchedulerLimits(
        max_running=options.max_batch_size,
        max_tokens_per_step=options.max_tokens_per_step,
        max_context=min(options.max_context, model_positions),  # past the rotary table there is no position
        capacity_tokens=options.kv_slot_capacity,
        max_waiting=options.max_waiting,
        batch_window_s=options.batch_window_ms / 1000,
        policy=options.policy,
        overflow=options.overflow_policy,
        length_aware=options.length_aware,
        early_stop=options.early_stop,
        split_roles=options.deterministic,
    )


def _block_size(options: EngineOptions, attention) -> int:
    needs = getattr(attention, "block_size_multiple", 1)
    if options.block_size % needs:
        log.info("kv.block_size_adjusted", configured=options.block_size, used=needs, backend=attention.name)
        return needs
    return options.block_size


def _error(seq: Sequence) -> ErrorInfo | None:
    if seq.status == Status.ERROR:
        return ErrorInfo("internal_error", seq.error or "")
    if seq.status == Status.TIMEOUT and seq.error:  # never computed: say why the answer is empty
        return ErrorInfo("deadline_expired", seq.error)
    return None


def _timings(seq: Sequence) -> Timings:
    """Milliseconds from when the question reached this worker (`arrival`), not from its publish time:
    queued_ms until it was first admitted to the batch (0 if never), ttft_ms until its first token,
    e2e_ms until it ended. Its deadline, unlike these, counts from the publish time."""

    def ms(t):
        return None if t is None else round((t - seq.arrival) * 1000, 3)

    return Timings(queued_ms=ms(seq.admitted_at) or 0.0, ttft_ms=ms(seq.first_token_at),
                   e2e_ms=ms(seq.finished_at) or 0.0)


def _compact(sizes: list[int]) -> tuple[int, ...]:
    """Batch sizes seen, one entry per change, so a long answer's audit stays short."""
    out: list[int] = []
    for size in sizes:
        if not out or out[-1] != size:
            out.append(size)
    return tuple(out)
