"""The engine's knobs, with defaults; `from_config` maps kev.yaml onto them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.defaults import Defaults


@dataclass(frozen=True)
class EngineOptions:
    max_batch_size: int = 32  # questions decoded together ("max_parallel_queries")
    kv_slot_capacity: int | None = None  # KV tokens one question may hold; past it: finish_reason "length"
    max_context: int = 2048  # positions one question may reach, prompt included
    block_size: int = 16  # tokens per KV block (flash-attn's paged kernels need a multiple of 256)
    num_blocks: int | None = None  # KV pool size; None = from kv_budget_bytes / free memory
    kv_budget_bytes: int | None = None
    memory_fraction: float = 0.5  # of free GPU memory, when no budget is given
    max_tokens_per_step: int = 2048  # token budget of one forward (chunked prefill beyond it)
    batch_window_ms: float = 10.0  # wait this long for company when the batch is empty
    policy: str = "fcfs"  # fcfs | shortest_prompt_first | priority
    overflow_policy: str = "queue"  # wait | queue | reject
    max_waiting: int = 1024
    length_aware: bool = False
    early_stop: bool = True  # evict a finished question the step it ends
    deterministic: bool = False  # bitwise-identical logits whatever shares the forward (slower)
    prefix_caching: bool = False  # isolation.level: shared -- reuse cached full prompt blocks
    prefix_scope: str = "tenant"  # tenant: a cached prefix serves only its own tenant (and cache_salt) | global
    kv_dtype: str = "auto"  # KV cache storage: auto (the model's dtype) | int8 (per token and head scales)
    audit: bool = False  # log a `forward.mask` summary per forward
    debug: bool = False  # add the token-level routing table to each summary
    max_loras: int = 8  # LoRA adapters resident at once; idle ones are evicted least recently used first
    worker: str = "kev"
    default_timeout_ms: int | None = None  # deadline for questions that set none (aggregator.timeout_ms)
    routing_strategy: str = "round_robin"  # the routing bucket recorded in each answer's audit
    routing_buckets: int = 64
    defaults: Defaults = field(default_factory=Defaults.from_env)

    @classmethod
    def from_config(cls, cfg, worker: str = "kev") -> "EngineOptions":
        """Map a schemas.KevConfig onto the engine's options."""
        s = cfg.sampling
        return cls(
            max_batch_size=cfg.router.max_parallel_queries,
            kv_slot_capacity=cfg.kv_cache.capacity_tokens,
            max_context=cfg.core.max_context,
            block_size=cfg.kv_cache.block_size,
            num_blocks=cfg.kv_cache.num_blocks,
            kv_budget_bytes=cfg.kv_cache.memory_budget_bytes,
            memory_fraction=cfg.kv_cache.memory_fraction,
            max_tokens_per_step=cfg.scheduler.max_tokens_per_step,
            batch_window_ms=cfg.scheduler.batch_window_ms,
            policy=cfg.scheduler.policy,
            overflow_policy=cfg.router.overflow_policy,
            max_waiting=cfg.router.max_waiting,
            length_aware=cfg.scheduler.length_aware_grouping,
            early_stop=cfg.scheduler.early_stop,
            deterministic=cfg.isolation.deterministic,
            kv_dtype=cfg.kv_cache.dtype,
            prefix_caching=cfg.isolation.level == "shared",
            prefix_scope=cfg.isolation.prefix_scope,
            audit=cfg.isolation.debug or cfg.logging.level == "debug",
            debug=cfg.isolation.debug,
            worker=worker,
            default_timeout_ms=cfg.aggregator.timeout_ms,
            routing_strategy=cfg.router.strategy,
            routing_buckets=cfg.router.channel_pool_size,
            defaults=Defaults(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              repetition_penalty=s.repetition_penalty, max_new_tokens=s.max_new_tokens,
                              seed=s.seed),
        )
