"""kev.yaml's `kafka` section: the broker, the topics, delivery, and the records' security, trust and limits.

Part of the kev.yaml schema (schemas/config.py); every key defaulted.
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
)
from schemas.config_section import Positive, Section

EMBEDDED_BROKER = "embedded"  # kafka.bootstrap_servers: start the broker inside Kev


class SecurityConfig(Section):
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


class TrustConfig(Section):
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


class LimitsConfig(Section):
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


class KafkaConfig(Section):
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
