"""The gateway's way into Kafka: questions onto the questions topic, cancels onto the control topic.

A question counts as sent once the broker acked it (acks=all); if that takes longer than
`publish_timeout_ms` the broker is taken to be down and the request gets a 503 at once, rather
than waiting out aiokafka's own 40 s metadata and request timeouts.

Every record is signed (kafka.trust, when a key is configured; its scopes: questions and cancel) for
its topic and record key, so workers honour the question's tenant, cache_salt and reply_topic and
apply the cancels. A question's record timestamp and its signed time are the request's arrival, so a
worker measures its deadline from then, not from when it got to it, and refuses it once it is older
than kafka.trust.max_age_ms. Cancels are keyed `cancel:<question_id>`, as every control command is
keyed by what it changes.
"""

from __future__ import annotations

import asyncio

import anyio
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError

from kev_async.gateway.errors import ApiError
from schemas import ControlEvent, KafkaConfig, QuestionEvent, encode
from schemas.control import control_key
from schemas.signing import CANCEL, QUESTION, Purpose, Signer

log = structlog.get_logger("kev.gateway.publisher")

CANCEL_TIMEOUT_S = 2.0


class BrokerUnavailable(ApiError):
    def __init__(self, why: str) -> None:
        super().__init__(503, f"Kev's message broker is not reachable ({why}); try again later.",
                         code="broker_unavailable")


class QuestionTooLarge(ApiError):
    """The broker or the producer refused this one record for its size: the request's fault, not the broker's."""

    def __init__(self, why: str) -> None:
        super().__init__(413, f"The question is too large for Kev's message broker ({why}).", code="too_large")


class QuestionPublisher:
    """Publishes through a started producer (`open_producer(cfg, **QuestionPublisher.producer_options(...))`)."""

    def __init__(self, cfg: KafkaConfig, publish_timeout_ms: int, producer: AIOKafkaProducer,
                 signer: Signer | None = None) -> None:
        self.cfg, self.signer, self.producer = cfg, signer, producer
        self.timeout = publish_timeout_ms / 1000
        self.healthy = True  # the last publish was acked (the producer has started)

    @staticmethod
    def producer_options(publish_timeout_ms: int) -> dict:
        """A question goes out at once (no linger); a try lasts no longer than a request may wait; idempotent,
        so a send the broker wrote but whose ack was lost is not written again by the producer's retry."""
        return {"linger_ms": 0, "request_timeout_ms": max(1000, publish_timeout_ms), "enable_idempotence": True}

    async def publish(self, question: QuestionEvent, arrived_ms: int | None = None) -> None:
        """Send (stamped `arrived_ms`, epoch ms) and wait for the broker's ack; BrokerUnavailable (503) when it
        does not come in time."""
        value, key, topic = encode(question), question.question_id.encode(), self.cfg.questions_topic
        headers = self._signed(QUESTION, topic, key, value, arrived_ms)
        try:
            # asyncio's own timeout: half the event loop's time of anyio.fail_after (~9 against ~19 us), and the
            # gateway runs on asyncio anyway (aiokafka needs it).
            async with asyncio.timeout(self.timeout):
                delivery = await self.producer.send(topic, value, key=key, timestamp_ms=arrived_ms, headers=headers)
                written = await delivery
        except TimeoutError:
            self.healthy = False
            raise BrokerUnavailable(f"no ack within {self.timeout:g} s") from None
        except MessageSizeTooLargeError as error:  # this record only: the broker is fine
            raise QuestionTooLarge(str(error) or type(error).__name__) from None
        except KafkaError as error:
            self.healthy = False
            raise BrokerUnavailable(type(error).__name__) from None
        if written.offset < 0:
            # Counted a duplicate of a send the broker holds, yet no offset: after a crash the embedded Tansu
            # answered so for records it did not hold (docs/reliability.md#exactly-once-answers). The caller's
            # retry is safe: the same question twice is answered once.
            raise BrokerUnavailable("the broker acknowledged the question without an offset")
        self.healthy = True

    async def cancel(self, question_id: str) -> bool:
        """Tell every worker to drop the question (its KV blocks are freed); shielded, bounded, best effort."""
        event = ControlEvent(action="cancel", question_id=question_id)
        value, key, topic = encode(event), control_key(event), self.cfg.control_topic
        with anyio.move_on_after(CANCEL_TIMEOUT_S, shield=True):
            try:
                await (await self.producer.send(topic, value, key=key, headers=self._signed(CANCEL, topic, key, value)))
                return True
            except KafkaError as error:
                log.warning("gateway.cancel_failed", question_id=question_id, error=repr(error))
                return False
        log.warning("gateway.cancel_timed_out", question_id=question_id)
        return False

    def _signed(self, purpose: Purpose, topic: str, key: bytes, value: bytes,
                stamp: int | None = None) -> list[tuple[str, bytes]] | None:
        if self.signer is None:
            return None
        return self.signer.headers(purpose, topic, key, value, stamp=stamp)
