"""Answers, deltas, error answers and dead letters out to Kafka; each settles its source once acked.

A (signed) question with a `reply_topic` gets its deltas, its answer and its error answers there
(keyed by question_id, so in order on one partition) and on no other topic: every other topic is one
that a different principal may read. One without gets them on the deltas and answers topics. Each
answer and delta is stamped with who asked (the `principal` header, `audit.principal`) and with the
attempt that computed it (`AnswerDelta.attempt`, `audit.attempt`: one per Inbound), so the engine
need not know either, and a reader can tell a redelivered question's second stream from the first.

The publisher decides what goes where; consumers/publish/records.py builds each record (cut to fit, with
what ends its question should the broker refuse it), consumers/publish/reply_topics.py says which reply
topics not to try now, and consumers/publish/sender.py sends, retries and settles. Settle tasks live in the
publisher's own task group, so leaving `async with Publisher(...)` waits for every ack in flight.

No record stops the loop (consumers/publish/delivery.py `decide` sorts the failures): every answer is cut to
fit `max_request_size` before it is sent (`truncated` says so); a transient failure is sent again
with backoff until `retry_s` after the record's first send; a record refused for itself (too large,
not encodable) ends its question another way (an answer becomes an error answer, then a dead letter;
a delta is dropped: the answer carries the text). On a caller's reply topic the window is the
question's deadline (its timeout from its publish time, at most `retry_s`; `retry_s` without one);
an answer the topic has not taken by then, or that it refused, ends as a dead letter without its
text, and a refused topic's next records end that way at once for `avoid_s`. What is left, a failure
past its window or a refusal of the fleet's own topics (answers, dead letters, deltas, questions),
raises PublishFailed: the worker stops, and the source of that record is never settled, so never
committed.

An answer finished while a rebalance is under way is decided in a task of its own once the new
assignment is known, so the answers of the partitions this worker keeps are not held up behind it.

With exactly_once delivery (`transactions`), what ends a question goes out in its partition's Kafka
transaction and settles at its commit; deltas stay outside any transaction (consumers/publish/transactions.py).

A question with params.n samples has n answers (consumers/publish/samples.py): they are gathered, sent together
(one transaction for all under exactly_once, so a crash redoes all or none), and its position is done
once the last of them is acked. A reader tells them apart by (question_id, index).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio
import msgspec
import structlog
from aiokafka import AIOKafkaProducer
from anyio.streams.memory import MemoryObjectReceiveStream

from consumers.publish.delivery import SIZE_HEADROOM
from consumers.intake.ledger import QuestionLedger
from consumers.messages import Inbound, Outbound, Position, new_attempt
from consumers.publish.records import Headers, RecordBuilder
from consumers.publish.reply_topics import ReplyTopics
from consumers.publish.samples import Samples
from consumers.publish.sender import ACK_WAIT_S, Sender
from consumers.publish.transactions import Transactions
from schemas import ANONYMOUS, AnswerDelta, AnswerEvent, KafkaConfig, Principal

log = structlog.get_logger("kev.consumers.publish.publisher")

# An answer finished at (or after) its question's deadline still gets this long on its reply topic: one
# try, where a window of nothing would not send it at all.
REPLY_GRACE_S = 1.0


class Publisher:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        cfg: KafkaConfig,
        ledger: QuestionLedger,
        on_settled: Callable[[Sequence[Position]], None],
        *,
        max_in_flight: int = 1024,
        max_request_size: int | None = None,  # the producer's (default cfg.max_request_size): records are cut to fit
        retry_s: float | None = None,  # from a record's first send until the worker gives up (cfg.publish_retry_ms)
        avoid_s: float = 60.0,  # a reply topic the broker refused is not tried again for this long (fail fast)
        ownership=None,  # a RevocationListener: answers of partitions that moved away are left to their new owner
        transactions: Transactions | None = None,  # exactly_once delivery
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.ownership = ownership
        self.counts = {"answers": 0, "error_answers": 0, "deltas": 0, "dead_letters": 0, "abandoned": 0}
        max_request_size = cfg.max_request_size if max_request_size is None else max_request_size
        self.retry_s = cfg.publish_retry_ms / 1000 if retry_s is None else retry_s
        self._records = RecordBuilder(cfg, max_request_size - SIZE_HEADROOM)
        self._task_group = anyio.create_task_group()
        self._on_settled = on_settled
        self._samples = Samples()
        self._sender = Sender(producer, ledger, self._settled, self._task_group, ReplyTopics(avoid_s), self.counts,
                              max_in_flight=max_in_flight, retry_s=self.retry_s, transactions=transactions)

    async def __aenter__(self) -> "Publisher":
        await self._task_group.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        return await self._task_group.__aexit__(*exc)

    async def run(self, answers_in: MemoryObjectReceiveStream[Outbound]) -> None:
        """Publish everything the engine sends until it closes its end."""
        async with answers_in:
            async for outbound in answers_in:
                await self.publish(outbound)

    @property
    def samples_gathering(self) -> int:
        return self._samples.gathering

    async def publish(self, outbound: Outbound) -> None:
        source = outbound.source
        match outbound.event:
            case AnswerEvent() as answer:
                log.debug("answer_taken", question_id=answer.question_id)  # a stage stamp, as question_taken
                group = self._samples.gather(answer, source)
                if group is not None:
                    await self._answer(group, source)
            case AnswerDelta() as delta if source.question.stream:
                await self._delta(delta, source)
            case AnswerDelta():
                pass  # the asker did not ask for a stream

    async def quiesce(self, timeout: float = ACK_WAIT_S) -> None:
        """Wait (bounded) until every record sent so far is acked or has failed."""
        await self._sender.quiesce(timeout)

    async def error_answer(self, answer: AnswerEvent, source: Position, *, principal: Principal = ANONYMOUS,
                           reply_topic: str | None = None) -> None:
        """An answer for a question the engine never saw (invalid, refused, a conflicting id) to `principal`,
        on its `reply_topic` (a signed asker's, checked by the caller) or else the answers topic; settles
        `source`. The question keeps no id in the ledger (see consumers/intake/loop.py)."""
        answer = _stamped(answer, principal, new_attempt())
        topic = reply_topic or self.cfg.answers_topic
        await self._sender.send(self._records.answer(topic, answer, "error_answers", (source,), answer.question_id,
                                                     finishes=None))

    async def dead_letter(self, value: bytes | None, key: bytes | None, headers: Headers, source: Position,
                          reason: str, message: str) -> None:
        """The raw record, unchanged, plus headers saying why and where it came from."""
        await self._sender.send(self._records.dead_letter(value, key, headers, source, reason, message))

    async def forward(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers, partition: int,
                      source: Position, *, timestamp_ms: int | None = None) -> None:
        """A record re-published to a chosen partition (`kev route`); settles `source` once acked.
        `timestamp_ms`: the source's publish time, which the question's deadline counts from."""
        await self._sender.send(self._records.forward(topic, key, value, headers, partition, source, timestamp_ms))

    async def _answer(self, answers: list[AnswerEvent], source: Inbound) -> None:
        """A question's answers, one per sample (params.n), decided and sent together."""
        ours = self._ours_now(answers[0], source)
        if ours is None:  # a rebalance is under way: decide when it is over, without holding up the loop
            self._task_group.start_soon(self._answer_after_rebalance, answers, source)
        elif ours:
            await self._publish_answers(answers, source)
        else:
            self._leave_to_new_owner(answers[0], source)

    async def _answer_after_rebalance(self, answers: list[AnswerEvent], source: Inbound) -> None:
        if await self._still_ours(answers[0], source):
            await self._publish_answers(answers, source)
        else:
            self._leave_to_new_owner(answers[0], source)

    async def _publish_answers(self, answers: list[AnswerEvent], source: Inbound) -> None:
        """Each sample's answer settles the question's position, which is done once the last is acked; all go
        into one transaction with exactly_once, so a question's samples commit (or are redone) together."""
        self._samples.settling(source.position, len(answers))
        records = []
        for i, answer in enumerate(answers):
            answer = _stamped(answer, source.principal, source.attempt)
            kind = "error_answers" if answer.finish_reason == "error" else "answers"
            records.append(self._records.answer(
                source.question.reply_topic or self.cfg.answers_topic, answer, kind, (source.position,),
                source.question.question_id, finishes=source.key if i == len(answers) - 1 else None,
                window_s=self._reply_window(source)))
        await self._sender.send_together(records)

    def _settled(self, positions: Sequence[Position]) -> None:
        """The sender's acks; a position of a question with several samples passes on at its last."""
        done = self._samples.settled(positions)
        if done:
            self._on_settled(done)

    async def _delta(self, delta: AnswerDelta, source: Inbound) -> None:
        delta = msgspec.structs.replace(delta, attempt=source.attempt)
        await self._sender.send(self._records.delta(source.question.reply_topic or self.cfg.deltas_topic, delta,
                                                    source.question.request_id, str(source.principal),
                                                    self._reply_window(source)), home=source.partition)

    def _reply_window(self, source: Inbound) -> float | None:
        """How long the question's replies may be retried on its reply topic: until its deadline (timeout_ms
        from its publish time, a future stamp counting as now), at most `retry_s`; `retry_s` without a
        deadline. None: it has no reply topic (the fleet's topics have the fleet's window)."""
        if source.question.reply_topic is None:
            return None
        timeout_ms, published_ms = source.question.timeout_ms, source.published_ms
        if timeout_ms is None or published_ms is None or published_ms < 0:
            return self.retry_s
        now = time.time()
        left = min(published_ms / 1000, now) + timeout_ms / 1000 - now
        return max(REPLY_GRACE_S, min(self.retry_s, left))

    # -- partitions that move during a rebalance ---------------------------------------------------------
    def _ours_now(self, answer: AnswerEvent, source: Inbound) -> bool | None:
        """Whether the source's partition (or any redelivery's) is still this worker's; None while a
        rebalance is under way. Not ours: its new owner answers it from the last commit, so publishing
        here too would be a duplicate."""
        if self.ownership is None:
            return True
        verdicts = [self.ownership.owns_now(p.partition_key) for p in self._positions(answer, source)]
        return True if True in verdicts else None if None in verdicts else False

    async def _still_ours(self, answer: AnswerEvent, source: Inbound) -> bool:
        """`_ours_now`, waiting (bounded) for a rebalance to end."""
        for position in self._positions(answer, source):
            if await self.ownership.owns(position.partition_key):
                return True
        return False

    def _positions(self, answer: AnswerEvent, source: Inbound) -> tuple[Position, ...]:
        return source.position, *self.ledger.waiting(source.key)

    def _leave_to_new_owner(self, answer: AnswerEvent, source: Inbound) -> None:
        self.ledger.abandon(source.key)
        self.counts["abandoned"] += 1
        log.info("answer_left_to_new_owner", question_id=answer.question_id, source_partition=source.partition,
                 source_offset=source.offset)


def _stamped(answer: AnswerEvent, principal: Principal, attempt: str) -> AnswerEvent:
    """The answer saying whose it is and which attempt computed it."""
    return msgspec.structs.replace(answer, audit=msgspec.structs.replace(answer.audit, principal=str(principal),
                                                                         attempt=attempt))
