"""The Kafka side end to end against the embedded Tansu broker: questions in, answers out, offsets.

A stand-in engine (test code in the engine actor's place) reads Inbound and writes Outbound; the
path under test — consumer, decoding, DLQ, publisher, offset commits — is all real.
"""

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer

from consumers import Inbound, KafkaWorker, Outbound
from consumers.messages import Position

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import (  # noqa: E402
    FAST_GROUP,
    HoldingEngine,
    StandInEngine,
    committed,
    kafka_config,
    produce,
    question,
    read_topic,
    running_worker,
    wait_committed,
)
from polling import eventually  # noqa: E402
from schemas import decode_answer, decode_delta  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


def by_key(records):
    return {record.key.decode(): record for record in records}


def last_offsets(sent, partitions):
    """Commit positions (last offset + 1) per partition for records sent as (partition, offset)."""
    positions = dict.fromkeys(range(partitions))
    for partition, offset in sent:
        positions[partition] = max(positions[partition] or 0, offset + 1)
    return positions


async def test_answers_are_published_and_offsets_committed_only_after_the_ack(kafka_broker):
    # The six held questions on partitions 0 and 1; partition 2 gets one the worker settles at once.
    cfg = kafka_config(kafka_broker, partitions=3)
    bootstrap = kafka_broker.bootstrap_servers
    engine = HoldingEngine()
    async with running_worker(cfg, engine) as worker:
        sent = []
        for partition in (0, 1):
            held = [question(f"q{i}", f"prompt {i}", request_id=f"r{i}") for i in range(partition, 6, 2)]
            sent += await produce(bootstrap, cfg.questions_topic, held, partition=partition)
        await eventually(lambda: len(engine.received) == 6)
        # An error answer needs no engine: once its offset is committed, a commit has been made while the six
        # were in flight, and it had to leave their partitions alone.
        bad = await produce(bootstrap, cfg.questions_topic, [question("bad", params={"temperature": 99})],
                            partition=2)
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: None, 1: None, 2: 1})
        assert worker.statistics().in_flight == 6

        engine.release.set()
        answers = by_key(await read_topic(bootstrap, cfg.answers_topic, 7))
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, last_offsets(sent + bad, 3))

    assert sorted(answers) == ["bad"] + [f"q{i}" for i in range(6)]
    assert decode_answer(answers["bad"].value).error.code == "invalid_field"
    for i in range(6):
        record = answers[f"q{i}"]
        assert dict(record.headers) == {"schema": b"1", "content-type": b"application/json",
                                        "question_id": f"q{i}".encode(), "request_id": f"r{i}".encode(),
                                        "principal": b"unsigned/-"}
        answer = decode_answer(record.value)
        assert (answer.question_id, answer.request_id, answer.text) == (f"q{i}", f"r{i}", f"echo: prompt {i}")

    # A fresh consumer in the same group starts right after the last committed question.
    later = await produce(bootstrap, cfg.questions_topic, [question("late-1"), question("late-2")])
    assert sorted(await read_as_the_group(cfg, 2)) == sorted(later)


async def read_as_the_group(cfg, count: int) -> list[tuple[int, int]]:
    """(partition, offset) of the first `count` questions a fresh consumer in the worker's group reads."""
    consumer = AIOKafkaConsumer(cfg.questions_topic, bootstrap_servers=cfg.bootstrap_servers, group_id=cfg.group_id,
                                enable_auto_commit=False, auto_offset_reset="earliest", **FAST_GROUP)
    seen = []

    async def enough() -> bool:
        batch = await consumer.getmany(timeout_ms=200)
        seen.extend((r.partition, r.offset) for part in batch.values() for r in part)
        return len(seen) >= count

    await consumer.start()
    try:
        await eventually(enough, timeout=30, every=0)
    finally:
        await consumer.stop()
    return seen


BAD_INPUTS = [
    # (value, outcome, reason or error code)
    (b"{nope", "dlq", "not_json"),
    (b"\xff\xfe{}", "dlq", "not_utf8"),
    (b"[1, 2]", "dlq", "not_object"),
    (b'{"prompt": "who am I?"}', "dlq", "missing_question_id"),
    (None, "dlq", "not_json"),
    (question("bad-params", params={"temperature": 99}), "error", "invalid_field"),
    (question("empty-prompt", "   "), "error", "empty_prompt"),
    (question("future", schema=9), "error", "unsupported_schema"),
    (question("fine", "what is 2+2?"), "answer", None),
]


async def test_every_bad_input_ends_as_exactly_one_dead_letter_or_error_answer(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    async with running_worker(cfg) as worker:
        sent = await produce(bootstrap, cfg.questions_topic, [value for value, _, _ in BAD_INPUTS], key=b"k")
        dead = await read_topic(bootstrap, cfg.dlq_topic, 5)
        answers = by_key(await read_topic(bootstrap, cfg.answers_topic, 4))
        # Still alive: a good question after all that is answered.
        await produce(bootstrap, cfg.questions_topic, [question("after")])
        assert "after" in by_key(await read_topic(bootstrap, cfg.answers_topic, 5, linger=0))
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: len(BAD_INPUTS) + 1})
        stats = worker.statistics()

    dead_letters = [(value, reason) for value, outcome, reason in BAD_INPUTS if outcome == "dlq"]
    assert [(record.value, dict(record.headers)["dlq.reason"].decode()) for record in dead] == dead_letters
    for record, (_, offset) in zip(dead, sent):
        headers = dict(record.headers)
        assert record.key == b"k"
        assert headers["dlq.source.topic"] == cfg.questions_topic.encode()
        assert (headers["dlq.source.partition"], headers["dlq.source.offset"]) == (b"0", str(offset).encode())
        assert headers["dlq.message"]

    assert sorted(answers) == ["bad-params", "empty-prompt", "fine", "future"]
    for value, outcome, code in BAD_INPUTS:
        if outcome == "error":
            answer = decode_answer(answers[msgspec.json.decode(value)["question_id"]].value)
            assert (answer.finish_reason, answer.error.code) == ("error", code)
            assert answer.error.message
    assert decode_answer(answers["fine"].value).text == "echo: what is 2+2?"
    assert (stats.dead_letters, stats.error_answers, stats.answers, stats.in_flight) == (5, 3, 2, 0)


async def test_a_full_inbox_pauses_the_partitions_and_a_drained_one_resumes_them(kafka_broker):
    cfg = kafka_config(kafka_broker)
    bootstrap = kafka_broker.bootstrap_servers
    engine = StandInEngine(open_gate=False)
    async with running_worker(cfg, engine, buffer=2) as worker:
        await produce(bootstrap, cfg.questions_topic, [question(f"bp{i}") for i in range(40)])
        await eventually(lambda: worker.statistics().paused == worker.statistics().assigned)
        polls = worker.statistics().polls
        await eventually(lambda: worker.statistics().polls >= polls + 3)  # fetched, paused, three times over
        stats = worker.statistics()
        assert stats.pauses >= 1 and len(stats.paused) == 2
        assert stats.questions <= 2  # fetched no further than the inbox has room for
        assert stats.in_flight <= 2

        engine.gate.set()
        answers = await read_topic(bootstrap, cfg.answers_topic, 40, linger=0)
        await eventually(lambda: worker.statistics().in_flight == 0)
        stats = worker.statistics()

    assert sorted(r.key.decode() for r in answers) == sorted(f"bp{i}" for i in range(40))
    assert stats.resumes >= 1 and stats.questions == 40


async def test_a_question_id_seen_again_is_not_answered_twice(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    engine = HoldingEngine()
    async with running_worker(cfg, engine) as worker:
        # Redelivered while the first delivery is still being answered ...
        await produce(bootstrap, cfg.questions_topic, [question("twice"), question("twice")])
        await eventually(lambda: worker.statistics().records == 2)
        engine.release.set()
        await read_topic(bootstrap, cfg.answers_topic, 1, linger=0)
        # ... and again after it was answered; then another question, whose commit carries the skipped one's
        # position where exactly_once is the delivery (consumers/publish/transactions.py `settled`).
        await produce(bootstrap, cfg.questions_topic, [question("twice"), question("next")])
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 4})
        answers = await read_topic(bootstrap, cfg.answers_topic, 3, timeout=1.0)
        stats = worker.statistics()

    assert [record.key for record in answers] == [b"twice", b"next"]
    assert [inbound.question.question_id for inbound in engine.received] == ["twice", "next"]
    assert (stats.duplicates, stats.in_flight) == (2, 0)


async def test_revoked_partitions_commit_what_is_settled(kafka_broker):
    # Interval, count and debounce triggers far away: only the rebalance listener can commit here (the Committer's
    # part; exactly_once commits a revoked partition's transaction: tests/test_exactly_once.py).
    cfg = kafka_config(kafka_broker, partitions=2, commit_interval_ms=600_000, commit_every=1000,
                       delivery="at_least_once")
    bootstrap = kafka_broker.bootstrap_servers
    async with running_worker(cfg, commit_debounce_s=600.0) as worker:
        sent = await produce(bootstrap, cfg.questions_topic, [question(f"rv{i}") for i in range(4)])
        await read_topic(bootstrap, cfg.answers_topic, 4, linger=0)
        await eventually(lambda: worker.statistics().in_flight == 0)
        assert await committed(bootstrap, cfg.group_id, cfg.questions_topic, 2) == {0: None, 1: None}

        newcomer = AIOKafkaConsumer(cfg.questions_topic, bootstrap_servers=bootstrap, group_id=cfg.group_id,
                                    enable_auto_commit=False, **FAST_GROUP)
        await newcomer.start()
        try:
            async def newcomer_assigned():
                await newcomer.getmany(timeout_ms=100)
                return newcomer.assignment()

            await eventually(newcomer_assigned, timeout=20, every=0)
            await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, last_offsets(sent, 2))
        finally:
            await newcomer.stop()


async def test_reply_topic_and_streaming_deltas(kafka_broker):
    from kafka_fixtures import produce_records
    from schemas import TrustConfig
    from schemas.signing import QUESTION, Signer

    trust = TrustConfig(keys={"t": "a-secret-for-the-tests"})  # a reply_topic is honoured only when signed
    cfg = kafka_config(kafka_broker, partitions=1, trust=trust)
    bootstrap = kafka_broker.bootstrap_servers
    reply_topic = f"kev.replies.{cfg.answers_topic}-private"  # as kafka.trust.reply_topic_pattern wants
    async with running_worker(cfg):
        private = question("private", reply_topic=reply_topic)
        await produce_records(bootstrap, cfg.questions_topic, [
            (None, private, Signer.from_config(trust).headers(QUESTION, cfg.questions_topic, None, private)),
            (None, question("streamed", stream=True), []),
            (None, question("misaddressed", reply_topic="no such topic!"), []),
        ])
        private = await read_topic(bootstrap, reply_topic, 1)
        public = await read_topic(bootstrap, cfg.answers_topic, 2)
        deltas = await read_topic(bootstrap, cfg.deltas_topic, 3)

    assert [r.key for r in private] == [b"private"]
    assert [r.key for r in public] == [b"streamed", b"misaddressed"]  # an illegal reply_topic is not fatal
    assert [decode_delta(r.value).seq for r in deltas] == [0, 1, 2]
    assert all(r.key == b"streamed" and dict(r.headers)["question_id"] == b"streamed" for r in deltas)
    assert decode_delta(deltas[-1].value).done


async def test_commits_every_n_settled_records_without_waiting_for_the_interval(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=1, commit_interval_ms=600_000, commit_every=3)
    bootstrap = kafka_broker.bootstrap_servers
    async with running_worker(cfg):
        await produce(bootstrap, cfg.questions_topic, [question(f"n{i}") for i in range(3)])
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 3})


async def test_a_settled_record_is_committed_promptly_without_waiting_for_the_interval(kafka_broker):
    # What is acked but not committed is answered again after a SIGKILL: commits follow acks within ~50 ms.
    cfg = kafka_config(kafka_broker, partitions=1, commit_interval_ms=600_000, commit_every=1000)
    bootstrap = kafka_broker.bootstrap_servers
    async with running_worker(cfg) as worker:
        await produce(bootstrap, cfg.questions_topic, [question("prompt")])
        await eventually(lambda: worker.statistics().answers == 1)
        await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, {0: 1}, timeout=2.0)


async def test_a_cancelled_worker_commits_what_is_settled_and_nothing_more(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=1, commit_interval_ms=600_000, commit_every=1000)
    bootstrap = kafka_broker.bootstrap_servers
    questions_out, questions_in = anyio.create_memory_object_stream[Inbound](8)
    answers_out, answers_in = anyio.create_memory_object_stream[Outbound](8)
    worker = KafkaWorker(cfg, questions_out, answers_in, consumer_options=FAST_GROUP)
    engine = StandInEngine(never_answer=frozenset({"stuck"}))
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine, questions_in, answers_out)
        await tg.start(worker.run)
        await produce(bootstrap, cfg.questions_topic, [question("s0"), question("s1"), question("stuck"),
                                                       question("s3")])
        await read_topic(bootstrap, cfg.answers_topic, 3, linger=0)
        await eventually(lambda: worker.statistics().answers == 3)
        # Settled offsets are committed promptly (s0, s1 may already be), never past "stuck".
        assert (await committed(bootstrap, cfg.group_id, cfg.questions_topic, 1))[0] in (None, 2)
        tg.cancel_scope.cancel()

    # s3 is answered too, but behind the unanswered "stuck" (offset 2): it must be asked again.
    assert await committed(bootstrap, cfg.group_id, cfg.questions_topic, 1) == {0: 2}


async def test_two_workers_in_one_group_share_the_partitions_and_answer_everything(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=4)
    bootstrap = kafka_broker.bootstrap_servers
    first = [question(f"w{i}") for i in range(20)]
    second = [question(f"w{i}") for i in range(20, 40)]
    async with running_worker(cfg) as one:
        sent = await produce(bootstrap, cfg.questions_topic, first)
        async with running_worker(cfg) as two:  # joining rebalances the group under load
            sent += await produce(bootstrap, cfg.questions_topic, second)
            answers = await read_topic(bootstrap, cfg.answers_topic, 40, linger=0)
            await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, last_offsets(sent, 4))
            shares = (one.statistics().assigned, two.statistics().assigned)

    # At least once: a question in flight at the rebalance may be answered by both workers.
    assert {r.key.decode() for r in answers} == {f"w{i}" for i in range(40)}
    assert all(shares) and not shares[0] & shares[1]


async def test_answers_of_a_partition_that_moved_away_are_left_to_its_new_owner(kafka_broker):
    # The first worker holds six questions unanswered while a second joins and takes one partition; the
    # second answers that partition's questions from the last commit, the first answers only its own.
    cfg = kafka_config(kafka_broker, partitions=2)
    bootstrap = kafka_broker.bootstrap_servers
    held = HoldingEngine()
    async with running_worker(cfg, held) as first:
        # Keyless records land on a random partition: pin them so that both partitions hold questions.
        names = [f"m{i}" for i in range(6)]
        sent = []
        for partition in (0, 1):
            sent += await produce(bootstrap, cfg.questions_topic, [question(n) for n in names[partition::2]],
                                  partition=partition)
        names = names[0::2] + names[1::2]
        await eventually(lambda: len(held.received) == 6)
        async with running_worker(cfg) as second:
            await eventually(lambda: len(first.statistics().assigned) == 1 == len(second.statistics().assigned))
            (moved,) = second.statistics().assigned
            on_moved = {name for name, (partition, _) in zip(names, sent) if partition == moved.partition}
            assert len(on_moved) == 3
            await read_topic(bootstrap, cfg.answers_topic, len(on_moved), linger=0)
            held.release.set()
            await wait_committed(bootstrap, cfg.group_id, cfg.questions_topic, last_offsets(sent, 2))
            answers = await read_topic(bootstrap, cfg.answers_topic, 6, linger=1.0)
            left = first.statistics().abandoned

    assert sorted(r.key.decode() for r in answers) == sorted(f"m{i}" for i in range(6))  # each exactly once
    assert left == len(on_moved)


async def test_an_answer_finished_during_a_rebalance_does_not_hold_up_the_publisher(kafka_broker):
    # The rebalance is driven by hand through the worker's own listener (as aiokafka calls it) so it can
    # stay open: the answers finished meanwhile wait in tasks of their own while the publisher goes on
    # (an error answer goes out at once); once the new assignment is known, the answer of the partition
    # this worker kept is published and the one of the partition that moved is left to its new owner.
    from aiokafka import AIOKafkaProducer, TopicPartition

    from consumers.intake.committer import Committer, RevocationListener
    from consumers.intake.ledger import QuestionLedger
    from consumers.intake.offsets import OffsetTracker
    from consumers.publish.publisher import Publisher
    from kafka_fixtures import answer_for
    from schemas import QuestionEvent, error_answer

    cfg = kafka_config(kafka_broker, partitions=2)
    bootstrap = kafka_broker.bootstrap_servers
    topic = cfg.questions_topic
    listener = RevocationListener(Committer(None, OffsetTracker(), interval_s=1.0, every=1))
    settled = []
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await producer.start()

    def inbound(qid: str, partition: int) -> Inbound:
        return Inbound(QuestionEvent(question_id=qid, prompt="hi"), topic, partition, 0, 0.0)

    kept, moved = inbound("kept", 1), inbound("moved", 0)
    try:
        with anyio.fail_after(30):
            async with Publisher(producer, cfg, QuestionLedger(), settled.extend, ownership=listener) as publisher:
                await listener.on_partitions_assigned([TopicPartition(topic, 0), TopicPartition(topic, 1)])
                await listener.on_partitions_revoked([])  # a rebalance begins (nothing was in flight)
                with anyio.fail_after(1):  # neither waits for the rebalance
                    await publisher.publish(Outbound(answer_for(moved), moved))
                    await publisher.publish(Outbound(answer_for(kept), kept))
                    await publisher.error_answer(error_answer("bad", None, "invalid_field", "no"),
                                                 Position(topic, 1, 1))
                during = await read_topic(bootstrap, cfg.answers_topic, 1, linger=0.3)
                await listener.on_partitions_assigned([TopicPartition(topic, 1)])
                after = await read_topic(bootstrap, cfg.answers_topic, 2, linger=0.5)
    finally:
        await producer.stop()
    assert [r.key for r in during] == [b"bad"]
    assert sorted(r.key for r in after) == [b"bad", b"kept"]  # answers land on several partitions: no order
    assert publisher.counts["abandoned"] == 1
    assert sorted(settled) == [Position(topic, 1, 0), Position(topic, 1, 1)]  # never "moved"'s


async def test_the_shared_topic_keeps_its_leader_in_the_producers_view_after_a_reply_topic_joins(kafka_broker):
    # A producer's first view of the cluster is Tansu's answer to "no topics": every topic, none of them
    # tracked. The first send to a reply topic makes aiokafka refresh its view for the tracked topics only:
    # had the answers topic not been tracked, its leader would be gone from the view, and an answer queued
    # for it at that moment (in a transaction: while its partition joins) waited request_timeout_ms (40 s)
    # and failed with NotLeaderForPartition, then OutOfOrderSequenceNumber; the worker ended.
    from aiokafka import AIOKafkaProducer, TopicPartition

    from consumers.intake.committer import Committer, RevocationListener
    from consumers.intake.ledger import QuestionLedger
    from consumers.intake.offsets import OffsetTracker
    from consumers.publish.publisher import Publisher
    from kafka_fixtures import answer_for
    from schemas import QuestionEvent

    cfg = kafka_config(kafka_broker, partitions=1)
    bootstrap, topic = kafka_broker.bootstrap_servers, cfg.questions_topic
    reply = f"kev.replies.{cfg.group_id}"
    await produce(bootstrap, cfg.answers_topic, [b"made before the producer starts"])
    listener = RevocationListener(Committer(None, OffsetTracker(), interval_s=1.0, every=1))
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await producer.start()
    shared = TopicPartition(cfg.answers_topic, 0)
    assert producer.client.cluster.leader_for_partition(shared) is not None  # known, yet untracked
    try:
        with anyio.fail_after(30):
            async with Publisher(producer, cfg, QuestionLedger(), lambda _: None, ownership=listener) as publisher:
                await listener.on_partitions_assigned([TopicPartition(topic, 0)])
                public = Inbound(QuestionEvent(question_id="public", prompt="hi"), topic, 0, 0, 0.0)
                private = Inbound(QuestionEvent(question_id="private", prompt="hi", reply_topic=reply), topic, 0, 1, 0.0)
                await publisher.publish(Outbound(answer_for(public), public))
                await read_topic(bootstrap, cfg.answers_topic, 2, linger=0)
                await publisher.publish(Outbound(answer_for(private), private))
                await read_topic(bootstrap, reply, 1, linger=0)
                await producer.client.force_metadata_update()  # what the reply topic's first send set off
                leader = producer.client.cluster.leader_for_partition(shared)
    finally:
        await producer.stop()
    assert leader is not None
