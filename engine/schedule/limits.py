"""SchedulerLimits: the engine's options as the scheduler reads them (engine/core.py maps them across).

A limit's default is its kev.yaml key's (schemas/config.py), under the key's name; split_roles,
chunk_grid and max_overtakes exist only here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.schedule.tenants import Tenants
from schemas import DEFAULT_CONFIG, OverflowPolicy, SchedulingPolicy

_CFG = DEFAULT_CONFIG


@dataclass(frozen=True)
class SchedulerLimits:
    max_parallel_queries: int = _CFG.router.max_parallel_queries  # questions in the batch at once
    max_tokens_per_step: int = _CFG.scheduler.max_tokens_per_step  # prompt + decode tokens in one forward
    # While anyone decodes, a step's prompt rows cost at most this many fresh prompt tokens (step_budget.py)
    prompt_chunk_tokens: int = _CFG.scheduler.prompt_chunk_tokens
    max_context: int = _CFG.core.max_context  # positions a question may reach, prompt included
    capacity_tokens: int | None = _CFG.kv_cache.capacity_tokens  # KV tokens one question may hold
    max_waiting: int = _CFG.router.max_waiting  # bounded waiting queue
    batch_window_s: float = _CFG.scheduler.batch_window_ms / 1000  # wait this long for company when the batch is empty
    policy: SchedulingPolicy = _CFG.scheduler.policy
    tenants: Tenants = field(default_factory=Tenants)  # policy fair: weights; every policy: quotas
    overflow: OverflowPolicy = _CFG.router.overflow_policy
    length_aware: bool = _CFG.scheduler.length_aware_grouping  # admit questions of similar prompt length together
    early_stop: bool = _CFG.scheduler.early_stop  # evict finished questions at once (False: when the batch drains)
    # Deterministic mode: a chunk never mixes prompt and generated tokens, and generated tokens go one
    # per chunk (also when recomputed after a preemption), so each token's row always takes one path.
    split_roles: bool = False
    # Default mode: a prompt chunk ends only at a multiple of this many positions or at the prompt's end,
    # so its chunks (and their attention calls) are the same whatever shares the step. 0: anywhere.
    chunk_grid: int = 0
    # A question that does not fit lets later ones that do go first, at most this many times; then
    # admission waits for it (room for small questions, no starvation of a big one).
    max_overtakes: int = 16
