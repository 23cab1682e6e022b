"""Iteration-level scheduling: every step admits, preempts and evicts questions over a fixed block pool.

A step: questions past their deadline, or too near it to be computed, end; under policy fair a principal
below its share of the channels takes one from the most served (sharing.py, fair_share.py); running
questions get their next tokens in keep order (a decode, a draft, a prompt chunk sized so that decoding
streams do not stall: step_budget.py); then waiting questions join (admission.py). No torch, no asyncio:
plain bookkeeping, so its tests run on exact block ids.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

from engine.kv.block_pool import BlockPool
from engine.schedule.admission import Admission
from engine.schedule.batch_window import seconds_to_hold
from engine.schedule.channels import Channels
from engine.schedule.chunks import Filling, chunk_length, new_chunk
from engine.schedule.deadlines import hopeless
from engine.schedule.limits import SchedulerLimits
from engine.schedule.prefix_chain import name_filled_blocks, shared_chain
from engine.schedule.sharing import Sharing
from engine.schedule.step_budget import PromptRoom
from engine.schedule.step_cost import StepCost
from engine.sequence import Sequence, Status
from engine.step_plan import StepPlan

__all__ = ["Overloaded", "PromptTooLong", "Scheduler", "SchedulerLimits", "StepPlan"]

class Overloaded(Exception):
    """The engine cannot take this question now (overflow policy `queue` or `reject`)."""


class PromptTooLong(ValueError):
    """The prompt alone does not fit one question's context or KV capacity."""


class Scheduler:
    def __init__(self, pool: BlockPool, limits: SchedulerLimits = SchedulerLimits(),
                 clock: Callable[[], float] = time.monotonic, speculation=None,
                 adapter_slot: Callable[[Sequence], bool] | None = None) -> None:
        self.pool = pool
        self.limits = limits
        self.clock = clock
        self.speculation = speculation  # None: no speculative decoding (engine/speculate/speculation.py)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.lingering: list[Sequence] = []  # finished but kept in the batch (early_stop=False)
        self._finished: list[Sequence] = []
        self.channels = Channels(limits.max_parallel_queries)
        self.sharing = Sharing(limits.tenants, limits.policy)  # fair share, quotas, the tenants' counts
        self.admission = Admission(pool, limits, self.sharing, self.channels, adapter_slot)
        self.costs = StepCost()  # measured forwards: prompt chunks while others decode, hopeless deadlines
        self.num_preemptions = 0
        self.num_question_steps = 0  # question-forwards that emitted tokens (1 each, or 1 + kept drafts)

    @property
    def prompt_tokens_admitted(self) -> int:  # over first admissions: the prefix cache's hit rate
        return self.admission.prompt_tokens_admitted

    @property
    def cached_tokens_admitted(self) -> int:
        return self.admission.cached_tokens_admitted

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
        channels = self.limits.max_parallel_queries
        if self.limits.overflow == "reject" and len(self.running) + len(self.waiting) >= channels:
            raise Overloaded(f"all {channels} channels are busy (overflow_policy=reject)")
        if self.limits.overflow != "wait" and not self.has_room():  # under "wait" the submitter is the bound
            raise Overloaded(f"the waiting queue is full ({self.limits.max_waiting} questions)")
        seq.status = Status.WAITING
        # The audit digests the tokens of a question that may draft: its drafts' sources (engine/audit.py).
        seq.speculative = self.speculation is not None and seq.constraint is None
        self.sharing.arrive(seq)
        self.waiting.append(seq)

    def retract(self, seq: Sequence) -> None:
        """Take back a question just added and not yet admitted, as if it never came (a sibling sample of it
        was refused: a question's samples are added all or none)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.sharing.depart(seq, self.clock())

    def cancel(self, question_id: str) -> bool:
        for seq in self.running + self.waiting:
            if seq.question_id == question_id:
                self.finish(seq, Status.CANCELLED)
                return True
        return False

    # -- the step -------------------------------------------------------------------------------
    def wait_time(self) -> float | None:
        """Seconds to hold the next step (engine/schedule/batch_window.py); 0 = step now, None = idle."""
        busy = bool(self.running or self.lingering or self._finished)
        return seconds_to_hold(self.waiting, busy, self.sharing, self.limits, self.clock)

    def schedule(self) -> StepPlan:
        now = self.clock()
        self._end_hopeless(now)
        room = PromptRoom(self.limits.prompt_chunk_tokens, self.costs.key_cost,
                          any(s.decoding for s in self.running), grid=bool(self.limits.chunk_grid))
        step = Filling(self.limits.max_tokens_per_step, room, self.sharing, now)
        self.sharing.open_step(self.running, self.waiting, self.costs)
        self._rebalance(step)
        if self.speculation is not None:
            self.speculation.plan(self.running, self.limits.max_tokens_per_step, self.max_tokens_per_question)
        preempted = len(step.plan.preempted)
        self._schedule_running(step)
        if len(step.plan.preempted) == preempted and not self.lingering:  # the pool is short: nobody new comes in
            self.admission.admit(step, self.waiting, self.running)
        self._schedule_lingering(step)  # admission is off while anyone lingers: the budget is still ours
        return step.plan

    def update(self, plan: StepPlan, sampled: list[int], seconds: float | None = None) -> list[tuple[Sequence, int]]:
        """Record what the forward computed (in `seconds`, when timed) and drew; returns (question, new
        token) pairs."""
        if seconds is not None:
            self.costs.observe(plan.num_tokens, plan.num_keys, seconds)
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
            self.channels.give(seq.channel)
            self.sharing.depart(seq, self.clock())
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.sharing.depart(seq, self.clock())
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

    def shared_prefix(self, seq: Sequence) -> list[bytes]:
        """The chain of `seq`'s leading cached blocks (read-only, shareable), for the isolation audit."""
        return shared_chain(self.pool, seq)

    # -- running questions ---------------------------------------------------------------------------
    def _schedule_running(self, step: Filling) -> None:
        self.running.sort(key=self.sharing.keep_order)
        planned = {id(c.seq) for c in step.plan.chunks}
        for seq in list(self.running):
            if step.budget <= 0:
                break
            if seq.status != Status.RUNNING or id(seq) in planned:  # preempted earlier in this loop, or admitted
                continue
            if (not seq.decoding and not self.sharing.may_prefill(seq)) or not self.sharing.may_step(seq):
                continue
            # Leave a token for every question behind this one: a long prefill never stalls their decodes.
            behind = sum(id(s) not in planned for s in self.running[self.running.index(seq) + 1:])
            length = chunk_length(seq, max(1, step.budget - behind), self.limits, step.room, at_least_one=True)
            if not length:  # its next prompt chunk needs more of the step than is left
                continue
            draft = self._draft(seq, length, step.budget - behind, behind)
            if draft or self._reserve(seq, length, step.plan, planned):
                step.add(new_chunk(seq, length, draft))
            planned.add(id(seq))

    def _draft(self, seq: Sequence, length: int, budget: int, behind: int) -> tuple[int, ...]:
        if self.speculation is None or length != 1:
            return ()
        return self.speculation.draft(seq, budget, behind, self.pool, self.max_tokens_per_question)

    def _reserve(self, seq: Sequence, length: int, plan: StepPlan, planned: set[int]) -> bool:
        """Find blocks for `length` more tokens, preempting a question not yet planned if needed (itself last)."""
        while not self.pool.grow(seq.question_id, seq.block_ids, seq.num_computed_tokens + length):
            victim = max(reversed([s for s in self.running if id(s) not in planned]), key=self.sharing.victim_order)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        # Recompute, not swap: the question drops its cache and re-prefills prompt + output later.
        self.running.remove(seq)
        self.channels.give(seq.channel)
        self.pool.release(seq.question_id, seq.block_ids)
        seq.num_computed_tokens = seq.num_registered = seq.overtaken = 0
        seq.status = Status.PREEMPTED
        self.waiting.append(seq)
        plan.preempted.append(seq)
        self.num_preemptions += 1

    def _rebalance(self, step: Filling) -> None:
        """policy fair, every channel taken: a principal with waiting work, holding fewer channels than its
        share and served no more than the one holding the most per weight, takes one of its channels (its
        question cheapest to recompute) for its own next question."""
        if not self.sharing.fair_policy or len(self.running) < self.limits.max_parallel_queries:
            return
        channels = Counter(s.principal for s in self.running)
        for principal in self.sharing.hungry(self.waiting):
            while (giver := self.sharing.giver(channels, principal)) is not None:
                head = next((s for s in self.sharing.first_of(principal, self.waiting)
                             if self.admission.admissible(s, self.running, step.now)), None)
                if head is None or not self.admission.fits_step(head, step, step.budget - len(self.running)):
                    break
                self._preempt(max((s for s in self.running if s.principal == giver), key=self.sharing.victim_order),
                              step.plan)
                channels[giver] -= 1
                chunk = self.admission.try_admit(head, step, step.budget - len(self.running), self.waiting,
                                                 self.running)
                if chunk is None:
                    break  # the pool had less room than the channel: it waits its turn like anyone
                step.add(chunk)
                channels[principal] += 1

    def _schedule_lingering(self, step: Filling) -> None:
        if not self.lingering:
            return
        if not self.running:  # the static batch has drained: now everyone leaves
            for seq in self.lingering:
                self.pool.release(seq.question_id, seq.block_ids)
            self.lingering.clear()
            return
        for seq in self.lingering:
            length = chunk_length(seq, step.budget, self.limits)
            if length > 0 and seq.num_tokens < self.max_tokens_per_question and self.pool.grow(
                    seq.question_id, seq.block_ids, seq.num_computed_tokens + length):
                step.add(new_chunk(seq, length), prompt=False)

    # -- endings ---------------------------------------------------------------------------------------
    def _check_limits(self, seq: Sequence, token: int) -> None:
        if token in seq.params.stop_token_ids:
            self.finish(seq, Status.STOPPED)
        elif len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.max_tokens_per_question:
            self.finish(seq, Status.LENGTH)

    def _end_hopeless(self, now: float) -> None:
        """End questions past their deadline, and waiting ones that could not meet it even if started now."""
        for seq, error, code in hopeless(self.running + self.waiting, now, self.costs, self.limits.max_tokens_per_step):
            seq.error, seq.error_code = error or seq.error, code or seq.error_code
            self.finish(seq, Status.TIMEOUT)
