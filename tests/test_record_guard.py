"""No record's bytes can stop a consumer (consumers/kafka_client/record_guard.py).

At the fetch layer: fetch responses read through aiokafka's own PartitionRecords (the fetcher's class,
as `getmany` uses it) over the guard's record set, for batches with header names that are not UTF-8,
every codec, broken CRCs and bodies, and a Hypothesis fuzz over mutated batches. Against the embedded
broker: such a record among good questions with two workers, and on the control topic under a worker,
its control audit and the gateway.
"""

from __future__ import annotations

import os
import struct

import anyio
import msgspec
import pytest
from aiokafka.consumer.fetcher import READ_UNCOMMITTED, PartitionRecords
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import TopicPartition
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from consumers.kafka_client.record_guard import GuardedRecords, printable_headers, unreadable
from raw_records import produce_batch, record_batch

TP = TopicPartition("t", 0)
GZIP, SNAPPY, LZ4, ZSTD = 1, 2, 3, 4


def read_fetch(data: bytes, fetch_offset: int = 0) -> list:
    """Every record of one fetch response, as aiokafka's fetcher hands them to getmany."""
    return list(PartitionRecords(TP, GuardedRecords(data), [], fetch_offset, None, None, True, READ_UNCOMMITTED))


def with_base_offset(batch: bytes, base: int) -> bytes:
    return struct.pack(">q", base) + batch[8:]


def refresh_crc(batch: bytes) -> bytes:
    """A v2 batch whose CRC matches its (altered) bytes, as a broker that stored them would serve it."""
    return batch[:17] + struct.pack(">I", calc_crc32c(batch[21:])) + batch[21:]


BAD_NAME = b"\xff\xfename"


def three_records(compression: int = 0) -> bytes:
    return record_batch([(b"good-0", [(b"a", b"1")]), (b"bad-1", [(b"ok", b"2"), (BAD_NAME, b"v")]),
                         (b"good-2", [])], compression=compression)


@pytest.mark.parametrize("compression", [0, GZIP, SNAPPY, LZ4, ZSTD])
def test_a_header_name_that_is_not_utf8_comes_through_marked_and_its_neighbours_untouched(compression):
    records = read_fetch(three_records(compression))
    assert [(r.offset, r.value) for r in records] == [(0, b"good-0"), (1, b"bad-1"), (2, b"good-2")]
    assert [unreadable(r) is None for r in records] == [True, False, True]
    assert records[0].headers == (("a", b"1"),)
    broken = unreadable(records[1])
    assert (broken.reason, broken.first_offset) == ("header_not_utf8", 1)
    assert "not UTF-8 at byte 0" in broken.message
    name, value = records[1].headers[1]
    assert (name.encode("utf-8", "surrogateescape"), value) == (BAD_NAME, b"v")  # the raw name, recoverable
    # What a dead letter carries: every header a producer can send again, the raw name among them.
    assert printable_headers(records[1].headers) == [("ok", b"2"), ("dlq.raw_header_name", BAD_NAME),
                                                     ("dlq.raw_header_value", b"v")]


def test_a_fetch_that_starts_mid_batch_skips_what_came_before_even_when_salvaging():
    records = read_fetch(three_records(), fetch_offset=1)
    assert [r.offset for r in records] == [1, 2]
    assert unreadable(records[0]).reason == "header_not_utf8"


def test_good_batches_read_exactly_as_aiokafka_reads_them():
    from aiokafka.record.memory_records import MemoryRecords

    data = (record_batch([(b"a", [(b"h", b"1")]), (b"b", [])]) +
            with_base_offset(record_batch([(None, [(b"k", None)])], compression=LZ4), 2))
    ours = read_fetch(data)
    theirs = list(PartitionRecords(TP, MemoryRecords(data), [], 0, None, None, True, READ_UNCOMMITTED))
    assert ours == theirs
    assert all(unreadable(r) is None for r in ours)


def test_a_crc_mismatch_is_one_stand_in_for_the_whole_batch_and_the_next_batch_still_reads():
    bad = bytearray(three_records())
    bad[-3] ^= 0xFF  # a byte of the last record's body, CRC left as it was
    data = bytes(bad) + with_base_offset(record_batch([(b"next", [])]), 3)
    records = read_fetch(data)
    assert [r.offset for r in records] == [2, 3]
    broken = unreadable(records[0])
    assert (broken.reason, broken.first_offset) == ("crc_mismatch", 0)
    assert records[0].value == bytes(bad)  # the raw batch, for whoever inspects the dead letter
    assert records[1].value == b"next" and unreadable(records[1]) is None


def test_a_body_that_does_not_decompress_is_one_stand_in():
    batch = bytearray(record_batch([(b"x" * 100, []), (b"y", [])], compression=ZSTD))
    batch[70:80] = b"\x00" * 10  # inside the compressed body
    records = read_fetch(refresh_crc(bytes(batch)))
    assert [(r.offset, unreadable(r).reason, unreadable(r).first_offset) for r in records] == [(1, "corrupt_batch", 0)]


def test_a_length_no_batch_can_have_ends_the_fetch_with_a_stand_in_for_its_offset():
    good = record_batch([(b"a", [])])
    garbage = struct.pack(">qi", 1, 3) + b"\x02" * 20
    records = read_fetch(good + garbage)
    assert [r.offset for r in records] == [0, 1]
    assert unreadable(records[1]).reason == "corrupt_batch"


def test_a_partial_batch_at_the_end_is_left_for_the_next_fetch():
    good = record_batch([(b"a", [])])
    partial = with_base_offset(record_batch([(b"b", [])]), 1)[:-5]
    assert [r.value for r in read_fetch(good + partial)] == [b"a"]


# -- the fuzz ------------------------------------------------------------------------------------------

header_names = st.one_of(st.binary(max_size=6), st.sampled_from([b"ok", BAD_NAME, b"\xc3", b"\xed\xa0\x80"]))
records_st = st.lists(st.tuples(st.one_of(st.none(), st.binary(max_size=40)),
                                st.lists(st.tuples(header_names, st.one_of(st.none(), st.binary(max_size=8))),
                                         max_size=3)), min_size=1, max_size=4)
batches_st = st.lists(st.tuples(records_st, st.sampled_from([0, GZIP, SNAPPY, LZ4, ZSTD])), min_size=1, max_size=3)
mutations = st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "crc"]), st.integers(0, 10_000),
                               st.integers(0, 255)), max_size=4)


def build_fetch(batches) -> tuple[bytes, list]:
    data, expected, base = b"", [], 0
    for records, compression in batches:
        data += with_base_offset(record_batch(records, compression=compression), base)
        expected += records
        base += len(records)
    return data, expected


def mutate(data: bytes, how) -> bytes:
    out = bytearray(data)
    for kind, at, byte in how:
        if not out:
            break
        at %= len(out)
        if kind == "flip":
            out[at] ^= byte or 1
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = bytes([byte])
        elif kind == "crc" and len(out) > 61:
            out[:] = refresh_crc(bytes(out))
    return bytes(out)


def is_utf8(name: bytes) -> bool:
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=int(os.environ.get("KEV_FUZZ_EXAMPLES", 300)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=batches_st, how=mutations)
@example(batches=[([(b"v", [(BAD_NAME, b"x")])], 0)], how=[])
@example(batches=[([(None, [])], 0)] * 3, how=[("flip", 0, 0)])  # a first base offset far ahead of the rest
@example(batches=[([(None, []), (b"x", [])], 0)] * 2, how=[("flip", 23, 255), ("crc", 0, 0)])  # lastOffsetDelta < 0
def test_no_fetch_response_raises_and_offsets_only_grow(batches, how):
    data, expected = build_fetch(batches)
    records = read_fetch(mutate(data, how))
    offsets = [r.offset for r in records]
    assert offsets == sorted(set(offsets))  # each once, in order: the fetcher's position can always move on
    if not how:  # unharmed: every record as written, marked exactly where a header name is not UTF-8
        assert [(r.value, unreadable(r) is None) for r in records] == \
            [(value, all(is_utf8(name) for name, _ in headers)) for value, headers in expected]


# -- against the broker ------------------------------------------------------------------------------

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


@pytest.mark.kafka
@pytest.mark.anyio
async def test_two_workers_answer_every_good_question_around_a_bad_header_name_and_dead_letter_it_once(
        kafka_broker):
    from kafka_fixtures import StandInEngine, kafka_config, produce, question, read_topic, running_worker
    from schemas import decode_answer

    cfg = kafka_config(kafka_broker, partitions=2)
    bootstrap = kafka_broker.bootstrap_servers
    await produce(bootstrap, cfg.questions_topic, [question("before-0")], partition=0)
    # One batch: a good question, the bad record, another good question (librdkafka batches like this).
    await produce_batch(bootstrap, cfg.questions_topic, 0, with_base_offset(record_batch(
        [(question("in-batch-1"), []), (question("bad"), [(BAD_NAME, b"v")]), (question("in-batch-3"), [])]), 0))
    engines = [StandInEngine(), StandInEngine()]
    async with running_worker(cfg, engines[0]) as first, running_worker(cfg, engines[1]) as second:
        good = [question(f"after-{i}") for i in range(6)]
        await produce(bootstrap, cfg.questions_topic, good[:3], partition=0)
        await produce(bootstrap, cfg.questions_topic, good[3:], partition=1)
        answers = await read_topic(bootstrap, cfg.answers_topic, 9, timeout=40)
        dead = await read_topic(bootstrap, cfg.dlq_topic, 1, linger=1.0)
        assert first.healthy() and second.healthy()
        assert first.statistics().assigned and second.statistics().assigned  # both consuming
    answered = sorted(decode_answer(r.value).question_id for r in answers)
    assert answered == sorted(["before-0", "in-batch-1", "in-batch-3", *(f"after-{i}" for i in range(6))])
    assert len(dead) == 1
    headers = dict(dead[0].headers)
    assert headers["dlq.reason"] == b"header_not_utf8"
    assert headers["dlq.raw_header_name"] == BAD_NAME and headers["dlq.source.offset"] == b"2"
    assert msgspec.json.decode(dead[0].value)["question_id"] == "bad"  # the value, unchanged


@pytest.mark.kafka
@pytest.mark.anyio
async def test_the_control_reader_and_audit_pass_a_bad_header_name_on_the_control_topic(kafka_broker):
    from functools import partial

    from gateway_fixtures import TRUST_KEYS, produce_commands
    from kafka_fixtures import FAST_GROUP, kafka_config, read_topic

    from consumers import create_topics, run_control_audit, run_control_reader
    from schemas import ControlEvent, TrustConfig

    kafka = kafka_config(kafka_broker, trust=TrustConfig(keys=TRUST_KEYS))
    await create_topics(kafka, {kafka.control_topic: 1, kafka.dlq_topic: 1})
    first = ControlEvent(action="update_defaults", defaults={"temperature": 0.5})
    second = ControlEvent(action="update_defaults", defaults={"top_p": 0.9})
    await produce_commands(kafka.bootstrap_servers, kafka.control_topic, [first])
    await produce_batch(kafka.bootstrap_servers, kafka.control_topic, 0,
                        record_batch([(b"{}", [(BAD_NAME, b"v")])], key=b"defaults:temperature"))
    await produce_commands(kafka.bootstrap_servers, kafka.control_topic, [second])
    send, receive = anyio.create_memory_object_stream(8)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            replayed = await tg.start(run_control_reader, kafka, send)
            applied = [await receive.receive() for _ in range(replayed)]
            await tg.start(partial(run_control_audit, consumer_options=FAST_GROUP), kafka)
            dead = await read_topic(kafka.bootstrap_servers, kafka.dlq_topic, 1, linger=1.5)
            tg.cancel_scope.cancel()
    assert applied == [first, second]
    assert [dict(r.headers)["dlq.reason"] for r in dead] == [b"header_not_utf8"]


@pytest.mark.kafka
def test_a_worker_and_the_gateway_start_with_a_bad_header_name_on_the_control_topic(kafka_broker, tiny_model):
    from gateway_fixtures import API_KEY, live_stack, stack_config
    from kafka_fixtures import kafka_config
    from openai import OpenAI

    from consumers import create_topics

    cfg = stack_config(kafka_config(kafka_broker, partitions=1))
    anyio.run(create_topics, cfg.kafka, {cfg.kafka.control_topic: 1}, backend="asyncio")
    anyio.run(produce_batch, kafka_broker.bootstrap_servers, cfg.kafka.control_topic, 0,
              record_batch([(b"{}", [(BAD_NAME, b"v")])]), backend="asyncio")
    with live_stack(cfg, tiny_model) as stack, \
            OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")
