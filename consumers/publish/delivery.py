"""What a publish failure means, and records cut to fit the producer's size limit.

What to do after a failed publish (`decide`; consumers/publish/failed_records.py acts on it):
- transient (the broker is away, a leader moves, a request timed out): send the same record again
  with backoff, within a window counted from the record's first send (`Retries`); on a caller's reply
  topic the window is the question's deadline, then the record's fallback ends the question (a dead
  letter without the answer's text: nothing of a signed question goes to a topic others read);
- the record's own (too large, a value that cannot be encoded, a timestamp the broker refuses on a
  forwarded record): end that record's question another way (an error answer, a dead letter) and go on;
- a reply topic the broker refuses (forbidden, illegal, unknown after retries): the record's fallback,
  and that topic's next records go to their fallback at once for a while (never to another topic);
- the fleet's own topic refused (answers, dead letters, deltas, questions), a transient failure past
  its window, anything else: the worker cannot go on; `PublishFailed`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import anyio
import msgspec
from aiokafka.errors import (
    BrokerNotAvailableError,
    InvalidTimestampError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnknownTopicOrPartitionError,
)
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from schemas import AnswerEvent

# Room kept below max_request_size for what the estimate does not see (a batch's own header, a
# broker that counts a little differently).
SIZE_HEADROOM = 1024

# aiokafka marks retriable what its own sender retries; a timeout (the broker away for longer than
# request_timeout_ms) and an unreachable broker are transient for us too: the broker may come back.
_TRANSIENT = (KafkaTimeoutError, KafkaConnectionError, BrokerNotAvailableError)
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)


class PublishFailed(RuntimeError):
    """A record could not be published and nothing else can end its question: the worker must stop."""


class Next(enum.Enum):
    RETRY = "retry"  # send the same record again, after a backoff
    FALLBACK = "fallback"  # the record's fallback ends its question (an error answer, a dead letter)
    AVOID_TOPIC = "avoid_topic"  # the reply topic refused: fallback, and its next records fall back at once for a while
    FAIL = "fail"  # PublishFailed: the worker cannot go on


def decide(error: BaseException, *, reply: bool, exhausted: bool, own_timestamp: bool = False) -> Next:
    """What follows a failed publish. `reply`: the record is on a caller's reply topic; `exhausted`: its
    retry window is spent; `own_timestamp`: it carries a timestamp of its own (a forwarded question)."""
    if is_transient(error) and not exhausted:
        return Next.RETRY
    if is_own_fault(error, own_timestamp=own_timestamp):
        return Next.FALLBACK  # this record alone: another one (an error answer, a dead letter) can still go
    if reply:
        if is_transient(error) and not isinstance(error, UnknownTopicOrPartitionError):
            return Next.FALLBACK  # still away at the question's deadline: this record only, the topic stays usable
        return Next.AVOID_TOPIC
    # The fleet's own topic: whatever refused this record would refuse every one after it.
    return Next.FAIL


def is_transient(error: BaseException) -> bool:
    return isinstance(error, _TRANSIENT) or (isinstance(error, KafkaError) and error.retriable)


def is_own_fault(error: BaseException, *, own_timestamp: bool = False) -> bool:
    """A failure of this record alone, not of its topic: too large, a value that cannot be encoded or
    sent as given (aiokafka asserts on arguments), or a timestamp the record brought with it."""
    if is_too_large(error) or (own_timestamp and isinstance(error, InvalidTimestampError)):
        return True
    return not isinstance(error, KafkaError) and isinstance(error, (msgspec.EncodeError, TypeError, ValueError,
                                                                     AssertionError, UnicodeError))


def is_too_large(error: BaseException) -> bool:
    return isinstance(error, _TOO_LARGE)


def record_size(key: bytes | None, value: bytes | None, headers) -> int:
    """What aiokafka compares with max_request_size before it accepts a record."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)


def cut_answer(answer: AnswerEvent, size_of: Callable[[AnswerEvent], int], limit: int) -> AnswerEvent | None:
    """`answer` as is if its record (`size_of`) is within `limit`, else with its text and token ids cut
    (and `truncated` set) so that it is. None: not even its ids fit (they are bounded by the schema, so
    only a `max_request_size` of a few KB gets here)."""
    if size_of(answer) <= limit:
        return answer
    if size_of(_cut(answer, 0.0)) > limit:
        return None
    low, high = 0.0, 1.0  # the largest share of text and tokens that fits, to about 1 in 10^5
    for _ in range(17):
        middle = (low + high) / 2
        low, high = (middle, high) if size_of(_cut(answer, middle)) <= limit else (low, middle)
    return _cut(answer, low)


def _cut(answer: AnswerEvent, keep: float) -> AnswerEvent:
    """The same share of text and tokens kept; logprobs (params.logprobs) stay one per kept token."""
    text, tokens = answer.text, answer.token_ids
    kept = int(len(tokens) * keep)
    logprobs = None if answer.logprobs is None else answer.logprobs[:kept]
    return msgspec.structs.replace(answer, text=text[:int(len(text) * keep)], token_ids=tokens[:kept],
                                   logprobs=logprobs, truncated=True)


class Retries:
    """One record's retry window, counted from its first send (not its first failure), so an answer
    the broker never acks ends the worker `budget_s` after it was sent. Backoff from 0.2 s doubling
    to 5 s. The window is shared by the records that replace a refused one (same question)."""

    def __init__(self, budget_s: float, began: float | None = None) -> None:
        self.budget_s = budget_s
        self.began = anyio.current_time() if began is None else began
        self.attempts = 0

    def elapsed(self) -> float:
        return anyio.current_time() - self.began

    def left(self, budget_s: float | None = None) -> float:
        return max(0.0, (self.budget_s if budget_s is None else budget_s) - self.elapsed())

    def exhausted(self, budget_s: float | None = None) -> bool:
        return self.left(budget_s) <= 0.0

    async def wait(self, budget_s: float | None = None) -> None:
        delay = min(5.0, 0.2 * 2 ** self.attempts, self.left(budget_s))
        self.attempts += 1
        await anyio.sleep(delay)


def short_error(error: BaseException) -> str:
    name, said = type(error).__name__, str(error)
    text = said if said.startswith(name) else f"{name}: {said}"  # aiokafka's errors name themselves
    return text if len(text) <= 300 else text[:297] + "..."
