"""Whether a committed transaction's records got their commit marker.

A broker SIGKILLed while a producer's EndTxn(commit) is in flight can come back with the transaction's
group offsets committed and its records in the log, but without the marker that decides them; the
producer's retried EndTxn is answered as a success. The embedded Tansu does this (tests/test_commit_markers.py
shows it): such records stay undecided, a read_committed reader never sees them, and the partition's last
stable offset stays below them, until the same producer id writes a marker there again (Apache Kafka's
transaction coordinator finishes a commit it has begun by itself, after a restart too).

So after each commit, Transactions looks for the producer's commit marker after the last record it wrote
to each partition (one Fetch per partition, read_uncommitted, answered as soon as the marker is there). Where none came, the records
are mended (partition_transaction.py `Transaction.mend`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import anyio
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, for_code
from aiokafka.protocol.fetch import FetchRequest

from consumers.kafka_client.record_guard import split_batches
from consumers.kafka_client.transaction_filter import batch_head, is_commit

READ_UNCOMMITTED = 0
FETCH_BYTES = 1 << 20
MAX_FETCH_BYTES = 1 << 28  # a record's batch is never larger than the broker's message.max.bytes
# A Fetch that may not wait: Tansu answers it with no partitions, and on durable storage one that may
# wait a millisecond comes back empty. It answers as soon as a byte is there, so this is paid only where
# nothing follows the record (no marker: `unmarked` looks again until its deadline).
FETCH_WAIT_MS = 200
# A broker may write its markers just after it answers EndTxn (Apache Kafka's coordinator does): how long
# a marker may take to show before the records count as unmarked, and how often to look meanwhile.
MARKER_WAIT_S = 1.0
LOOK_EVERY_S = 0.05


async def unmarked(producer: AIOKafkaProducer, last: Mapping[TopicPartition, int], *,
                   wait_s: float = MARKER_WAIT_S) -> set[TopicPartition]:
    """Of the partitions in `last` (-> the offset of the producer's last record there), those where no
    commit marker of the producer follows that record within `wait_s`."""
    pending = dict(last)
    deadline = time.monotonic() + wait_s
    while True:
        for tp, offset in list(pending.items()):
            if await _committed_after(producer, tp, offset):
                del pending[tp]
        if not pending or time.monotonic() >= deadline:
            return set(pending)
        await anyio.sleep(LOOK_EVERY_S)


async def _committed_after(producer: AIOKafkaProducer, tp: TopicPartition, offset: int) -> bool:
    """Whether the producer's first marker past `offset` on `tp` (read up to the high watermark) is a commit."""
    client, producer_id = producer.client, producer._txn_manager.producer_id
    at, size = offset + 1, FETCH_BYTES
    while True:
        node = client.cluster.leader_for_partition(tp)
        if node is None or node < 0:
            await client.force_metadata_update()
            node = client.cluster.leader_for_partition(tp)
        request = FetchRequest(FETCH_WAIT_MS, 1, size, READ_UNCOMMITTED, [(tp.topic, [(tp.partition, at, size)])])
        response = await client.send(node, request)
        answered = [partition for _topic, partitions in response.topics for partition in partitions]
        if not answered:
            return False  # nothing to go by: looked at again while `unmarked` waits
        ((_partition, error, highwater, *_rest, raw),) = answered
        if error:
            raise for_code(error)(f"fetching {tp.topic}:{tp.partition} at {at} for the producer's marker")
        batches = list(split_batches(memoryview(raw or b"")))
        for batch in batches:
            head = batch_head(batch)
            if head.producer_id == producer_id and head.control:
                return is_commit(batch)
        if raw and not batches:  # a batch larger than we asked for (another writer's): ask for more, never guess
            if size >= MAX_FETCH_BYTES:
                raise KafkaError(f"a batch over {MAX_FETCH_BYTES} bytes at {tp.topic}:{tp.partition} {at}")
            size *= 4
            continue
        if not batches:
            return False
        # Never back or in place: Tansu stores a batch's negative lastOffsetDelta as sent (docs/reliability.md),
        # and another writer's such batch must not keep this scan, inside a commit, fetching one offset.
        at = max(at + 1, batch_head(batches[-1]).next_offset)
        if at >= highwater:
            return False
