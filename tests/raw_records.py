"""Records no polite client writes: header names that are not UTF-8, and raw batch bytes, produced with a
bare ProduceRequest so the broker stores them as they are (a librdkafka or Java producer can send the former;
the latter stands in for a broken client or a corrupted log).

    batch = record_batch([(b"value", [(b"\\xff", b"v")])])
    await produce_batch(bootstrap, topic, 0, batch)
"""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka.client import AIOKafkaClient
from aiokafka.errors import for_code
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

RawHeaders = Sequence[tuple[bytes, bytes | None]]


class _RawName(str):
    """A header name that encodes to bytes of our choosing (aiokafka's pure-Python builder calls encode)."""

    def __new__(cls, raw: bytes) -> "_RawName":
        name = super().__new__(cls, raw.decode("latin-1"))
        name.raw = raw
        return name

    def encode(self, *_args, **_kwargs) -> bytes:
        return self.raw


def record_batch(records: Sequence[tuple[bytes | None, RawHeaders]], *, key: bytes | None = None,
                 compression: int = 0, timestamp_ms: int | None = None) -> bytes:
    """One v2 record batch: each (value, headers) a record, header names taken as raw bytes."""
    builder = _DefaultRecordBatchBuilderPy(magic=2, compression_type=compression, is_transactional=0,
                                           producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                           batch_size=16 * 1024 * 1024)
    for offset, (value, headers) in enumerate(records):
        named = [(_RawName(name), header) for name, header in headers]
        builder.append(offset, timestamp=timestamp_ms, key=key, value=value, headers=named)
    return bytes(builder.build())


async def produce_batch(bootstrap: str, topic: str, partition: int, batch: bytes) -> int:
    """Write one batch to the partition's leader as it is; returns the batch's base offset."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client._wait_on_metadata(topic)
        leader = client.cluster.leader_for_partition(_tp(topic, partition))
        request = ProduceRequest(transactional_id=None, required_acks=-1, timeout=10_000,
                                 topics=[(topic, [(partition, batch)])])
        response = await client.send(leader, request)
    finally:
        await client.close()
    (_name, partitions), = response.topics
    _partition, code, offset, *_ = partitions[0]
    if code:
        raise for_code(code)(f"producing a raw batch to {topic}/{partition}")
    return offset


def _tp(topic: str, partition: int):
    from aiokafka.structs import TopicPartition
    return TopicPartition(topic, partition)
