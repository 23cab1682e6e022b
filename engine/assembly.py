"""What EngineCore is built from its options: the attention backend (chosen once and logged), the KV
block size that backend can use, and the scheduler's limits. The kev.yaml knobs arrive here under
their EngineOptions names."""

from __future__ import annotations

import structlog

from engine.kernels.backend import BackendChoice, choose_attention, log_choice, tf32_matmul
from engine.kernels.flash import flash_installed
from engine.kernels.rowwise import RowwiseAttention
from engine.kv.cache import cache_dtype
from engine.options import EngineOptions
from engine.schedule.scheduler import SchedulerLimits
from engine.schedule.tenants import Tenants

log = structlog.get_logger("kev.engine")


def pick_attention(model, options: EngineOptions, given) -> BackendChoice:
    """The backend choice, logged once; raises BackendRefused before any memory is taken."""
    choice = choose_attention(device=model.device.type, dtype=model.dtype, kv_dtype=options.kv_dtype,
                              deterministic=options.deterministic, requested=options.attention,
                              flash_installed=flash_installed(), tf32=tf32_matmul())
    if given is not None:  # a test or bench names its backend: only the slow paths of dtype and cache remain
        kept = tuple(slow for slow in choice.slow_paths if slow.name != "flash_attn_missing")
        choice = BackendChoice(given.name, "given by the caller", kept)
    log_choice(choice, model.device, model.dtype, options.kv_dtype, options.deterministic,
               kv_stored=cache_dtype(options.kv_dtype, model))
    return choice


def scheduler_limits(options: EngineOptions, model_positions: int, attention=None) -> SchedulerLimits:
    """`attention`: the runner's backend; a prompt grid only where prompts attend by calls whose shapes follow
    the chunk (SDPA, flash-attn), not where every row attends as a decode (RowwiseAttention)."""
    return SchedulerLimits(
        max_parallel_queries=options.max_parallel_queries,
        max_tokens_per_step=options.max_tokens_per_step,
        prompt_chunk_tokens=min(options.prompt_chunk_tokens, options.max_tokens_per_step),
        max_context=min(options.max_context, model_positions),  # past the rotary table there is no position
        capacity_tokens=options.capacity_tokens,
        max_waiting=options.max_waiting,
        batch_window_s=options.batch_window_ms / 1000,
        policy=options.policy,
        tenants=Tenants(options.tenants),
        overflow=options.overflow_policy,
        length_aware=options.length_aware,
        early_stop=options.early_stop,
        split_roles=options.deterministic,
        # Fixed tiles and row-wise attention read every row's keys alike whatever the chunk: cut anywhere.
        chunk_grid=0 if options.deterministic or isinstance(attention, RowwiseAttention)
        else min(options.prompt_chunk_tokens, options.max_tokens_per_step),
    )


def block_size_for(options: EngineOptions, attention) -> int:
    needs = getattr(attention, "block_size_multiple", 1)
    if options.block_size % needs:
        log.info("kv.block_size_adjusted", configured=options.block_size, used=needs, backend=attention.name)
        return needs
    return options.block_size
