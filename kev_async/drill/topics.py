"""The drill's own Kafka clients: questions published over time, every answer record read, and the
consumer group's commits."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import anyio
from aiokafka import TopicPartition

from consumers.kafka_client.clients import fetch, open_consumer, open_producer
from consumers.kafka_client.record_guard import unreadable
from kev_async.sample_questions import QUESTIONS
from schemas import KafkaConfig, Params, QuestionEvent, decode_answer, encode


async def publish_over_time(kafka: KafkaConfig, options, sent: dict[str, tuple[int, int]],
                            note: Callable[[str], None]) -> None:
    """options.questions questions, evenly over options.spread_s; `sent` gets each one's (partition, offset)."""
    async with open_producer(kafka) as producer:
        gap = options.spread_s / max(1, options.questions)
        chooser = random.Random(0)  # random, not cyclic: a cycle would line up with round_robin's own cycle
        topic = kafka.intake_topic if options.route else kafka.questions_topic
        begin = time.monotonic()
        for i in range(options.questions):
            qid = f"drill-{i:04d}"
            system = chooser.choice(options.system_prompts) if options.system_prompts else None
            question = QuestionEvent(question_id=qid, prompt=QUESTIONS[i % len(QUESTIONS)], system=system,
                                     params=Params(max_new_tokens=options.max_new_tokens, temperature=0.0))
            meta = await producer.send_and_wait(topic, encode(question), key=qid.encode())
            sent[qid] = (meta.partition, meta.offset)
            await anyio.sleep(max(0.0, begin + (i + 1) * gap - time.monotonic()))
        note(f"published {options.questions} questions over {time.monotonic() - begin:.1f}s")


async def read_answers(kafka: KafkaConfig, answers: list, *, read_committed: bool = False,
                       task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Every answer record, (AnswerEvent, record) in arrival order, appended to `answers` until cancelled;
    `read_committed`: only those of committed transactions (exactly_once delivery)."""
    isolation = "read_committed" if read_committed else "read_uncommitted"
    async with open_consumer(kafka, kafka.answers_topic, isolation_level=isolation) as consumer:
        task_status.started()
        while True:
            batch = await fetch(consumer, timeout_ms=100)
            for records in batch.values():
                answers.extend((decode_answer(record.value), record) for record in records if not unreadable(record))


async def until_committed(kafka: KafkaConfig, sent: dict[str, tuple[int, int]], timeout: float) -> bool:
    """Whether the group's commits came to cover every sent question within `timeout` seconds."""
    ends = {}
    for partition, offset in sent.values():
        ends[partition] = max(ends.get(partition, 0), offset + 1)
    with anyio.move_on_after(timeout):
        while True:
            done = await committed(kafka)
            if all((done.get(p) or 0) >= end for p, end in ends.items()):
                return True
            await anyio.sleep(0.5)
    return False


async def positions(kafka: KafkaConfig) -> dict[str, tuple[int, int]]:
    """question_id (the record key) -> (partition, offset) of every question on the questions topic (its
    last copy, where one was written twice)."""
    layout = await records_on(kafka)
    return {qid: (partition, offset) for partition, records in layout.items() for offset, qid in sorted(records.items())}


async def records_on(kafka: KafkaConfig) -> dict[int, dict[int, str]]:
    """partition -> offset -> question_id (the record key) of every record on the questions topic, up to
    its end. A producer that resent a question after the broker's restart may have written it twice: the
    first copy sits at an offset the producer never heard of, and the workers commit past it too."""
    layout: dict[int, dict[int, str]] = {p: {} for p in range(kafka.partitions)}
    async with open_consumer(kafka) as consumer:
        parts = [TopicPartition(kafka.questions_topic, p) for p in range(kafka.partitions)]
        consumer.assign(parts)
        ends = await consumer.end_offsets(parts)
        with anyio.move_on_after(30):
            while any(len(layout[tp.partition]) < ends[tp] for tp in parts):
                for tp, records in (await fetch(consumer, timeout_ms=200)).items():
                    layout[tp.partition].update({r.offset: r.key.decode("utf-8", "replace") if r.key else ""
                                                 for r in records})
    return layout


async def committed(kafka: KafkaConfig) -> dict[int, int | None]:
    """The group's committed position on each questions partition (None: nothing committed)."""
    async with open_consumer(kafka, group_id=kafka.group_id) as consumer:
        return {p: await consumer.committed(TopicPartition(kafka.questions_topic, p)) for p in range(kafka.partitions)}
