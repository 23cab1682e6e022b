"""The engine's knobs. Those kev.yaml has are declared there (schemas/config.py): each such field names
its key, takes the key's default, and `from_config` copies the key's value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from engine.sampling_defaults import Defaults
from schemas import (
    DEFAULT_CONFIG,
    AttentionBackend,
    KevConfig,
    KvDtype,
    OverflowPolicy,
    PrefixScope,
    RoutingStrategy,
    SchedulingPolicy,
    SpeculativeMethod,
    SpeculativePolicy,
    UnknownFieldsPolicy,
)
from schemas.config import TenantConfig


def _key(path: str):
    """A field that is kev.yaml's `section.key`: the schema's default, the config's value."""
    return field(default=_read(DEFAULT_CONFIG, path), metadata={"key": path})


def _read(cfg: KevConfig, path: str):
    section, key = path.split(".")
    return getattr(getattr(cfg, section), key)


@dataclass(frozen=True)
class EngineOptions:
    max_parallel_queries: int = _key("router.max_parallel_queries")  # questions decoded together
    capacity_tokens: int | None = _key("kv_cache.capacity_tokens")  # past it: finish_reason "length"
    max_context: int = _key("core.max_context")  # positions one question may reach, prompt included
    block_size: int = _key("kv_cache.block_size")  # tokens per KV block (flash-attn's paged kernels: a multiple of 256)
    num_blocks: int | None = _key("kv_cache.num_blocks")  # KV pool size; None = from kv_budget_bytes / free memory
    kv_budget_bytes: int | None = _key("kv_cache.memory_budget_bytes")
    memory_fraction: float = _key("kv_cache.memory_fraction")  # of free GPU memory, when no budget is given
    max_tokens_per_step: int = _key("scheduler.max_tokens_per_step")  # one forward's tokens (chunked prefill beyond)
    prompt_chunk_tokens: int = _key("scheduler.prompt_chunk_tokens")  # prompt chunks end on this grid (0: anywhere)
    batch_window_ms: float = _key("scheduler.batch_window_ms")  # wait this long for company when the batch is empty
    policy: SchedulingPolicy = _key("scheduler.policy")  # fair (each principal its share) | fcfs | ...
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict)  # kev.yaml `tenants`: weights and quotas
    overflow_policy: OverflowPolicy = _key("router.overflow_policy")
    max_waiting: int = _key("router.max_waiting")
    length_aware: bool = _key("scheduler.length_aware_grouping")
    early_stop: bool = _key("scheduler.early_stop")  # evict a finished question the step it ends
    deterministic: bool = _key("isolation.deterministic")  # bitwise-identical logits whatever shares the forward
    prefix_caching: bool = False  # isolation.level system_prefix or shared: reuse cached full prompt blocks
    prefix_system_only: bool = False  # isolation.level system_prefix: only blocks inside the prompt's system part
    prefix_scope: PrefixScope = _key("isolation.prefix_scope")  # tenant: a prefix serves its own tenant only
    kv_dtype: KvDtype = _key("kv_cache.dtype")  # auto | compute | fp16 | int8 (schemas/config.py)
    attention: AttentionBackend = _key("core.attention")  # auto | flash-attn | sdpa (engine/kernels/backend.py)
    audit: bool = False  # log a `forward.mask` summary per forward (isolation.debug or logging.level: debug)
    debug: bool = _key("isolation.debug")  # add the token-level routing table to each summary
    max_loras: int = _key("adapters.max_resident")  # resident at once; idle ones evicted least recently used first
    worker: str = "kev"
    default_timeout_ms: int | None = None  # deadline for questions that set none; from_config: aggregator.timeout_ms
    routing_strategy: RoutingStrategy = _key("router.strategy")  # the routing bucket recorded in each audit
    routing_buckets: int = _key("router.buckets")
    channel_pool_size: int | None = _key("router.channel_pool_size")  # see max_in_flight
    normalize: bool = _key("router.normalize")  # user text cleaned up before tokenizing (engine/normalization.py)
    unknown_fields: UnknownFieldsPolicy = _key("intake.unknown_fields")  # ignore | report (in the audit) | reject
    grammar_cache_size: int = _key("structured.cache_size")  # compiled response_format grammars kept (LRU)
    compiles_per_principal: int = 2  # response_format compiles one principal may hold at once (compile_budget.py)
    speculative: SpeculativeMethod = _key("speculative.method")  # off | ngram | draft_model (docs/speculative.md)
    draft_model: str | None = _key("speculative.draft_model")  # draft_model: a model Kev loads, same tokenizer
    draft_layers: int | None = _key("speculative.draft_layers")  # draft_model: the first N layers only
    max_draft_tokens: int = _key("speculative.max_draft_tokens")  # drafts verified per question per step
    ngram_min: int = _key("speculative.ngram_min")
    ngram_max: int = _key("speculative.ngram_max")
    speculative_policy: SpeculativePolicy = _key("speculative.policy")  # auto | always
    defaults: Defaults = field(default_factory=Defaults)  # KEV_TEMPERATURE etc. are read by the config loader alone

    @property
    def max_in_flight(self) -> int:
        """The channel pool: questions a worker holds at once, in the batch or waiting for a channel there."""
        return self.channel_pool_size or 2 * self.max_parallel_queries

    @classmethod
    def from_config(cls, cfg: KevConfig, worker: str = "kev") -> "EngineOptions":
        """Map a schemas.KevConfig onto the engine's options."""
        keyed = {f.name: _read(cfg, f.metadata["key"]) for f in fields(cls) if "key" in f.metadata}
        return cls(
            **keyed,
            prefix_caching=cfg.isolation.level != "strict",
            prefix_system_only=cfg.isolation.level == "system_prefix",
            audit=cfg.isolation.debug or cfg.logging.level == "debug",
            worker=worker,
            default_timeout_ms=cfg.aggregator.timeout_ms,
            tenants=cfg.tenants,
            defaults=Defaults.from_config(cfg.sampling),
        )
