"""What a publish failure means, and records cut to fit the producer's size limit.

Three kinds of failure, three outcomes (consumers/publisher.py acts on them):
- transient (the broker is away, a leader moves, a request timed out): send the same record again
  with backoff, within a bounded time;
- the record's own (too large, an illegal or forbidden topic, a value that cannot be encoded): end
  that record's question another way (an error answer, the answers topic, a dead letter) and go on;
- anything else, or a transient one past its time: the worker cannot go on; `PublishFailed`.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import msgspec
from aiokafka.errors import (
    BrokerNotAvailableError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from schemas import AnswerEvent

# Room kept below max_request_size for what the estimate does not see (a batch's own header, a
# broker that counts a little differently).
SIZE_HEADROOM = 1024
CUT_REQUEST_ID_CHARS = 256  # a request_id that alone would not fit is cut to this
DEFAULT_MAX_REQUEST_SIZE = 1_048_576  # aiokafka's default for max_request_size

# aiokafka marks retriable what its own sender retries; a timeout (the broker away for longer than
# request_timeout_ms) and an unreachable broker are transient for us too: the broker may come back.
_TRANSIENT = (KafkaTimeoutError, KafkaConnectionError, BrokerNotAvailableError)
_RECORD_LEVEL = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError, InvalidMessageError,
                 CorruptRecordException, InvalidTimestampError, InvalidTopicError, TopicAuthorizationFailedError,
                 PolicyViolationError, UnsupportedForMessageFormatError)
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)


class PublishFailed(RuntimeError):
    """A record could not be published and nothing else can end its question: the worker must stop."""


def is_transient(error: BaseException) -> bool:
    return isinstance(error, _TRANSIENT) or (isinstance(error, KafkaError) and error.retriable)


def is_record_level(error: BaseException) -> bool:
    """A failure of this record alone: another record (an error answer, a dead letter) may still go."""
    if isinstance(error, _RECORD_LEVEL):
        return True
    # Not Kafka's at all: the value could not be encoded or sent as given (aiokafka asserts on arguments).
    return not isinstance(error, KafkaError) and isinstance(error, (msgspec.EncodeError, TypeError, ValueError,
                                                                     AssertionError, UnicodeError))


def is_too_large(error: BaseException) -> bool:
    return isinstance(error, _TOO_LARGE)


def record_size(key: bytes | None, value: bytes | None, headers) -> int:
    """What aiokafka compares with max_request_size before it accepts a record."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)


def cut_answer(answer: AnswerEvent, size_of: Callable[[AnswerEvent], int], limit: int) -> AnswerEvent | None:
    """`answer` as is if its record (`size_of`) is within `limit`, else with its text and token ids cut
    (and `truncated` set) so that it is; failing that with its request_id cut too. None: nothing fits."""
    if size_of(answer) <= limit:
        return answer
    bare = _cut(answer, 0.0)
    if size_of(bare) > limit:
        if answer.request_id is None or len(answer.request_id) <= CUT_REQUEST_ID_CHARS:
            return None
        bare = msgspec.structs.replace(bare, request_id=answer.request_id[:CUT_REQUEST_ID_CHARS])
        return bare if size_of(bare) <= limit else None
    low, high = 0.0, 1.0  # the largest share of text and tokens that fits, to about 1 in 10^5
    for _ in range(17):
        middle = (low + high) / 2
        low, high = (middle, high) if size_of(_cut(answer, middle)) <= limit else (low, middle)
    return _cut(answer, low)


def _cut(answer: AnswerEvent, keep: float) -> AnswerEvent:
    text, tokens = answer.text, answer.token_ids
    return msgspec.structs.replace(answer, text=text[:int(len(text) * keep)],
                                   token_ids=tokens[:int(len(tokens) * keep)], truncated=True)


class Retries:
    """Backoff from 0.2 s doubling to 5 s, until `budget_s` after the first failure."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.attempts = 0
        self._began: float | None = None

    def elapsed(self) -> float:
        return 0.0 if self._began is None else anyio.current_time() - self._began

    def exhausted(self) -> bool:
        if self._began is None:
            self._began = anyio.current_time()
        return self.elapsed() >= self.budget_s

    async def wait(self) -> None:
        delay = min(5.0, 0.2 * 2 ** self.attempts, max(0.0, self.budget_s - self.elapsed()))
        self.attempts += 1
        await anyio.sleep(delay)


def short_error(error: BaseException) -> str:
    name, said = type(error).__name__, str(error)
    text = said if said.startswith(name) else f"{name}: {said}"  # aiokafka's errors name themselves
    return text if len(text) <= 300 else text[:297] + "..."
