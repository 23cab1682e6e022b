"""Iteration-level scheduling: every step admits, preempts and evicts questions over a fixed block pool.

No torch, no asyncio: the scheduler is plain bookkeeping, so its tests run on exact block ids.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable

from engine.kv.block_pool import BlockPool
from engine.schedule.admission_order import admission_order
from engine.schedule.limits import SchedulerLimits
from engine.schedule.prefix_chain import (
    awaits_prefix,
    blocks_in_flight,
    cached_blocks,
    name_filled_blocks,
    shared_chain,
)
from engine.schedule.prompt_grid import on_grid
from engine.sequence import Sequence, Status
from engine.step_plan import Chunk, StepPlan


class Overloaded(Exception):
    """The engine cannot take this question now (overflow policy `queue` or `reject`)."""


class PromptTooLong(ValueError):
    """The prompt alone does not fit one question's context or KV capacity."""


class Scheduler:
    def __init__(self, pool: BlockPool, limits: SchedulerLimits = SchedulerLimits(),
                 clock: Callable[[], float] = time.monotonic, speculation=None,
                 adapter_slot: Callable[[Sequence], bool] | None = None) -> None:
        self.pool = pool
        self.speculation = speculation  # None: no speculative decoding (engine/speculate/speculation.py)
        # Offered a question that waits for a resident adapter slot when its turn to be admitted comes: True
        # once it holds its adapter; False while every slot is in use (or when it ended the question).
        self.adapter_slot = adapter_slot
        self.limits = limits
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.lingering: list[Sequence] = []  # finished but kept in the batch (early_stop=False)
        self._finished: list[Sequence] = []
        self._free_channels = list(range(limits.max_running))  # a heap: the lowest free channel first
        self.num_preemptions = 0
        self.prompt_tokens_admitted = 0  # over first admissions: the prefix cache's hit rate
        self.cached_tokens_admitted = 0
        self.num_question_steps = 0  # question-forwards that emitted tokens (1 each, or 1 + kept drafts)

    # -- intake -------------------------------------------------------------------------------
    @property
    def max_tokens_per_question(self) -> int:
        caps = [self.limits.max_context, self.pool.num_blocks * self.pool.block_size]
        if self.limits.capacity_tokens:
            caps.append(self.limits.capacity_tokens)
        return min(caps)

    def has_room(self) -> bool:
        return len(self.waiting) < self.limits.max_waiting

    def add(self, seq: Sequence) -> None:
        limit = self.max_tokens_per_question
        if seq.num_tokens >= limit:
            raise PromptTooLong(f"prompt has {seq.num_tokens} tokens; this engine allows at most {limit - 1}")
        if self.limits.overflow == "reject" and len(self.running) + len(self.waiting) >= self.limits.max_running:
            raise Overloaded(f"all {self.limits.max_running} channels are busy (overflow_policy=reject)")
        if self.limits.overflow != "wait" and not self.has_room():  # under "wait" the submitter is the bound
            raise Overloaded(f"the waiting queue is full ({self.limits.max_waiting} questions)")
        seq.status = Status.WAITING
        # The audit digests the tokens of a question that may draft: its drafts' sources (engine/audit.py).
        seq.speculative = self.speculation is not None and seq.constraint is None
        self.waiting.append(seq)

    def cancel(self, question_id: str) -> bool:
        for seq in self.running + self.waiting:
            if seq.question_id == question_id:
                self.finish(seq, Status.CANCELLED)
                return True
        return False

    # -- the step -------------------------------------------------------------------------------
    def wait_time(self) -> float | None:
        """Seconds to hold the next step for company; 0 = step now, None = idle until an arrival."""
        if self.running or self.lingering or self._finished:
            return 0.0
        if not self.waiting:
            return None
        if len(self.waiting) >= self.limits.max_running or self._waiting_fill_a_step():
            return 0.0  # company would not join this step: it is full already
        oldest = min(seq.arrival for seq in self.waiting)
        return max(0.0, oldest + self.limits.batch_window_s - self.clock())

    def _waiting_fill_a_step(self) -> bool:
        budget = self.limits.max_tokens_per_step
        for seq in self.waiting:
            budget -= seq.num_uncomputed
            if budget <= 0:
                return True
        return False

    def schedule(self) -> StepPlan:
        self._expire_deadlines()
        plan = StepPlan()
        if self.speculation is not None:
            self.speculation.plan(self.running, self.limits.max_tokens_per_step, self.max_tokens_per_question)
        budget = self._schedule_running(plan, self.limits.max_tokens_per_step)
        if not plan.preempted and not self.lingering:
            self._admit(plan, budget)
        self._schedule_lingering(plan, budget)  # admission is off while anyone lingers: budget is still ours
        return plan

    def update(self, plan: StepPlan, sampled: list[int]) -> list[tuple[Sequence, int]]:
        """Record what the forward computed and drew; returns (question, new token) pairs."""
        tokens = iter(sampled)
        new_tokens: list[tuple[Sequence, int]] = []
        for chunk in plan.chunks:
            seq = chunk.seq
            drawn = [next(tokens) for _ in range(chunk.num_sample_rows)]
            seq.verified = None  # this forward's audit record carried it
            if chunk.draft:
                self._stepped(seq, len(plan.chunks))  # one forward, however many tokens it emits
                self.speculation.settle(chunk, drawn, self.pool, lambda t, s=seq: self._emit(s, t, new_tokens))
                name_filled_blocks(self.pool, seq)
                continue
            seq.num_computed_tokens += chunk.length
            name_filled_blocks(self.pool, seq)
            if not chunk.sample:
                continue
            token = drawn[0]
            if seq.status.finished:  # lingering (early_stop=False): computed, never answered
                seq.token_ids.append(token)
                continue
            self._stepped(seq, len(plan.chunks))
            self._emit(seq, token, new_tokens)
        return new_tokens

    def _stepped(self, seq: Sequence, batch_size: int) -> None:
        self.num_question_steps += 1
        seq.steps += 1
        seq.batch_sizes.append(batch_size)

    def _emit(self, seq: Sequence, token: int, new_tokens: list) -> None:
        seq.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = self.clock()
        new_tokens.append((seq, token))
        self._check_limits(seq, token)

    def finish(self, seq: Sequence, status: Status) -> None:
        """End a question now; its blocks go back to the pool this step (unless early_stop is off)."""
        if seq.status.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            heapq.heappush(self._free_channels, seq.channel)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.finished_at = self.clock()
        seq.audit_blocks = tuple(seq.block_ids)
        if self.speculation is not None:
            self.speculation.forget(seq)
        if self.limits.early_stop or not seq.block_ids:
            self.pool.release(seq.question_id, seq.block_ids)
        else:
            self.lingering.append(seq)
        self._finished.append(seq)

    def take_finished(self) -> list[Sequence]:
        done, self._finished = self._finished, []
        return done

    @property
    def has_work(self) -> bool:
        """Something to compute, or an ending (cancel, timeout) not yet reported."""
        return bool(self.running or self.waiting or self.lingering or self._finished)

    # -- helpers ---------------------------------------------------------------------------------
    def _draft(self, seq: Sequence, length: int, budget: int, behind: int) -> tuple[int, ...]:
        if self.speculation is None or length != 1:
            return ()
        return self.speculation.draft(seq, budget, behind, self.pool, self.max_tokens_per_question)

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        self.running.sort(key=_keep_order)
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            # Leave a token for every question behind this one: a long prefill never stalls their decodes.
            behind = len(self.running) - 1 - self.running.index(seq)
            length = self._chunk_length(seq, max(1, budget - behind))
            if not length:  # its next prompt chunk needs more of the step than is left
                continue
            draft = self._draft(seq, length, budget - behind, behind)
            if draft:
                plan.chunks.append(self._chunk(seq, length, draft))
                budget -= length + len(draft)
            elif self._reserve(seq, length, plan):
                plan.chunks.append(self._chunk(seq, length))
                budget -= length
        return budget

    def _reserve(self, seq: Sequence, length: int, plan: StepPlan) -> bool:
        """Find blocks for `length` more tokens, preempting the least important question if needed."""
        while not self.pool.grow(seq.question_id, seq.block_ids, seq.num_computed_tokens + length):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        # Recompute, not swap: the question drops its cache and re-prefills prompt + output later.
        self.running.remove(seq)
        heapq.heappush(self._free_channels, seq.channel)
        self.pool.release(seq.question_id, seq.block_ids)
        seq.num_computed_tokens = seq.num_registered = seq.overtaken = 0
        seq.status = Status.PREEMPTED
        self.waiting.append(seq)
        plan.preempted.append(seq)
        self.num_preemptions += 1

    def _admit(self, plan: StepPlan, budget: int) -> None:
        blocked: list[Sequence] = []  # waiting questions that did not fit this step
        in_flight = blocks_in_flight(self.running)
        for seq in admission_order(self.waiting, self.running, self.limits.policy, self.limits.length_aware):
            if budget <= 0 or len(self.running) >= self.limits.max_running or not self.pool.num_free:
                return
            if seq.awaits_adapter and not (self.adapter_slot and self.adapter_slot(seq)):
                continue  # every resident adapter is held by a question in flight: it waits for one to be let go
            cached = cached_blocks(self.pool, seq)
            if awaits_prefix(self.pool, seq, cached, in_flight):
                continue  # its next block is being computed right now: read it soon rather than compute it too
            chunk = self._try_admit(seq, budget, cached)
            if chunk is None:
                blocked.append(seq)
                if seq.overtaken >= self.limits.max_overtakes:
                    return  # passed over often enough: nobody behind it goes first any more
                continue
            for waiting in blocked:
                waiting.overtaken += 1
            plan.chunks.append(chunk)
            budget -= chunk.length
            in_flight |= blocks_in_flight([seq])

    def _try_admit(self, seq: Sequence, budget: int, cached: list[int]) -> Chunk | None:
        """Admit `seq` with its first chunk if the pool has room for it, reading the `cached` blocks."""
        seq.num_computed_tokens = len(cached) * self.pool.block_size
        length = self._chunk_length(seq, budget)
        if not length:  # its first chunk needs more of the step than is left
            seq.num_computed_tokens = 0
            return None
        needed = self.pool.blocks_for(seq.num_computed_tokens + length) - len(cached)
        if seq.status == Status.PREEMPTED:
            # Back only with room for all it had plus a block per running question: re-admitting it
            # into a pool that cannot hold it would preempt it (or a neighbour) again at once.
            needed = max(needed, self.pool.blocks_for(seq.num_tokens) - len(cached) + len(self.running))
        if needed > self.pool.num_free - self.pool.idle_among(cached):
            seq.num_computed_tokens = 0
            return None
        self.pool.share(seq.question_id, seq.block_ids, cached)
        if not self.pool.grow(seq.question_id, seq.block_ids, seq.num_computed_tokens + length):
            raise RuntimeError(f"{seq.question_id}: the pool refused blocks it said it had")
        seq.num_registered = len(cached)
        seq.admitted_from = seq.num_computed_tokens
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        seq.channel = heapq.heappop(self._free_channels)
        if seq.admitted_at is None:  # a fake clock may read 0.0
            seq.admitted_at = self.clock()
            seq.cached_prompt_tokens = seq.num_computed_tokens
            self.prompt_tokens_admitted += seq.num_prompt_tokens
            self.cached_tokens_admitted += seq.num_computed_tokens
        self.running.append(seq)
        return self._chunk(seq, length)

    def shared_prefix(self, seq: Sequence) -> list[bytes]:
        """The chain of `seq`'s leading cached blocks (read-only, shareable), for the isolation audit."""
        return shared_chain(self.pool, seq)

    def _schedule_lingering(self, plan: StepPlan, budget: int) -> None:
        if not self.lingering:
            return
        if not self.running:  # the static batch has drained: now everyone leaves
            for seq in self.lingering:
                self.pool.release(seq.question_id, seq.block_ids)
            self.lingering.clear()
            return
        for seq in self.lingering:
            length = self._chunk_length(seq, budget)
            if length > 0 and seq.num_tokens < self.max_tokens_per_question and self.pool.grow(
                    seq.question_id, seq.block_ids, seq.num_computed_tokens + length):
                plan.chunks.append(self._chunk(seq, length))
                budget -= length

    def _chunk_length(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step within `budget`; 0 when its next chunk does not fit."""
        length = min(seq.num_uncomputed, budget)
        if self.limits.split_roles:
            prompt_left = seq.num_prompt_tokens - seq.num_computed_tokens
            length = min(length, prompt_left if prompt_left > 0 else 1)
        elif self.limits.prompt_chunk and seq.num_uncomputed > 1:
            length = on_grid(seq.num_computed_tokens, seq.num_tokens, length, self.limits.prompt_chunk)
        return length

    def _chunk(self, seq: Sequence, length: int, draft: tuple[int, ...] = ()) -> Chunk:
        start = seq.num_computed_tokens
        return Chunk(seq=seq, start=start, length=length + len(draft), sample=start + length == seq.num_tokens,
                     draft=draft)

    def _check_limits(self, seq: Sequence, token: int) -> None:
        if token in seq.params.stop_token_ids:
            self.finish(seq, Status.STOPPED)
        elif len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.max_tokens_per_question:
            self.finish(seq, Status.LENGTH)

    def _expire_deadlines(self) -> None:
        now = self.clock()
        for seq in self.running + self.waiting:
            if seq.deadline is not None and now >= seq.deadline:
                if seq.awaits_adapter:  # never computed: the answer says why it is empty
                    seq.error = (f"the question's deadline passed while it waited for adapter {seq.adapter!r} to "
                                 f"get a resident slot (adapters.max_resident, every one in use)")
                elif seq.admitted_at is None:
                    seq.error = "the question's deadline passed while it waited for a place in the batch"
                self.finish(seq, Status.TIMEOUT)


def _keep_order(seq: Sequence) -> tuple:
    # Most important first; preemption takes from the end (lowest priority, then newest).
    return (-seq.priority, seq.arrival)

