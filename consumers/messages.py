"""The small types that cross between the Kafka loops and the engine actor, and the header names.

Questions go to the engine as `Inbound`; the engine answers with `Outbound`, which carries the
`Inbound` back so the publisher knows which source offset the answer settles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from schemas import ANONYMOUS, AnswerDelta, AnswerEvent, Principal, QuestionEvent

# Headers on every answer and delta.
HEADER_SCHEMA = "schema"
HEADER_CONTENT_TYPE = "content-type"
HEADER_QUESTION_ID = "question_id"
HEADER_REQUEST_ID = "request_id"
CONTENT_TYPE_JSON = b"application/json"

# Headers added to a dead letter (its value, key and original headers are kept unchanged).
HEADER_DLQ_REASON = "dlq.reason"
HEADER_DLQ_MESSAGE = "dlq.message"
HEADER_DLQ_TOPIC = "dlq.source.topic"
HEADER_DLQ_PARTITION = "dlq.source.partition"
HEADER_DLQ_OFFSET = "dlq.source.offset"


class Partition(NamedTuple):
    """A topic partition; equal to aiokafka's TopicPartition with the same fields."""

    topic: str
    partition: int


class Position(NamedTuple):
    """One source record: the offset whose outcome must be acked before it may be committed."""

    topic: str
    partition: int
    offset: int

    @property
    def partition_key(self) -> Partition:
        return Partition(self.topic, self.partition)


@dataclass(frozen=True, slots=True)
class Inbound:
    """A valid question and where it came from; what the engine actor receives."""

    question: QuestionEvent
    topic: str
    partition: int
    offset: int
    received_at: float  # time.monotonic() when decoded, the engine's arrival clock (its timings)
    # The record's timestamp (ms since the epoch; CreateTime unless the topic uses LogAppendTime): the
    # question's deadline counts from it, capped at "now" so a future stamp cannot extend it. None: none.
    published_ms: int | None = None
    principal: Principal = ANONYMOUS  # who asked: the verified signing key and the tenant (schemas/principal.py)

    @property
    def position(self) -> Position:
        return Position(self.topic, self.partition, self.offset)


@dataclass(frozen=True, slots=True)
class Outbound:
    """What the engine sends back: a final answer (settles `source`) or a streaming delta (does not)."""

    event: AnswerEvent | AnswerDelta
    source: Inbound

    @property
    def final(self) -> bool:
        return isinstance(self.event, AnswerEvent)
