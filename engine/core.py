"""EngineCore: the synchronous engine. One `step()` is one packed forward over every scheduled question.

A step: the scheduler plans, the runner computes, the scheduler records; the output processor
(engine/output/processor.py) turns the new tokens into text and the ended questions into answers.
Single-threaded by design; `Engine` (engine/engine.py) runs it on its own thread for async callers,
and `IsolatedBatchPipeline` drives it in a plain loop.
"""

from __future__ import annotations

import copy
import time

import structlog

from engine.adapters.files import LoraAdapter
from engine.adapters.pool import LoraPool
from engine.assembly import block_size_for, pick_attention, scheduler_limits
from engine.constrain import Constraints
from engine.sampling_defaults import DefaultsRegistry
from engine.deterministic.mode import math_mode
from engine.forward_audit import ForwardAudit
from engine.intake import QuestionRejected, acquire_adapter, prepare_prompt, unknown_fields
from engine.kernels.backend import FLASH
from engine.kernels.flash import FlashAttention
from engine.kernels.heap import give_back_freed_pages
from engine.kv.block_pool import BlockPool
from engine.kv.cache import KVCache, cache_dtype, plan_num_blocks
from engine.model.logprobs import attach_logprobs
from engine.model.runner import ModelRunner
from engine.normalization import normalized
from engine.options import EngineOptions
from engine.output.processor import OutputProcessor, StepEvents, TokenDelta
from engine.prefix_sharing import PrefixSharing
from engine.routing_embedding import EmbeddingHash
from engine.samples import check_samples, private_salt, sample_ids, sample_params
from engine.schedule.deadlines import clock_start, deadline, expired_message
from engine.schedule.routing import Router
from engine.schedule.scheduler import Overloaded, PromptTooLong, Scheduler
from engine.sequence import Sequence, Status
from engine.speculate.setup import build_speculation
from engine.step_hook import StepHook
from schemas import AnswerEvent, QuestionEvent
from schemas.principal import ANONYMOUS, Principal

log = structlog.get_logger("kev.engine")


class EngineCore:
    def __init__(self, model, options: EngineOptions | None = None, attention=None):
        """`attention`: a backend class taking the KVCache; default: engine/kernels/backend.py's choice
        (flash-attn on CUDA in fp16/bf16 when installed, else torch SDPA; fixed tiles when deterministic)."""
        options = options or EngineOptions()
        self.model = model
        self.options = options
        kv_dtype = cache_dtype(options.kv_dtype, model)
        self.attention_choice = pick_attention(model, options, attention)
        if attention is None and self.attention_choice.backend == FLASH:
            attention = FlashAttention
        self.block_size = block_size_for(options, attention)
        num_blocks = plan_num_blocks(model.spec, kv_dtype, model.device, self.block_size,
                                     num_blocks=options.num_blocks, budget_bytes=options.kv_budget_bytes,
                                     memory_fraction=options.memory_fraction)
        self.pool = BlockPool(num_blocks, self.block_size)
        key_center = model.key_means() if options.kv_dtype == "int8" else None
        self.kv = KVCache(model.spec, num_blocks, self.block_size, kv_dtype, model.device, model.dtype, key_center)
        # Each engine gets its own view of the shared weights: its math mode is its own.
        weights = copy.copy(model.weights)
        weights.rotary.reach(options.max_context)  # every position a question here may take (shared by the copies)
        weights.use(math_mode(options.deterministic))
        self.runner = ModelRunner(model, self.kv, attention=attention(self.kv) if attention else None,
                                  weights=weights)
        self.scheduler = Scheduler(self.pool, scheduler_limits(options, model.spec.max_position, self.runner.attention),
                                   speculation=build_speculation(options, model, weights, self.runner, self.pool),
                                   adapter_slot=self._adapter_slot)
        self.defaults = DefaultsRegistry(options.defaults)
        self.loras = LoraPool(model, options.max_loras)
        # waiting for a resident adapter slot, by sample name: its question and its samples' salt
        self._awaiting_adapter: dict[str, tuple[QuestionEvent, str | None]] = {}
        self.prefix_sharing = PrefixSharing(model, options, self.block_size)
        self.stop_token_ids = tuple(model.spec.eos_token_ids)
        self.router = Router(options.routing_strategy, options.routing_buckets,
                             EmbeddingHash.for_model(model) if options.routing_strategy == "semantic_hash" else None)
        self.output = OutputProcessor(model.tokenizer, options.worker)
        self.constraints = Constraints(model.tokenizer, self.stop_token_ids, model.spec.vocab_size, model.device,
                                       options.grammar_cache_size)
        self.num_forwards = 0
        self.num_generated = 0
        # Watchers of each step, on the device thread (engine/step_hook.py): the audit, the metrics, benchmarks.
        self.hooks: list[StepHook] = [ForwardAudit(self.scheduler, self.block_size, options.debug)] \
            if options.audit else []

    # -- intake --------------------------------------------------------------------------------
    def add(self, question: QuestionEvent, prompt_ids: list[int] | None = None,
            arrival: float | None = None, published: float | None = None,
            principal: Principal = ANONYMOUS) -> Sequence:
        """Queue a question; raises QuestionRejected with a code the caller turns into an error answer.

        `arrival` (time.monotonic()) is when it reached this worker: its timings count from there.
        `published` (the same clock; engine.schedule.deadlines.published_at) is when it was published: its
        deadline counts from there. A question already past its deadline is not computed: it ends
        "timeout" at the next step, with no prefill. Without `prompt_ids` the prompt is encoded here.
        `principal`: who asked (schemas/principal.py), whose fair share and quotas it takes.
        """
        qid = question.question_id
        names = sample_ids(qid, question.params.n)
        if any(name in self.output for name in names):
            raise QuestionRejected("duplicate_question_id", f"question {qid!r} is already in flight")
        arrival = time.monotonic() if arrival is None else arrival
        ends_at = self.deadline(question, arrival, published)
        now = time.monotonic()
        if ends_at is not None and now >= ends_at:
            return self._expire(question, arrival, published, now)
        if prompt_ids is None:
            prompt_ids = self.prepare(question)
        if not prompt_ids:
            raise QuestionRejected("empty_prompt", "the prompt has no tokens")
        params = self.defaults.resolve(question.params, self.stop_token_ids)
        check_samples(question, params)
        ignored = unknown_fields(question, self.options.unknown_fields)
        salt = private_salt() if len(names) > 1 else None
        samples: list[Sequence] = []
        try:
            for index, name in enumerate(names):
                samples.append(self._add_sample(question, name, index, sample_params(params, index), prompt_ids,
                                                ends_at, arrival, principal, ignored, salt))
        except QuestionRejected:
            for seq in samples:  # all of its samples or none
                self.scheduler.retract(seq)
                self.loras.release(seq.lora)
                self._awaiting_adapter.pop(seq.question_id, None)
                self.output.forget(seq)
            raise
        return samples[0]

    def _add_sample(self, question: QuestionEvent, name: str, index: int, params, prompt_ids: list[int],
                    ends_at: float | None, arrival: float, principal: Principal, ignored: tuple[str, ...],
                    salt: str | None) -> Sequence:
        constraint = self.constraints.attach(question)  # compiled already when Engine prepared it
        lora = acquire_adapter(self.loras, question.adapter)
        seq = Sequence(
            question_id=name,
            sample=index,
            prompt_ids=list(prompt_ids),
            params=params,
            priority=question.priority,
            deadline=ends_at,
            arrival=arrival,
            principal=principal,
            adapter=question.adapter,
            lora=lora,
            constraint=constraint,
            ignored_fields=ignored,
            logprobs=None if params.logprobs is None else [],
        )
        if not seq.awaits_adapter:  # else once it holds its adapter: the prefix cache's salt names the version
            self.prefix_sharing.share(question, seq, salt)
        seq.routing_bucket = self.router.bucket(question, seq.num_prompt_tokens)
        seq.normalized = self.options.normalize and normalized(question) is not question
        try:
            self.scheduler.add(seq)
        except (PromptTooLong, Overloaded) as exc:
            self.loras.release(lora)
            raise QuestionRejected("prompt_too_long" if isinstance(exc, PromptTooLong) else "overloaded",
                                   str(exc)) from None
        if seq.awaits_adapter:
            self._awaiting_adapter[name] = (question, salt)
        self.output.track(question, seq)
        return seq

    def prepare(self, question: QuestionEvent) -> list[int]:
        """The prompt's token ids within this engine's limits, or QuestionRejected.

        Reads only the tokenizer and fixed limits: safe on any thread (Engine calls it on a worker
        thread, so tokenizing never holds up a step).
        """
        if self.options.normalize:  # per question, before the template: the same tokens alone or packed
            question = normalized(question)
        return prepare_prompt(self.model.tokenizer, question, self.scheduler.max_tokens_per_question)

    def deadline(self, question: QuestionEvent, arrival: float, published: float | None) -> float | None:
        """When the question must be answered by (time.monotonic()); None when it has no timeout.

        Counted from its publish time (engine.schedule.deadlines.published_at), or from its arrival
        when it was not published earlier.
        """
        return deadline(clock_start(arrival, published), self._timeout_ms(question))

    def _expire(self, question: QuestionEvent, arrival: float, published: float | None, now: float) -> Sequence:
        """End a question that is past its deadline on arrival: answered at the next step, never computed."""
        why = expired_message(clock_start(arrival, published), arrival, self._timeout_ms(question), now)
        seq = self._never_computed(question, arrival, Status.TIMEOUT, why)
        log.info("question.expired", question_id=question.question_id, why=why)
        return seq

    def withdraw(self, question: QuestionEvent, arrival: float) -> Sequence:
        """End a question cancelled before it was queued (Engine was still preparing it): answered
        "cancelled" at the next step, never computed."""
        if question.question_id in self.output:
            raise QuestionRejected("duplicate_question_id", f"question {question.question_id!r} is already in flight")
        return self._never_computed(question, arrival, Status.CANCELLED)

    def _never_computed(self, question: QuestionEvent, arrival: float, status: Status,
                        why: str | None = None) -> Sequence:
        """Each of its samples ends `status` at the next step, with an answer of its own."""
        params = self.defaults.resolve(question.params, self.stop_token_ids)
        samples = []
        for index, name in enumerate(sample_ids(question.question_id, question.params.n)):
            seq = Sequence(question_id=name, sample=index, prompt_ids=[], params=sample_params(params, index),
                           priority=question.priority, arrival=arrival, adapter=question.adapter)
            seq.error = why
            self.scheduler.finish(seq, status)
            self.output.track(question, seq)
            samples.append(seq)
        return samples[0]

    def _timeout_ms(self, question: QuestionEvent) -> int | None:
        return question.timeout_ms or self.options.default_timeout_ms

    def _adapter_slot(self, seq: Sequence) -> bool:
        """The scheduler's offer to a question waiting for its adapter, as its turn to be admitted comes: True
        once it holds the adapter's current version; False while every resident slot is in use, or when the
        adapter went away (unloaded, its files unreadable) while it waited, which ends it with that error."""
        try:
            seq.lora = acquire_adapter(self.loras, seq.adapter)
        except QuestionRejected as rejected:
            seq.error, seq.error_code = rejected.message, rejected.code
            self.scheduler.finish(seq, Status.ERROR)
            return False
        if seq.lora is None:
            return False
        question, samples_salt = self._awaiting_adapter.pop(seq.question_id)
        self.prefix_sharing.share(question, seq, samples_salt)
        return True

    def cancel(self, question_id: str) -> bool:
        """Cancel the question, every sample of it."""
        names = self.output.samples_of(question_id) or [question_id]
        return any([self.scheduler.cancel(name) for name in names])

    # -- adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, path, version: int | None = None) -> LoraAdapter:
        """Register or replace a PEFT LoRA adapter; questions admitted from now on get this version
        (the next one, or `version` when re-applying a load this engine's predecessor made)."""
        return self.loras.load(name, path, version)

    def unload_adapter(self, name: str) -> None:
        """New questions naming it get `unknown_adapter`; those already admitted finish with it."""
        self.loras.unload(name)

    def has_room(self) -> bool:
        return self.scheduler.has_room()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def wait_time(self) -> float | None:
        return self.scheduler.wait_time()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> StepEvents:
        """One packed forward: the text it settled, and the answers of the questions that ended."""
        plan = self.scheduler.schedule()
        events = StepEvents()
        if plan:
            started = time.perf_counter()
            out = self.runner.execute(plan, self.constraints.row_masks)
            seconds = time.perf_counter() - started  # the scheduler sizes prompt chunks by what steps cost
            self.num_forwards += 1
            for hook in self.hooks:
                hook.forward(self.num_forwards, plan, out)
            new_tokens = self.scheduler.update(plan, out.sampled, seconds)
            if out.logprobs is not None:
                attach_logprobs(plan.sample_row_chunks, out.logprobs, new_tokens)
            for seq in self.constraints.advance(new_tokens):  # a token its grammar refused: it ends alone
                self.scheduler.finish(seq, Status.ERROR)
            events.deltas = self._detokenize(new_tokens)
        finished = self.scheduler.take_finished()
        if finished and not self.scheduler.has_work:  # gone idle: the steps' freed buffers back to the system
            give_back_freed_pages()
        for hook in self.hooks:
            hook.ended(finished)
        events.answers = [self._answer(seq) for seq in finished]
        return events

    def _detokenize(self, new_tokens: list[tuple[Sequence, int]]) -> list[TokenDelta]:
        self.num_generated += len(new_tokens)
        deltas, ended = self.output.detokenize(new_tokens)
        for seq, status in ended:  # ended by its text: its blocks go back to the pool this very step
            self.scheduler.finish(seq, status)
        return deltas

    def _answer(self, seq: Sequence) -> AnswerEvent:
        self.loras.release(seq.lora)
        self._awaiting_adapter.pop(seq.question_id, None)  # ended (a timeout, a cancel) before it got its adapter
        return self.output.answer(seq)

