"""`kafka.delivery: exactly_once` (consumers/publish/transactions.py) on the embedded Tansu, and what Tansu does.

What Tansu does, each shown against the real broker: it refuses aiokafka's InitProducerId v0 and takes
v3 (Kev's adapter); its read_committed fetches stop at the first open transaction (the last stable
offset) but list no aborted transaction, so aborted records come back; a producer fenced by its
transactional id's next epoch cannot write (UnknownServerError) and its commit is never answered.

What Kev does on it: its read_committed readers drop aborted transactions' records (the fetch guard);
a worker SIGKILLed between its answers' send and its transaction's commit leaves nothing a
read_committed reader sees, dead letters and error answers included, and the next owner answers each
question once; a zombie (paused past its session, then resumed) cannot commit; a broker away for a
while is ridden out, the answer committed once with its offset; `auto` picks exactly_once where
transactions work and at_least_once where they do not, or where the answers go to other brokers.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest
from aiokafka import TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_COMMITTED
from aiokafka.errors import KafkaError
from aiokafka.producer import sender as aiokafka_sender
from aiokafka.protocol import transaction
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.default_records import DefaultRecordBatch, _DefaultRecordBatchBuilderPy
from aiokafka.record.util import calc_crc32c
from kafka_fixtures import (
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
from polling import eventually
from serve_fixtures import ROOT, KevProcess, free_port, kev_processes, log_events, serve_env, wait_log
from structlog.testing import capture_logs

from consumers import EmbeddedBroker, Outbound, create_topics, topic_plan
from consumers.kafka_client.clients import fetch, open_consumer, open_producer
from consumers.kafka_client.init_producer_id import InitProducerIdRequest
from consumers.messages import Partition
from consumers.kafka_client.record_guard import GuardedRecords
from consumers.publish.delivery_mode import DeliveryUnavailable, choose_delivery
from schemas import AnswerEvent, decode_answer

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = pytest.mark.anyio

TP = TopicPartition("t", 0)
CONTROL = 0x20  # a v2 batch attribute: the batch holds a transaction marker


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka


# -- what the fetch guard makes of transactions (no broker) ----------------------------------------------

def batch(base: int, values: list[bytes], *, producer_id: int = -1, control: int | None = None) -> bytes:
    """A v2 batch at `base`: transactional when it has a producer id; with `control` (0 abort, 1 commit) the
    producer's end-of-transaction marker instead of `values`."""
    builder = _DefaultRecordBatchBuilderPy(magic=2, compression_type=0, is_transactional=int(producer_id >= 0),
                                           producer_id=producer_id, producer_epoch=0 if producer_id >= 0 else -1,
                                           base_sequence=0 if producer_id >= 0 else -1, batch_size=1 << 20)
    if control is None:
        for offset, value in enumerate(values):
            builder.append(offset, timestamp=None, key=None, value=value, headers=[])
    else:
        builder.append(0, timestamp=None, key=struct.pack(">hh", 0, control), value=b"\0\0\0\0\0\0", headers=[])
    raw = bytearray(builder.build())
    raw[0:8] = struct.pack(">q", base)
    if control is not None:
        raw[21:23] = struct.pack(">h", struct.unpack(">h", raw[21:23])[0] | CONTROL)
    raw[17:21] = struct.pack(">I", calc_crc32c(bytes(raw[21:])))
    return bytes(raw)


def read_committed(data: bytes, fetch_offset: int = 0) -> tuple[list[tuple[int, bytes]], int]:
    """What aiokafka's fetcher hands a read_committed consumer from one response that lists no aborted
    transaction (as Tansu's never do), and where it fetches next (the fetcher's PartitionRecords, as getmany)."""
    records = fetcher.PartitionRecords(TP, GuardedRecords(data), [], fetch_offset, None, None, True, READ_COMMITTED)
    return [(r.offset, r.value) for r in records], records.next_fetch_offset


def test_aborted_records_are_dropped_and_an_open_transaction_is_fetched_again():
    a, b = 7, 8  # producer ids
    data = b"".join([
        batch(0, [b"a-committed"], producer_id=a), batch(1, [b"b-aborted-1", b"b-aborted-2"], producer_id=b),
        batch(3, [b"plain"]), batch(4, [], producer_id=a, control=1), batch(5, [], producer_id=b, control=0),
        batch(6, [b"a-open"], producer_id=a), batch(7, [b"plain-after-open"]),
    ])
    got, next_offset = read_committed(data)
    assert got == [(0, b"a-committed"), (3, b"plain")]
    assert next_offset == 6  # a's open transaction and what follows come again in the next fetch
    # The next fetch, once a's marker is written: everything from there on.
    got, next_offset = read_committed(batch(6, [b"a-open"], producer_id=a) + batch(7, [b"plain-after-open"])
                                      + batch(8, [], producer_id=a, control=1), fetch_offset=6)
    assert got == [(6, b"a-open"), (7, b"plain-after-open")] and next_offset == 9


def test_a_response_that_ends_in_an_aborted_transaction_moves_past_it():
    got, next_offset = read_committed(batch(0, [b"x"], producer_id=3) + batch(1, [], producer_id=3, control=0))
    assert got == [] and next_offset == 2


# -- what the embedded Tansu does -------------------------------------------------------------------------

async def _client(bootstrap: str) -> tuple[AIOKafkaClient, int]:
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    return client, next(iter(client.cluster.brokers())).nodeId


@pytest.mark.kafka
async def test_tansu_refuses_init_producer_id_v0_and_takes_v3(kafka_broker):
    client, node = await _client(kafka_broker.bootstrap_servers)
    try:
        v0 = await client.send(node, transaction.InitProducerIdRequest("kev-v0-probe", 60_000))
        v3 = await client.send(node, InitProducerIdRequest("kev-v3-probe", 60_000))
    finally:
        await client.close()
    assert (v0.API_VERSION, v0.error_code, v0.producer_id) == (0, -1, -1)  # UnknownServerError
    assert (v3.API_VERSION, v3.error_code) == (3, 0) and v3.producer_id >= 0 and v3.producer_epoch == 0


@pytest.mark.kafka
async def test_tansu_read_committed_stops_at_an_open_transaction_and_lists_no_aborted_one(kafka_broker):
    cfg = kafka_config(kafka_broker)
    await create_topics(cfg, {"t-raw": 1})
    async with open_producer(cfg, transactional_id="raw-a") as a, open_producer(cfg) as plain:
        await a.begin_transaction()
        await (await a.send("t-raw", b"aborted", partition=0))
        await a.abort_transaction()
        await plain.send_and_wait("t-raw", b"plain", partition=0)  # offset 2, after the abort marker
        await a.begin_transaction()
        await (await a.send("t-raw", b"open", partition=0))  # offset 3, its transaction left open
        await plain.send_and_wait("t-raw", b"behind-the-open-one", partition=0)
        error, highwater, last_stable, aborted, raw = await _fetch_read_committed(cfg, "t-raw")
        await a.abort_transaction()
    values = [record.value for records in _batches(raw) for record in records]
    assert error == 0 and highwater == 5
    assert last_stable == 3  # held at the open transaction's first record
    assert aborted == []  # Kafka would list the aborted transaction (producer id, first offset 0) here
    assert values == [b"aborted", b"plain"]  # the aborted record, handed to a read_committed reader


async def _fetch_read_committed(cfg, topic: str) -> tuple[int, int, int, list, bytes]:
    """One read_committed Fetch of partition 0 from its start, as the broker answers it: (error, high
    watermark, last stable offset, the aborted transactions it lists, the record bytes)."""
    client, node = await _client(cfg.bootstrap_servers)
    try:
        response = await client.send(node, FetchRequest(100, 1, 1 << 20, READ_COMMITTED, [(topic, [(0, 0, 1 << 20)])]))
    finally:
        await client.close()
    ((_topic, ((_partition, error, highwater, last_stable, _start, aborted, *_rest, raw),)),) = response.topics
    return error, highwater, last_stable, aborted, raw or b""


@pytest.mark.kafka
async def test_tansu_holds_a_committed_transaction_back_while_an_overlapping_one_is_open(kafka_broker):
    cfg = kafka_config(kafka_broker)
    await create_topics(cfg, {"t-overlap": 1})
    async with open_producer(cfg, transactional_id="overlap-a") as a, \
            open_producer(cfg, transactional_id="overlap-b") as b:
        await a.begin_transaction()
        await (await a.send("t-overlap", b"a", partition=0))  # offset 0
        await b.begin_transaction()
        await (await b.send("t-overlap", b"b", partition=0))  # offset 1, before a's marker
        await a.commit_transaction()  # marker at 2
        _error, highwater, held, _aborted, _raw = await _fetch_read_committed(cfg, "t-overlap")
        await b.commit_transaction()  # marker at 3
        _error, _highwater, released, _aborted, _raw = await _fetch_read_committed(cfg, "t-overlap")
    # Kafka's last stable offset would be 1 (b's first record): a's record readable once a committed. Tansu
    # keeps a undecided while b, whose records interleave with a's, is open: so Kev gives each answers
    # partition one transactional writer.
    assert (highwater, held, released) == (3, 0, 4)



@pytest.mark.kafka
async def test_tansu_leaves_the_group_offset_of_a_producers_later_transaction_that_holds_offsets_only(kafka_broker):
    cfg = kafka_config(kafka_broker)
    await create_topics(cfg, {"t-in": 1, "t-out": 1})
    source, group = TopicPartition("t-in", 0), "offsets-only"

    async def transaction(producer, position: int, *, record: bool) -> int | None:
        await producer.begin_transaction()
        if record:
            await (await producer.send("t-out", b"answer", partition=0))
        await producer.send_offsets_to_transaction({source: position}, group)
        await producer.commit_transaction()
        await anyio.sleep(0.5)
        return (await committed(kafka_broker.bootstrap_servers, group, "t-in", 1))[0]

    async with open_producer(cfg, transactional_id="offsets-first") as first:
        assert await transaction(first, 1, record=False) == 1  # a producer's first transaction: applied
    async with open_producer(cfg, transactional_id="offsets-later") as later:
        assert await transaction(later, 2, record=True) == 2
        # Kafka would commit 3. Tansu logs the commit and keeps 2: a worker's position settled by a skipped
        # duplicate alone reaches the group with the partition's next answer (its transaction carries it).
        assert await transaction(later, 3, record=False) == 2
        assert await transaction(later, 4, record=True) == 4

def _batches(raw: bytes):
    pos = 0
    while pos + 12 <= len(raw):
        length = struct.unpack_from(">i", raw, pos + 8)[0]
        one = DefaultRecordBatch(raw[pos:pos + 12 + length])
        if not one.is_control_batch:
            yield list(one)
        pos += 12 + length


@pytest.mark.kafka
async def test_tansu_fences_a_producer_once_its_transactional_id_starts_again(kafka_broker):
    cfg = kafka_config(kafka_broker)
    await create_topics(cfg, {"t-fence": 1})
    async with open_producer(cfg, transactional_id="fenced") as old:
        await old.begin_transaction()
        await (await old.send("t-fence", b"old", partition=0))
        async with open_producer(cfg, transactional_id="fenced") as new:  # the same id: epoch + 1
            assert new._txn_manager.producer_epoch == old._txn_manager.producer_epoch + 1
            with pytest.raises(KafkaError):  # UnknownError: Tansu answers ProducerFenced as UnknownServerError
                await (await old.send("t-fence", b"old-again", partition=0))
            async with new.transaction():
                await new.send("t-fence", b"new", partition=0)
        with pytest.raises((KafkaError, AssertionError, TimeoutError)):
            with anyio.fail_after(3):  # Tansu drops the connection at a fenced EndTxn: aiokafka retries for good
                await old.commit_transaction()
    async with open_consumer(cfg, "t-fence", isolation_level="read_committed") as reader:
        seen = []
        with anyio.move_on_after(5):
            while b"new" not in seen:
                seen += [r.value for part in (await fetch(reader, timeout_ms=200)).values() for r in part]
    assert seen == [b"new"]  # "old" was aborted when the id started again: Kev's reader drops it


# -- Kev on it --------------------------------------------------------------------------------------------

@pytest.mark.kafka
async def test_auto_picks_exactly_once_where_transactions_work_and_exactly_once_refuses_where_they_do_not(
        kafka_broker, monkeypatch):
    cfg = kafka_config(kafka_broker)
    assert await choose_delivery(msgspec.structs.replace(cfg, delivery="at_least_once")) == \
        ("at_least_once", "configured")
    mode, why = await choose_delivery(msgspec.structs.replace(cfg, delivery="auto"))
    assert mode == "exactly_once" and "the broker started a transactional producer" in why
    # Answers to other brokers than the questions': no transaction holds both.
    elsewhere = "127.0.0.1:1"
    assert await choose_delivery(msgspec.structs.replace(cfg, delivery="auto"), elsewhere) == \
        ("at_least_once", f"auto: answers go to {elsewhere}, questions come from {cfg.bootstrap_servers}: one "
                          f"transaction cannot hold both")
    with pytest.raises(DeliveryUnavailable, match="kafka.delivery is exactly_once, but answers go to"):
        await choose_delivery(msgspec.structs.replace(cfg, delivery="exactly_once"), elsewhere)
    assert (await choose_delivery(msgspec.structs.replace(cfg, delivery="auto"), cfg.bootstrap_servers))[0] == \
        "exactly_once"
    # aiokafka as released (InitProducerId v0): Tansu refuses transactions.
    monkeypatch.setattr(aiokafka_sender, "InitProducerIdRequest", transaction.InitProducerIdRequest)
    mode, why = await choose_delivery(msgspec.structs.replace(cfg, delivery="auto"))
    assert mode == "at_least_once" and why.startswith("auto: the broker does not run transactions")
    with pytest.raises(DeliveryUnavailable, match="kafka.delivery is exactly_once"):
        await choose_delivery(msgspec.structs.replace(cfg, delivery="exactly_once"))


def commit_ends(positions: list[tuple[int, int]], partitions: int) -> dict[int, int | None]:
    """The group's commit position once every one of `positions` is done (None: a partition without one)."""
    return {p: max((o + 1 for q, o in positions if q == p), default=None) for p in range(partitions)}


async def committed_answers(cfg, count: int, *, topic: str | None = None, timeout: float = 60.0) -> list:
    """What a read_committed reader sees on `topic` (the answers topic): `count` records, then a second more."""
    records = []
    async with open_consumer(cfg, topic or cfg.answers_topic, isolation_level="read_committed") as reader:
        with anyio.fail_after(timeout):
            while len(records) < count:
                records += [r for part in (await fetch(reader, timeout_ms=100)).values() for r in part]
        with anyio.move_on_after(1.0):  # anything more would be a duplicate
            while True:
                records += [r for part in (await fetch(reader, timeout_ms=100)).values() for r in part]
    return records


@pytest.mark.kafka
async def test_answers_error_answers_and_dead_letters_commit_with_their_offsets(kafka_broker):
    cfg = kafka_config(kafka_broker, delivery="exactly_once", transaction_ms=50)
    async with running_worker(cfg) as worker:
        positions = await produce(cfg.bootstrap_servers, cfg.questions_topic,
                                  [question(f"q{i}") for i in range(6)] + [b"not json",
                                                                           question("bad", params={"temperature": -1})])
        answers = await committed_answers(cfg, 7)
        dead = await committed_answers(cfg, 1, topic=cfg.dlq_topic)
        ends = commit_ends(positions, cfg.partitions)
        await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, ends)
        stats = worker.statistics()
    got = sorted(decode_answer(r.value).question_id for r in answers)
    assert got == ["bad", "q0", "q1", "q2", "q3", "q4", "q5"] and len(dead) == 1
    # Each answer on its question's partition: one transactional writer per answers partition.
    asked_on = {f"q{i}": partition for i, (partition, _offset) in enumerate(positions[:6])}
    assert all(r.partition == asked_on[decode_answer(r.value).question_id] for r in answers if r.key != b"bad")
    assert stats.delivery == "exactly_once" and stats.transactions >= 1 and stats.transactions_aborted == 0
    assert stats.transaction_answers == 8 and stats.answers == 6 and stats.error_answers == 1


@pytest.mark.kafka
async def test_a_record_acked_without_an_offset_is_sent_again_in_a_new_transaction(kafka_broker):
    cfg = kafka_config(kafka_broker, delivery="exactly_once", transaction_ms=50, partitions=1)
    async with running_worker(cfg) as worker:
        await produce(cfg.bootstrap_servers, cfg.questions_topic, [question("q0")])
        await committed_answers(cfg, 1)
        # The broker's count of the producer's records runs ahead of its log, as Tansu's did after the drill's
        # SIGKILLs: the next batch is answered DuplicateSequenceNumber (aiokafka: acked, offset -1), not written.
        txn = worker.committer._owned[Partition(cfg.questions_topic, 0)]
        txn.producer._txn_manager._sequence_numbers[TopicPartition(cfg.answers_topic, 0)] = 0
        await produce(cfg.bootstrap_servers, cfg.questions_topic, [question("q1")])
        answers = await committed_answers(cfg, 2)
        await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, {0: 2})
        stats = worker.statistics()
    assert sorted(decode_answer(r.value).question_id for r in answers) == ["q0", "q1"]
    assert stats.transactions_aborted == 1 and stats.answers == 2  # redone once, then committed


@pytest.mark.kafka
async def test_a_commit_whose_caller_is_cancelled_midway_still_settles_and_the_stop_commits_cleanly(kafka_broker):
    # A graceful stop cancels the periodic committer, perhaps mid-commit; aiokafka finishes that commit anyway.
    # Before the commit was shielded its transaction stayed "open" on Kev's side: the stop's own commit then
    # sent offsets outside any transaction (IllegalOperation) and the worker exited 1 (seen once in CI).
    cfg = kafka_config(kafka_broker, delivery="exactly_once", transaction_ms=600_000, commit_every=1000, partitions=1)
    async with running_worker(cfg) as worker:
        await produce(cfg.bootstrap_servers, cfg.questions_topic, [question("q0")])
        txn = worker.committer._owned[Partition(cfg.questions_topic, 0)]
        await eventually(lambda: txn.began is not None and txn.in_play == 0 and txn.deferred)
        manager = txn.producer._txn_manager
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.committer._commit, txn)
                while not (manager._pending_txn_offsets or not manager.is_in_transaction()):
                    await anyio.sleep(0)  # cancel as soon as the offsets or the commit are on their way
                scope.cancel()
        assert txn.began is None and not txn.deferred  # the commit ran to its end and settled its answer
        assert await worker.committer.commit() == {}  # nothing open: the stop's commit has nothing to do
        answers = await committed_answers(cfg, 1)
        await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, {0: 1})
        stats = worker.statistics()
    assert [decode_answer(r.value).question_id for r in answers] == ["q0"]
    assert stats.transactions == 1 and stats.transactions_aborted == 0 and stats.answers == 1


@pytest.mark.kafka
async def test_a_broker_away_for_a_while_gets_the_answer_once_and_commits_it_with_its_offset(tmp_path):
    # The one broker (durable: its topics, groups and transactions survive) stops while the answer goes out
    # and is back after 2.5 s (two request timeouts): aiokafka's transactional producer keeps the record and
    # its transaction meanwhile, and both go through once it is back, within publish_retry_s.
    broker = EmbeddedBroker(port=free_port(), storage="durable", data_dir=tmp_path)
    await broker.astart()
    cfg = kafka_config(broker, delivery="exactly_once", transaction_ms=50, partitions=1)
    engine = HoldingEngine()
    try:
        with capture_logs() as logs:
            async with running_worker(cfg, engine, consumer_options={}, publish_retry_s=60.0,
                                      producer_options={"request_timeout_ms": 1000}) as worker:
                await produce(cfg.bootstrap_servers, cfg.questions_topic, [question("q0")])
                await eventually(lambda: len(engine.received) == 1)
                await broker.astop(kill=True)  # at once: SIGTERM waits seconds for the connected producers
                engine.release.set()
                await anyio.sleep(2.5)
                await broker.astart()
                answers = await committed_answers(cfg, 1)
                await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, {0: 1}, timeout=30)
                assert worker.healthy()
                stats = worker.statistics()
    finally:
        broker.stop()
    assert [decode_answer(r.value).question_id for r in answers] == ["q0"]
    assert stats.answers == 1 and stats.transactions == 1 and stats.transactions_aborted == 0
    assert stats.transaction_seconds >= 2.5  # the same transaction, committed once the broker was back
    assert not [e for e in logs if e["event"] in ("transaction.aborted", "kafka_io.final_commit_failed")]


class Labelled(StandInEngine):
    """Answers each question with `label: prompt`, so a reader can tell which worker answered it."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    async def __call__(self, inbox, outbox) -> None:
        async with inbox, outbox:
            async for inbound in inbox:
                self.received.append(inbound)
                q = inbound.question
                await outbox.send(Outbound(AnswerEvent(question_id=q.question_id, text=f"{self.label}: {q.prompt}"),
                                           inbound))


# A worker in a process of its own, which the test pauses (SIGSTOP) past its session and resumes (SIGCONT).
ZOMBIE = """
import sys

import anyio
import msgspec
from kafka_fixtures import running_worker

from consumers import Outbound
from schemas import AnswerEvent, KafkaConfig


async def engine(inbox, outbox):
    async with inbox, outbox:
        async for inbound in inbox:
            q = inbound.question
            await outbox.send(Outbound(AnswerEvent(question_id=q.question_id, text=f"zombie: {q.prompt}"), inbound))


async def main():
    cfg = msgspec.json.decode(sys.argv[1], type=KafkaConfig)
    async with running_worker(cfg, engine, publish_retry_s=3.0):
        print("zombie.serving", flush=True)
        await anyio.sleep_forever()

anyio.run(main, backend="asyncio")
"""


def start_zombie(cfg, tmp_path) -> tuple[subprocess.Popen, Path]:
    script, log = tmp_path / "zombie.py", tmp_path / "zombie.log"
    script.write_text(ZOMBIE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, str(script), msgspec.json.encode(cfg).decode()], env=env,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    return process, log


@pytest.mark.kafka
async def test_a_zombie_paused_past_its_session_cannot_commit(kafka_broker, tmp_path):
    # Transactions stay open for a minute: the zombie's answers are sent and acked, never committed by it.
    cfg = kafka_config(kafka_broker, delivery="exactly_once", transaction_ms=60_000, commit_every=1_000)
    await create_topics(cfg, topic_plan(cfg))
    positions = await produce(cfg.bootstrap_servers, cfg.questions_topic, [question(f"q{i}") for i in range(6)])
    ends = commit_ends(positions, cfg.partitions)
    zombie, log = start_zombie(cfg, tmp_path)
    try:
        sent = await read_topic(cfg.bootstrap_servers, cfg.answers_topic, 6, timeout=60, linger=0)
        assert len(sent) == 6, log.read_text()  # on the topic (read_uncommitted), in the zombie's open transactions
        zombie.send_signal(signal.SIGSTOP)
        # Its session runs out; the successor takes every partition, starts their transactional ids (fencing
        # the zombie's producers and aborting their transactions) and answers the six questions again.
        async with running_worker(msgspec.structs.replace(cfg, transaction_ms=50), Labelled("successor")) as successor:
            answers = await committed_answers(cfg, 6)
            await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, ends)
            zombie.send_signal(signal.SIGCONT)  # it finds its group moved on and tries to commit what it sent
            await eventually(lambda: "transaction.aborted" in log.read_text() or zombie.poll() is not None,
                             timeout=30)
            assert successor.statistics().transactions >= 1
        again = await committed_answers(cfg, 6)
    finally:
        zombie.kill()
        zombie.wait(10)
    assert "] committed " not in log.read_text()  # not one of its transactions committed
    assert len(answers) == 6 and sorted(decode_answer(r.value).text for r in again) == ["successor: hello"] * 6
    await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, ends)


@pytest.mark.kafka
async def test_a_worker_killed_between_send_and_commit_is_invisible_and_its_questions_answered_once(
        kafka_broker, tiny_model_dir, tmp_path):
    cfg = kafka_config(kafka_broker, delivery="exactly_once", partitions=2)
    await create_topics(cfg, topic_plan(cfg))
    env = serve_env(cfg, KEV_KAFKA__DELIVERY="exactly_once", KEV_KAFKA__TRANSACTION_MS="60000",
                    KEV_KAFKA__COMMIT_EVERY="1000", KEV_ROUTER__MAX_PARALLEL_QUERIES="8")
    good = [question(f"q{i}", f"Say {i}.", params={"max_new_tokens": 4, "temperature": 0}) for i in range(4)]
    with kev_processes() as children:
        child = KevProcess(["serve", "--model", str(tiny_model_dir), "--bootstrap-servers", cfg.bootstrap_servers],
                           env, tmp_path / "serve.log")
        children.append(child)
        await wait_log(child, "partitions_assigned", 90)
        positions = await produce(cfg.bootstrap_servers, cfg.questions_topic,
                                  good + [b"not json", question("bad", params={"temperature": -1})])
        # Sent and acked inside the worker's open transactions: four answers and an error answer, a dead letter.
        assert len(await read_topic(cfg.bootstrap_servers, cfg.answers_topic, 5, timeout=60, linger=0)) == 5
        assert len(await read_topic(cfg.bootstrap_servers, cfg.dlq_topic, 1, timeout=30, linger=0)) == 1
        assert not log_events(child, "committed")
        child.signal(signal.SIGKILL)
        child.wait(10)
    async with running_worker(cfg, Labelled("successor")):
        answers = await committed_answers(cfg, 5)
        dead = await committed_answers(cfg, 1, topic=cfg.dlq_topic)
        ends = commit_ends(positions, cfg.partitions)
        await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, ends)
    by_id = {}
    for record in answers:
        answer = decode_answer(record.value)
        by_id.setdefault(answer.question_id, []).append(answer)
    assert sorted(by_id) == ["bad", "q0", "q1", "q2", "q3"]
    assert all(len(each) == 1 for each in by_id.values())  # once, by the successor: the killed worker's aborted
    assert all(each[0].text.startswith("successor: ") for qid, each in by_id.items() if qid != "bad")
    assert by_id["bad"][0].error.code == "invalid_field" and len(dead) == 1


@pytest.mark.kafka
async def test_the_idempotent_gateway_producer_publishes_on_tansu(kafka_broker):
    from kev_async.gateway.publisher import QuestionPublisher

    cfg = kafka_config(kafka_broker)
    await create_topics(cfg, {cfg.questions_topic: 1})
    options = QuestionPublisher.producer_options(3000)
    assert options["enable_idempotence"] is True
    async with open_producer(cfg, **options) as producer:
        assert producer._txn_manager is not None and producer._txn_manager.producer_id >= 0
        await producer.send_and_wait(cfg.questions_topic, question("g0"))
    assert len(await read_topic(cfg.bootstrap_servers, cfg.questions_topic, 1, timeout=10, linger=0)) == 1

