"""A record the broker did not take: what the sender sends next in its place.

consumers/publish/delivery.py `decide` says what a failure means; here it becomes the next record: the same one
to retry, its fallback (consumers/publish/records.py: an error answer, a dead letter; never another topic),
nothing, or PublishFailed. A reply topic found unusable is avoided for a while (consumers/publish/reply_topics.py)
and its next records go to their fallback at once (`fail_fast`).
"""

from __future__ import annotations

import structlog

from consumers.publish.delivery import Next, PublishFailed, Retries, decide, short_error
from consumers.publish.records import Record
from consumers.publish.reply_topics import ReplyTopics, UnusableReplyTopic

log = structlog.get_logger("kev.consumers.publish.publisher")  # the publisher's lines, whichever of its modules writes them


def fail_fast(record: Record, unusable: UnusableReplyTopic) -> Record | None:
    """A record for a reply topic not to be tried now: its fallback instead (a dead letter, or nothing)."""
    say = log.debug if record.kind == "deltas" else log.warning  # a stream would say it once per delta
    say("reply_topic_unusable", kind=record.kind, topic=record.topic[:300], question_id=record.question_id,
        reason=str(unusable))
    return record.fallback(unusable) if record.fallback is not None else None


def after_failure(record: Record, error: Exception, retries: Retries, reply_topics: ReplyTopics) -> Record | None:
    """The record to send next (the same one to retry it), or None to drop it; raises PublishFailed."""
    step = decide(error, reply=record.reply, exhausted=retries.exhausted(),
                  own_timestamp=record.timestamp_ms is not None)
    if step is Next.RETRY:
        log.warning("publish_retrying", kind=record.kind, topic=record.topic[:300], question_id=record.question_id,
                    attempt=retries.attempts + 1, error=short_error(error))
        return record
    if step is Next.AVOID_TOPIC:
        reply_topics.avoid(record.topic)
    if step is not Next.FAIL and record.fallback is not None:
        avoided_s = reply_topics.avoid_s if step is Next.AVOID_TOPIC else 0
        log.warning("publish_refused", kind=record.kind, topic=record.topic[:300], question_id=record.question_id,
                    error=short_error(error), topic_avoided_s=avoided_s)
        return record.fallback(error)
    raise PublishFailed(f"cannot publish {record.kind} to topic {record.topic[:300]!r} "
                        f"({retries.elapsed():.1f}s after its first send, {retries.attempts} retries): "
                        f"{short_error(error)}") from error
