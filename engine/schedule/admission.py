"""Admission: which waiting questions join the batch this step, each with its first chunk.

In the order the policy offers them (engine/schedule/sharing.py), each within its tenant's quotas and
holding its adapter, while the step has tokens (and prompt room), a channel is free and the pool has the
blocks; a question's cached prefix blocks are read, not computed. One that does not fit lets later ones
go first a bounded number of times (no starvation of a big one). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kv.block_pool import BlockPool
from engine.schedule.channels import Channels
from engine.schedule.chunks import Filling, chunk_length, new_chunk
from engine.schedule.limits import SchedulerLimits
from engine.schedule.prefix_chain import awaits_prefix, blocks_in_flight, cached_blocks
from engine.schedule.sharing import Sharing
from engine.sequence import Sequence, Status
from engine.step_plan import Chunk


class Admission:
    def __init__(self, pool: BlockPool, limits: SchedulerLimits, sharing: Sharing, channels: Channels,
                 adapter_slot: Callable[[Sequence], bool] | None = None) -> None:
        self.pool = pool
        self.limits = limits
        self.sharing = sharing
        self.channels = channels
        # Offered a question that waits for a resident adapter slot when its turn to be admitted comes: True
        # once it holds its adapter; False while every slot is in use (or when it ended the question).
        self.adapter_slot = adapter_slot
        self.prompt_tokens_admitted = 0  # over first admissions: the prefix cache's hit rate
        self.cached_tokens_admitted = 0

    def admit(self, step: Filling, waiting: list[Sequence], running: list[Sequence]) -> None:
        blocked: list[Sequence] = []  # waiting questions that did not fit this step
        in_flight = blocks_in_flight(running)
        for seq in self.sharing.lanes(waiting, running, self.limits.length_aware):
            if (step.budget <= 0 or len(running) >= self.limits.max_parallel_queries or not self.pool.num_free
                    or step.room.exhausted):
                return
            if not self.admissible(seq, running, step.now) or not self.sharing.may_prefill(seq):
                continue
            cached = cached_blocks(self.pool, seq)
            if awaits_prefix(self.pool, seq, cached, in_flight):
                continue  # its next block is being computed right now: read it soon rather than compute it too
            chunk = self.try_admit(seq, step, step.budget, waiting, running, cached)
            if chunk is None:
                blocked.append(seq)
                if seq.overtaken >= self.limits.max_overtakes:
                    return  # passed over often enough: nobody behind it goes first any more
                continue
            for passed in blocked:
                passed.overtaken += 1
            step.add(chunk)
            in_flight |= blocks_in_flight([seq])

    def admissible(self, seq: Sequence, running: list[Sequence], now: float) -> bool:
        """Within its tenant's quotas (else it waits: its throttled time runs) and holding its adapter."""
        if not self.sharing.admits(seq, running, now):
            return False
        # Every resident adapter held by a question in flight: it waits for one to be let go.
        return not seq.awaits_adapter or bool(self.adapter_slot and self.adapter_slot(seq))

    def fits_step(self, seq: Sequence, step: Filling, budget: int) -> bool:
        """Whether the step has the tokens (and prompt room) for `seq`'s first chunk, were it admitted."""
        return budget > 0 and not step.room.exhausted and chunk_length(seq, budget, self.limits, step.room) > 0

    def try_admit(self, seq: Sequence, step: Filling, budget: int, waiting: list[Sequence],
                  running: list[Sequence], cached: list[int] | None = None) -> Chunk | None:
        """Admit `seq` with its first chunk (at most `budget` tokens) if the pool has room for it, reading
        its `cached` prefix blocks; None when it does not fit."""
        cached = cached_blocks(self.pool, seq) if cached is None else cached
        seq.num_computed_tokens = len(cached) * self.pool.block_size
        length = chunk_length(seq, budget, self.limits, step.room)
        if not length or not self._room_for(seq, length, cached, len(running)):
            seq.num_computed_tokens = 0
            return None
        self.pool.share(seq.question_id, seq.block_ids, cached)
        if not self.pool.grow(seq.question_id, seq.block_ids, seq.num_computed_tokens + length):
            raise RuntimeError(f"{seq.question_id}: the pool refused blocks it said it had")
        seq.num_registered = len(cached)
        seq.admitted_from = seq.num_computed_tokens
        waiting.remove(seq)
        seq.status = Status.RUNNING
        seq.channel = self.channels.take()
        if seq.admitted_at is None:  # a fake clock may read 0.0
            self._first_admission(seq, step.now)
        running.append(seq)
        return new_chunk(seq, length)

    def _room_for(self, seq: Sequence, length: int, cached: list[int], num_running: int) -> bool:
        needed = self.pool.blocks_for(seq.num_computed_tokens + length) - len(cached)
        if seq.status == Status.PREEMPTED:
            # Back only with room for all it had plus a block per running question: re-admitting it
            # into a pool that cannot hold it would preempt it (or a neighbour) again at once.
            needed = max(needed, self.pool.blocks_for(seq.num_tokens) - len(cached) + num_running)
        return needed <= self.pool.num_free - self.pool.idle_among(cached)

    def _first_admission(self, seq: Sequence, now: float) -> None:
        seq.admitted_at = now
        seq.cached_prompt_tokens = seq.num_computed_tokens
        self.prompt_tokens_admitted += seq.num_prompt_tokens
        self.cached_tokens_admitted += seq.num_computed_tokens
        self.sharing.admitted(seq, now)
