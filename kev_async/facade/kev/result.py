"""Result: one query's answer under seed 002's names, with Kev's whole AnswerEvent beside them.

The seed's names live here only; the wire keeps Kev's (one name per field): channel_id is
audit.channel, elapsed_ms timings.e2e_ms, tokens usage.completion_tokens, hash_bucket
audit.routing_bucket, started_at and ended_at timings.started_ms and timings.finished_ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from schemas import AnswerEvent


@dataclass(frozen=True)
class Result:
    slot: int  # the query's place in what was submitted (0..n-1): the aggregator's slot
    question_id: str
    channel_id: int | None
    elapsed_ms: float
    tokens: int
    text: str
    hash_bucket: int | None
    started_at: datetime | None
    ended_at: datetime | None
    finish_reason: str
    error: str | None  # "code: message" when the question got an error answer
    answer: AnswerEvent

    @classmethod
    def of(cls, answer: AnswerEvent, slot: int) -> "Result":
        return cls(
            slot=slot,
            question_id=answer.question_id,
            channel_id=answer.audit.channel,
            elapsed_ms=answer.timings.e2e_ms,
            tokens=answer.usage.completion_tokens,
            text=answer.text,
            hash_bucket=answer.audit.routing_bucket,
            started_at=_instant(answer.timings.started_ms),
            ended_at=_instant(answer.timings.finished_ms),
            finish_reason=answer.finish_reason,
            error=f"{answer.error.code}: {answer.error.message}" if answer.error else None,
            answer=answer,
        )

    def __str__(self) -> str:
        # Seed 000 prints each answer as it is (f"Q{qid}: {ans}"): its text, not a wall of fields.
        return self.text if self.error is None else f"[{self.error}]"


def _instant(epoch_ms: int | None) -> datetime | None:
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc)
