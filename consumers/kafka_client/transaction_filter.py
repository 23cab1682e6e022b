"""Read committed on a broker that lists no aborted transactions (the embedded Tansu): a fetch response's
transactional batches are matched with their producer's next control marker in the same response (see
consumers/kafka_client/record_guard.py's docstring). aiokafka drops only the aborted transactions a broker lists."""

from __future__ import annotations

from typing import NamedTuple

from aiokafka.record.control_record import ABORT_MARKER, ControlRecord
from aiokafka.record.default_records import DefaultRecordBatch

from consumers.kafka_client.batch_reader import MAGIC_AT, V2_HEADER

_TRANSACTIONAL, _CONTROL = 0x10, 0x20  # v2 batch attributes
READ_COMMITTED = 1  # aiokafka's isolation level value


def batch_fates(raws: list[memoryview]) -> list[bool]:
    """Per batch, up to the first whose transaction is still open as far as these batches show: whether its
    records are handed over (False: an aborted transaction's)."""
    fates: list[bool | None] = []
    waiting: dict[int, list[int]] = {}  # producer id -> its transactional batches awaiting a marker
    for index, raw in enumerate(raws):
        producer_id, attributes = _transaction_head(raw)
        if producer_id is None or producer_id < 0 or not attributes & _TRANSACTIONAL:
            fates.append(True)
        elif attributes & _CONTROL:
            committed = _marker(raw) != ABORT_MARKER
            for waiting_index in waiting.pop(producer_id, ()):
                fates[waiting_index] = committed
            fates.append(True)  # aiokafka reads the marker itself and hands none over
        else:
            waiting.setdefault(producer_id, []).append(index)
            fates.append(None)
    open_from = min((indices[0] for indices in waiting.values()), default=len(fates))
    return [bool(fate) for fate in fates[:open_from]]


class BatchHead(NamedTuple):
    producer_id: int | None  # None: not a v2 batch
    control: bool  # a transaction's marker
    next_offset: int  # the offset after the batch's last


def batch_head(raw: memoryview) -> BatchHead:
    """What a batch says of itself: whose it is, whether it is a marker, where the next one starts."""
    if len(raw) < V2_HEADER.size or raw[MAGIC_AT] < 2:
        return BatchHead(None, False, int.from_bytes(raw[:8], "big", signed=True) + 1)
    fields = V2_HEADER.unpack_from(raw, 0)
    return BatchHead(fields[9], bool(fields[5] & _CONTROL), fields[0] + fields[6] + 1)


def is_commit(raw: memoryview) -> bool:
    """Whether a control batch is a commit marker (one that does not parse counts as one, as in batch_fates)."""
    return _marker(raw) != ABORT_MARKER


def _transaction_head(raw: memoryview) -> tuple[int | None, int]:
    """(producer id, attributes) of a v2 batch; (None, 0) for anything else."""
    if len(raw) < V2_HEADER.size or raw[MAGIC_AT] < 2:
        return None, 0
    fields = V2_HEADER.unpack_from(raw, 0)
    return fields[9], fields[5]


def _marker(raw: memoryview) -> ControlRecord | None:
    """The control record of a control batch; None when it does not parse (taken as a commit)."""
    try:
        for record in DefaultRecordBatch(raw):
            return ControlRecord.parse(record.key)
    except Exception:  # noqa: BLE001 - a broken marker: its batches are handed over, as aiokafka would
        return None
    return None


class Aborted:
    """A batch of an aborted transaction: no records, only its place (the fetcher moves past it)."""

    def __init__(self, batch) -> None:
        self._batch = batch

    def __getattr__(self, name):
        return getattr(self._batch, name)

    def __iter__(self):
        return iter(())


_broker_lists_aborts = False  # a fetch response listed an aborted transaction: the broker filters for itself


def committed_only(partition_records: type, guarded: type) -> type:
    """aiokafka's PartitionRecords, asking a read_committed consumer's record set (a `guarded` one, which
    can answer) for committed records only."""

    class CommittedPartitionRecords(partition_records):
        def __init__(self, tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                     check_crcs, isolation_level) -> None:
            global _broker_lists_aborts
            _broker_lists_aborts = _broker_lists_aborts or bool(aborted_transactions)
            if isolation_level == READ_COMMITTED and not _broker_lists_aborts and isinstance(records, guarded):
                records.read_committed()
            super().__init__(tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                             check_crcs, isolation_level)

    return CommittedPartitionRecords
