"""The direct path of `kev bench gateway`: QuestionEvents published to kev.questions by a plain aiokafka
client that reads their answers from a reply topic of its own, as the gateway does."""

from __future__ import annotations

import contextlib
import time
import uuid

from consumers import create_topics
from consumers.kafka_client.clients import open_consumer, open_producer
from kev_async.gateway.replies import FETCH_MAX_WAIT_MS
from schemas import Message, Params, QuestionEvent, decode_answer, encode
from schemas.signing import QUESTION, Signer


class DirectClient:
    """Publish QuestionEvents and read their answers from a reply topic of its own, as the gateway does."""

    def __init__(self, kafka, max_new_tokens: int, prompt: str) -> None:
        self.kafka, self.max_new_tokens, self.prompt = kafka, max_new_tokens, prompt
        # Signed, and a reply topic of the allowed pattern: as the gateway's, or the worker would not reply there.
        self.signer = Signer.from_config(kafka.trust)
        self.topic = f"kev.replies.bench-{uuid.uuid4().hex[:8]}"
        self._clients = contextlib.AsyncExitStack()

    async def start(self) -> None:
        await create_topics(self.kafka, {self.topic: 1})
        self.producer = await self._clients.enter_async_context(open_producer(self.kafka, linger_ms=0))
        self.consumer = await self._clients.enter_async_context(
            open_consumer(self.kafka, self.topic, fetch_max_wait_ms=FETCH_MAX_WAIT_MS))

    async def stop(self) -> None:
        await self._clients.aclose()

    async def round(self, concurrency: int) -> list[float]:
        """`concurrency` questions published at once; each one's seconds from its send to its answer."""
        sent: dict[str, float] = {}
        for i in range(concurrency):
            # The very question the gateway makes of its HTTP twin (messages, not a bare prompt).
            question = QuestionEvent(question_id=f"direct-{uuid.uuid4().hex}",
                                     messages=(Message(role="user", content=self.prompt.format(i=i)),),
                                     params=Params(max_new_tokens=self.max_new_tokens), reply_topic=self.topic)
            sent[question.question_id] = time.perf_counter()
            value, key, topic = encode(question), question.question_id.encode(), self.kafka.questions_topic
            await self.producer.send(topic, value, key=key, headers=self.signer.headers(QUESTION, topic, key, value))
        latencies = []
        while len(latencies) < concurrency:
            for records in (await self.consumer.getmany(timeout_ms=1000)).values():
                for record in records:
                    started = sent.pop(decode_answer(record.value).question_id, None)
                    if started is not None:
                        latencies.append(time.perf_counter() - started)
        return latencies
