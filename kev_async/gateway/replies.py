"""This gateway instance's reply topic: one consumer reads every answer and delta sent to it and hands
each to the request waiting for that question_id.

Workers send a question's deltas and its answer to the question's `reply_topic` on one partition (the
question_id's, or with exactly_once delivery its questions partition's). One producer sends both with
at_least_once delivery, so the deltas arrive first and the answer last; with exactly_once the answer goes
in the worker's transaction and the deltas outside it, so a sample's last deltas can land after its
answer, and the stream takes the rest (text and logprobs) from the answer (streaming.py). The topic is made for this instance at start
(`kev.replies.<instance id>`) and read from its first record, so nothing sent before the consumer
caught up is missed. It is read read_committed: with `kafka.delivery: exactly_once` an answer shows
once its worker's transaction commits, and never if it aborts (the worker died; the question's next
owner answers it). The topic then has `kafka.partitions` partitions, one per questions partition,
since each has its own transactional writer (consumers/publish/transactions.py); one otherwise. An event for
a question nobody waits for (its client left) is dropped. A question redelivered to a second worker
(its first died mid-answer) streams again under the new worker's attempt id, from seq 0: a stream
relays the deltas of the first attempt it sees, in seq order, and drops every other attempt's. Whether
the final answer extends what was relayed is the stream's to check (streaming.py): two attempts'
texts are never spliced.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import contextmanager

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from consumers import create_topics
from consumers.kafka_client.clients import fetch, open_consumer
from consumers.kafka_client.record_guard import unreadable
from schemas import AnswerDelta, AnswerEvent, KafkaConfig, decode_answer, decode_delta

log = structlog.get_logger("kev.gateway.replies")

# Reply latency is the gateway's overhead: ask the broker to answer a fetch as soon as it has a record.
FETCH_MAX_WAIT_MS = 20


class Pending:
    """One question's replies as they arrive. Every request waits on `answered`; a streamed one also reads
    `events()`: one attempt's deltas (per sample in seq order, duplicates dropped), then the answers. A question
    with params.n `samples` is answered once each sample's answer came (`answers`, by index; `answer` is
    sample 0's), or at its first error answer (a question refused is refused whole)."""

    def __init__(self, question_id: str, *, streamed: bool = False, samples: int = 1) -> None:
        self.question_id = question_id
        self.samples = samples
        self.answer: AnswerEvent | None = None
        self.answers: dict[int, AnswerEvent] = {}  # index -> the first answer of that sample
        self.answered: asyncio.Future[AnswerEvent] = asyncio.get_running_loop().create_future()
        self._next_seq: dict[int, int] = {}  # sample -> the seq of its next delta to relay
        self._attempt: str | None = None  # the attempt whose deltas are relayed: the first seen at seq 0
        # Only a stream needs a buffer of events: a whole answer waits on the future alone, which is cheaper.
        self._send: MemoryObjectSendStream[AnswerEvent | AnswerDelta] | None = None
        self._receive: MemoryObjectReceiveStream[AnswerEvent | AnswerDelta] | None = None
        if streamed:
            self._send, self._receive = anyio.create_memory_object_stream(math.inf)

    def deliver(self, event: AnswerEvent | AnswerDelta) -> None:
        if self.answer is not None:
            return  # a redelivered question's second answer
        if isinstance(event, AnswerDelta):
            if self._attempt is None and event.seq == 0:
                self._attempt = event.attempt
            if event.attempt != self._attempt or event.seq != self._next_seq.get(event.index, 0):
                return
            self._next_seq[event.index] = event.seq + 1
        else:
            if event.index in self.answers or not 0 <= event.index < self.samples:
                return  # a sample answered twice (a redelivery), or no sample of this question
            self.answers[event.index] = event
            if len(self.answers) == self.samples or event.finish_reason == "error":
                self.answer = self.answers.get(0, event)
                self.answered.set_result(self.answer)
        if self._send is not None:
            self._send.send_nowait(event)

    def ordered(self) -> list[AnswerEvent]:
        """The answers, by index."""
        return [self.answers[i] for i in sorted(self.answers)]

    async def events(self) -> AsyncIterator[AnswerEvent | AnswerDelta]:
        """Every reply until (and with) the answer; only for a Pending made with streamed=True."""
        if self._receive is None:
            raise RuntimeError(f"{self.question_id} is not streamed")
        answers = 0
        async for event in self._receive:
            yield event
            answers += isinstance(event, AnswerEvent)
            if self.relayed_all(answers):
                return

    def relayed_all(self, answers: int) -> bool:
        """Whether `answers` answers relayed are all this question has (its samples', or up to its error)."""
        return self.answer is not None and answers == len(self.answers)

    def close(self) -> None:
        self.answered.cancel()  # no-op once answered; else nobody is left to retrieve it
        if self._send is not None:
            self._send.close()
            self._receive.close()


class ReplyRouter:
    def __init__(self, cfg: KafkaConfig, reply_topic: str) -> None:
        self.cfg, self.topic = cfg, reply_topic
        self._pending: dict[str, Pending] = {}
        self.routed = 0
        self.dropped = 0

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @contextmanager
    def expect(self, question_id: str, *, streamed: bool = False, samples: int = 1):
        """Register before publishing (an answer can come back before `publish` returns)."""
        pending = self._pending[question_id] = Pending(question_id, streamed=streamed, samples=samples)
        try:
            yield pending
        finally:
            del self._pending[question_id]
            pending.close()

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Create the reply topic, read it until cancelled; ready once the consumer has its partition."""
        partitions = 1 if self.cfg.delivery == "at_least_once" else self.cfg.partitions
        await create_topics(self.cfg, {self.topic: partitions})
        async with open_consumer(self.cfg, self.topic, fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
                                 isolation_level="read_committed") as consumer:
            while not consumer.assignment():
                await fetch(consumer, timeout_ms=50)  # metadata for a topic made a moment ago
            log.info("gateway.replies_ready", topic=self.topic)
            task_status.started()
            while True:
                batch = await fetch(consumer, timeout_ms=1000)
                for records in batch.values():
                    for record in records:
                        if (broken := unreadable(record)) is not None:
                            log.warning("gateway.reply_unreadable", offset=record.offset, reason=broken.reason,
                                        message=broken.message)
                            continue
                        self._route(record.value)

    def _route(self, value: bytes | None) -> None:
        event = _decode(value or b"")
        if event is None:
            return
        pending = self._pending.get(event.question_id)
        if pending is None:
            self.dropped += 1
            return
        self.routed += 1
        pending.deliver(event)


def _decode(value: bytes) -> AnswerEvent | AnswerDelta | None:
    """A delta has `seq`, an answer has not. The key's bytes pick which decoder runs first (a `"seq":` inside
    a JSON string is escaped, so it only shows as a key), saving a failed decode, raised and caught, per
    answer; the other decoder still runs if the first one's type does not fit."""
    decoders = (decode_delta, decode_answer) if b'"seq":' in value else (decode_answer, decode_delta)
    for decode in decoders:
        try:
            return decode(value)
        except msgspec.ValidationError as error:
            problem = error
        except msgspec.DecodeError as error:
            problem = error
            break
    log.warning("gateway.reply_undecodable", size=len(value), error=str(problem))
    return None
