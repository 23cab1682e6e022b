"""The small types that cross between the Kafka loops and the engine actor, and the header names.

Questions go to the engine as `Inbound`; the engine answers with `Outbound`, which carries the
`Inbound` back so the publisher knows which source offset the answer settles, whose question it was
(its principal) and which attempt at it this is. A `QuestionKey` is what makes two records the same
question: the same principal, question_id and sample.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from schemas import ANONYMOUS, AnswerDelta, AnswerEvent, Principal, QuestionEvent

# Headers on every answer and delta.
HEADER_SCHEMA = "schema"
HEADER_CONTENT_TYPE = "content-type"
HEADER_QUESTION_ID = "question_id"
HEADER_REQUEST_ID = "request_id"
HEADER_PRINCIPAL = "principal"  # str(Principal): "<verified key id>/<tenant>", or "unsigned/-"
CONTENT_TYPE_JSON = b"application/json"

# Headers added to a dead letter (its value, key and original headers are kept unchanged).
HEADER_DLQ_REASON = "dlq.reason"
HEADER_DLQ_MESSAGE = "dlq.message"
HEADER_DLQ_TOPIC = "dlq.source.topic"
HEADER_DLQ_PARTITION = "dlq.source.partition"
HEADER_DLQ_OFFSET = "dlq.source.offset"
HEADER_DLQ_REPLY_TOPIC = "dlq.reply_topic"  # on an answer its reply topic could not take: where it was going


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


class QuestionKey(NamedTuple):
    """One question as deduplication sees it: a redelivery has the same key (and the same bytes)."""

    principal: Principal
    question_id: str
    sample: int = 0  # which of the question's samples (exactly-once keys each on its own); one for now


def new_attempt() -> str:
    """An id for one worker's attempt at a question: 64 random bits, in hex."""
    return uuid.uuid4().hex[:16]


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
    # This delivery's attempt at the question: its deltas and answer carry it. A question redelivered (to
    # this worker or another) is a new Inbound, so a new attempt, and may stream different text.
    attempt: str = field(default_factory=new_attempt)

    @property
    def position(self) -> Position:
        return Position(self.topic, self.partition, self.offset)

    @property
    def key(self) -> QuestionKey:
        return QuestionKey(self.principal, self.question.question_id)


@dataclass(frozen=True, slots=True)
class Outbound:
    """What the engine sends back: a final answer (settles `source`) or a streaming delta (does not)."""

    event: AnswerEvent | AnswerDelta
    source: Inbound

    @property
    def final(self) -> bool:
        return isinstance(self.event, AnswerEvent)
