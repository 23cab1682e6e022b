"""The fetch guard: no record's bytes can stop a consumer.

aiokafka parses every fetched batch inside its fetcher, before `getmany` returns, and decodes header
*names* as strict UTF-8 there. One record whose header name is not UTF-8 (legal on the wire: librdkafka
and the Java client send one), a batch whose CRC or compression is broken, or a record whose structure
does not parse makes `getmany` raise for its whole partition, again at every fetch of the same offset:
the consumer can never get past it, and on a compacted topic replayed from the start (kev.control)
no worker can start any more.

`install()` (run once by consumers/clients.py, before any consumer exists) puts `GuardedRecords` where
aiokafka's fetcher builds a fetch response's record set. It splits the response into batches itself
and reads each one with aiokafka's own reader (the C one where built); only a batch that reader cannot
finish is read again here, in Python, record by record:

- a record whose header names are not all UTF-8 comes through whole: its names decoded with
  `surrogateescape` (the raw bytes stay recoverable; valid UTF-8 never decodes to such surrogates) and
  an `Unreadable("header_not_utf8", ...)` in the record's `checksum`, which a v2 record never uses;
- what cannot be parsed at all (a CRC mismatch, a codec error, a broken record or batch) comes through
  as one stand-in record at the last offset it covers: its value the raw bytes that could be read, its
  checksum an `Unreadable` naming the reason and the first offset it stands for.

`unreadable(record)` says which records are such. Kev's question intake and control audit dead-letter
them; every other reader skips them with one log line; all of them commit past. A fix belongs upstream
(aiokafka could hand such records over with their names as bytes); until then this is the one place
that knows aiokafka's fetcher internals, and `install()` refuses an aiokafka it does not know.

It also reads for `isolation_level="read_committed"` consumers what the embedded Tansu leaves to them.
Tansu holds back every record at or past a partition's first open transaction (its last stable
offset), but lists no aborted transactions in its fetch responses, so aiokafka, which drops exactly the
listed ones, hands over the records of aborted transactions as if committed. For such a consumer a
response's transactional batches are matched with their producer's next control marker in the same
response: a commit's come through, an abort's come through empty (the fetcher moves past them), and a
batch whose marker is not in the response is not handed over, nor is anything after it: the fetcher asks
for it again. Tansu writes a transaction's markers before its records fall below the stable offset, so a
whole response carries them. Once a broker lists an aborted transaction (Apache Kafka does), it is
trusted to and this stays off for the rest of the process.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

from aiokafka import codec
from aiokafka.record.control_record import ABORT_MARKER, ControlRecord
from aiokafka.record.default_records import DefaultRecordBatch
from aiokafka.record.legacy_records import LegacyRecordBatch
from aiokafka.record.util import decode_varint

_LOG_OVERHEAD = 12  # base offset (int64) + length (int32), the same in every magic
_MAGIC_AT = 16
_V2_HEADER = struct.Struct(">qiibIhiqqqhii")  # aiokafka's DefaultRecordBatch.HEADER_STRUCT
_LEGACY_MIN = _LOG_OVERHEAD + 14  # the smallest v0 message
_CODEC_MASK, _TIMESTAMP_TYPE_MASK = 0x07, 0x08
_TRANSACTIONAL, _CONTROL = 0x10, 0x20  # v2 batch attributes
_READ_COMMITTED = 1  # aiokafka's isolation level value
_DECOMPRESS = {1: codec.gzip_decode, 2: codec.snappy_decode, 3: codec.lz4_decode, 4: codec.zstd_decode}
_STANDIN_VALUE_BYTES = 1 << 20  # a stand-in carries at most this much of the raw bytes


@dataclass(frozen=True, slots=True)
class Unreadable:
    """Why a fetched record could not be read as sent, and which offsets it stands for."""

    reason: str  # header_not_utf8 | crc_mismatch | corrupt_batch | corrupt_record
    message: str
    first_offset: int  # the first offset this record stands for; its own offset is the last

    def __repr__(self) -> str:
        return f"Unreadable({self.reason}: {self.message})"


def unreadable(record) -> Unreadable | None:
    """The record's Unreadable when the guard could not read it as sent, else None."""
    checksum = record.checksum
    return checksum if type(checksum) is Unreadable else None


def printable_headers(headers) -> list[tuple[str, bytes | None]]:
    """Headers a producer can send again: a name that is not UTF-8 becomes a `dlq.raw_header_name` header
    holding its raw bytes, followed by `dlq.raw_header_value` with its value, in its place."""
    out: list[tuple[str, bytes | None]] = []
    for name, value in headers or ():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            out += [("dlq.raw_header_name", name.encode("utf-8", "surrogateescape")), ("dlq.raw_header_value", value)]
        else:
            out.append((name, value))
    return out


class _Record:
    """What aiokafka's fetcher reads from a record (it builds the ConsumerRecord from these)."""

    __slots__ = ("offset", "timestamp", "timestamp_type", "key", "value", "headers", "checksum")

    def __init__(self, offset, timestamp, timestamp_type, key, value, headers, checksum=None) -> None:
        self.offset, self.timestamp, self.timestamp_type = offset, timestamp, timestamp_type
        self.key, self.value, self.headers, self.checksum = key, value, headers, checksum


class GuardedRecords:
    """A fetch response's record set (aiokafka's MemoryRecords interface) whose batches never raise."""

    def __init__(self, data) -> None:
        self._buffer = memoryview(data)
        self._raw = _split(self._buffer)
        self._next = next(self._raw, None)
        self._previous = None  # the batch handed out last: the next one's offsets start past its end
        self._handed = 0  # batches handed out
        self._fates: list[bool] | None = None  # read_committed(): per batch, hand its records over or not

    def size_in_bytes(self) -> int:
        return len(self._buffer)

    def has_next(self) -> bool:
        return self._next is not None and (self._fates is None or self._handed < len(self._fates))

    def next_batch(self):
        raw = self._next
        if not self.has_next():
            return None
        self._next = next(self._raw, None)
        floor = self._previous.next_offset if self._previous is not None else 0
        self._previous = _batch(raw, floor)
        keep = self._fates is None or self._fates[self._handed]
        self._handed += 1
        return self._previous if keep else _Aborted(self._previous)

    def read_committed(self) -> None:
        """From now on hand over only committed transactions' records, and nothing from the first batch
        whose transaction's outcome this response does not show (see the module's docstring)."""
        if self._handed == 0:
            self._fates = _fates(list(_split(self._buffer)))


def _split(buffer: memoryview) -> Iterator[memoryview]:
    """The response's whole batches; none past a partial batch at the end (the fetcher asks for it again)."""
    pos = 0
    while len(buffer) - pos >= _LOG_OVERHEAD:
        length = struct.unpack_from(">i", buffer, pos + 8)[0]
        if length < _LEGACY_MIN - _LOG_OVERHEAD:
            # No batch is this short: nothing after it can be found. Hand over what is left as one broken
            # batch (it stands for its base offset), so the partition moves past it.
            yield buffer[pos:]
            return
        end = pos + _LOG_OVERHEAD + length
        if end > len(buffer):
            return
        yield buffer[pos:end]
        pos = end


def _fates(raws: list[memoryview]) -> list[bool]:
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


def _transaction_head(raw: memoryview) -> tuple[int | None, int]:
    """(producer id, attributes) of a v2 batch; (None, 0) for anything else."""
    if len(raw) < _V2_HEADER.size or raw[_MAGIC_AT] < 2:
        return None, 0
    fields = _V2_HEADER.unpack_from(raw, 0)
    return fields[9], fields[5]


def _marker(raw: memoryview) -> ControlRecord | None:
    """The control record of a control batch; None when it does not parse (taken as a commit)."""
    try:
        for record in DefaultRecordBatch(raw):
            return ControlRecord.parse(record.key)
    except Exception:  # noqa: BLE001 - a broken marker: its batches are handed over, as aiokafka would
        return None
    return None


class _Aborted:
    """A batch of an aborted transaction: no records, only its place (the fetcher moves past it)."""

    def __init__(self, batch) -> None:
        self._batch = batch

    def __getattr__(self, name):
        return getattr(self._batch, name)

    def __iter__(self):
        return iter(())


def _batch(raw: memoryview, floor: int):
    """`floor`: where the previous batch of the response ended; no batch moves the fetcher back before it."""
    base = struct.unpack_from(">q", raw, 0)[0]
    magic = raw[_MAGIC_AT] if len(raw) > _MAGIC_AT else -1
    try:
        if magic >= 2 and len(raw) >= _V2_HEADER.size:
            return _GuardedBatch(DefaultRecordBatch(raw), raw, base, floor)
        if magic in (0, 1) and len(raw) >= _LEGACY_MIN:
            return _GuardedBatch(LegacyRecordBatch(raw, magic), raw, base, floor)
    except Exception as error:  # noqa: BLE001 - whatever the reader thinks of it, the batch is broken
        return _BrokenBatch(raw, base, floor, "corrupt_batch", f"the batch header does not parse: {error!r}"[:500])
    return _BrokenBatch(raw, base, floor, "corrupt_batch", f"{len(raw)} bytes with magic {magic} is no record batch")


class _GuardedBatch:
    """One batch read by aiokafka's reader; the records it cannot read are salvaged here instead."""

    def __init__(self, inner, raw: memoryview, base: int, floor: int) -> None:
        self._inner, self._raw, self._base = inner, raw, base
        self._floor = floor  # the fetcher's position once this batch is read never falls below it
        self._broken: tuple[str, str] | None = None
        self._records: Iterator | None = None
        self._last: int | None = None  # the last offset handed out

    def __getattr__(self, name):  # producer_id, is_control_batch, base_offset, ...: the reader's own
        return getattr(self._inner, name)

    @property
    def next_offset(self) -> int:
        """Where the fetcher goes on from: past this batch, and never back (a lastOffsetDelta below its
        records', or a base offset below an earlier batch's, would make it fetch the same records again)."""
        after_last = -1 if self._last is None else self._last + 1
        try:
            claimed = self._inner.next_offset
        except Exception:  # noqa: BLE001 - a legacy batch too broken to say
            claimed = self._base + 1
        return max(claimed, after_last, self._floor)

    def validate_crc(self) -> bool:
        if not self._inner.validate_crc():
            self._broken = ("crc_mismatch", "the batch's CRC does not match its bytes")
        return True  # the fetcher raises on False; a broken batch comes through as its stand-in instead

    def __iter__(self):
        return self

    def __next__(self):
        if self._records is None:
            self._records = self._read()
        return next(self._records)

    def _read(self) -> Iterator:
        if self._broken is not None:
            standin = _standin(self._raw, self._base, self._last_offset(), *self._broken)
            self._last = standin.offset
            yield standin
            return
        try:
            for record in self._inner:
                self._last = record.offset
                yield record
            return
        except Exception as error:  # noqa: BLE001 - the reader gave up on this batch: salvage the rest here
            problem = error
        for record in self._salvage(self._last, problem):
            self._last = record.offset
            yield record

    def _salvage(self, after: int | None, problem: Exception) -> Iterator:
        first = self._base if after is None else after + 1
        if self._inner.magic < 2:
            yield _standin(self._raw, first, self._last_offset(first), "corrupt_record", repr(problem)[:500])
            return
        try:
            yield from _read_v2(self._raw, after)
        except _Broken as broken:
            start = max(first, broken.offset if broken.offset is not None else first)
            yield _standin(self._raw, start, self._last_offset(start), broken.reason, broken.message)

    def _last_offset(self, at_least: int = 0) -> int:
        try:
            return max(at_least, self._inner.next_offset - 1)
        except Exception:  # noqa: BLE001 - a legacy batch too broken to say
            return at_least


class _BrokenBatch:
    """A batch whose header cannot be read: one stand-in record for its base offset."""

    magic = 2
    producer_id = None  # not transactional, as far as anyone can tell: the fetcher's abort logic skips it
    is_control_batch = False
    is_transactional = False

    def __init__(self, raw: memoryview, base: int, floor: int, reason: str, message: str) -> None:
        self.base_offset = base
        self.next_offset = max(base + 1, floor)
        self._standin = _standin(raw, base, base, reason, message)
        self._given = False

    def validate_crc(self) -> bool:
        return True

    def __iter__(self):
        return self

    def __next__(self):
        if self._given:
            raise StopIteration
        self._given = True
        return self._standin


class _Broken(Exception):
    def __init__(self, reason: str, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.offset = reason, message, offset


def _standin(raw: memoryview, first: int, last: int, reason: str, message: str) -> _Record:
    value = bytes(raw[:_STANDIN_VALUE_BYTES])
    return _Record(last, -1, 0, None, value, [], Unreadable(reason, message, first))


def _read_v2(raw: memoryview, after: int | None) -> Iterator[_Record]:
    """Every record of a v2 batch past offset `after`, header names decoded leniently; _Broken when the
    batch or a record does not parse (records before it were yielded)."""
    (base, _length, _epoch, _magic, _crc, attributes, _last_delta, first_ts, max_ts, _pid, _pepoch, _seq,
     count) = _V2_HEADER.unpack_from(raw, 0)
    body = raw[_V2_HEADER.size:]
    compression = attributes & _CODEC_MASK
    if compression:
        decompress = _DECOMPRESS.get(compression)
        if decompress is None:
            raise _Broken("corrupt_batch", f"unknown compression codec {compression}")
        try:
            body = memoryview(decompress(body.tobytes() if compression != 1 else body))
        except Exception as error:  # noqa: BLE001 - any codec's failure
            raise _Broken("corrupt_batch", f"the batch does not decompress: {error!r}"[:500]) from None
    log_append = bool(attributes & _TIMESTAMP_TYPE_MASK)
    pos = 0
    for _ in range(max(0, count)):
        offset = None
        try:
            record, pos, offset = _read_record(body, pos, base, first_ts, max_ts, log_append)
        except _Broken:
            raise
        except Exception as error:  # noqa: BLE001 - an index or varint out of range: the record is broken
            raise _Broken("corrupt_record", f"a record does not parse: {error!r}"[:500], offset) from None
        if after is None or record.offset > after:
            yield record


def _read_record(buffer: memoryview, pos: int, base: int, first_ts: int, max_ts: int,
                 log_append: bool) -> tuple[_Record, int, int]:
    length, pos = decode_varint(buffer, pos)
    start = pos
    _attributes, pos = decode_varint(buffer, pos)
    ts_delta, pos = decode_varint(buffer, pos)
    offset_delta, pos = decode_varint(buffer, pos)
    offset = base + offset_delta
    key, pos = _nullable_bytes(buffer, pos)
    value, pos = _nullable_bytes(buffer, pos)
    count, pos = decode_varint(buffer, pos)
    if count < 0:
        raise _Broken("corrupt_record", f"record at offset {offset} has {count} headers", offset)
    headers, bad_names = [], []
    for _ in range(count):
        name_len, pos = decode_varint(buffer, pos)
        if name_len < 0 or pos + name_len > len(buffer):
            raise _Broken("corrupt_record", f"record at offset {offset}: a header name runs out of the record",
                          offset)
        raw_name = bytes(buffer[pos:pos + name_len])
        pos += name_len
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError as error:
            name = raw_name.decode("utf-8", "surrogateescape")
            bad_names.append(f"header {len(headers)} ({raw_name[:40]!r}): not UTF-8 at byte {error.start}")
        header_value, pos = _nullable_bytes(buffer, pos)
        headers.append((name, header_value))
    if pos - start != length:
        raise _Broken("corrupt_record", f"record at offset {offset} is {pos - start} bytes, its length says {length}",
                      offset)
    timestamp = max_ts if log_append else first_ts + ts_delta
    checksum = Unreadable("header_not_utf8", "; ".join(bad_names)[:1000], offset) if bad_names else None
    return _Record(offset, timestamp, int(log_append), key, value, headers, checksum), pos, offset


def _nullable_bytes(buffer: memoryview, pos: int) -> tuple[bytes | None, int]:
    size, pos = decode_varint(buffer, pos)
    if size < 0:
        return None, pos
    if pos + size > len(buffer):
        raise IndexError(f"{size} bytes wanted at {pos} of {len(buffer)}")
    return bytes(buffer[pos:pos + size]), pos + size


_KNOWN_FETCHER = "aiokafka.consumer.fetcher"


def install() -> None:
    """Make every aiokafka consumer in this process read its fetches through GuardedRecords, and its
    read_committed fetches without aborted transactions' records (idempotent)."""
    from aiokafka.consumer import fetcher

    current = getattr(fetcher, "MemoryRecords", None)
    if current is GuardedRecords:
        return
    if current is None or not hasattr(fetcher, "PartitionRecords") or fetcher.READ_COMMITTED != _READ_COMMITTED:
        raise RuntimeError(f"{_KNOWN_FETCHER} no longer builds MemoryRecords where Kev's fetch guard expects it: "
                           "this aiokafka is newer than consumers/record_guard.py knows; pin aiokafka or update the guard")
    fetcher.MemoryRecords = GuardedRecords
    fetcher.PartitionRecords = _committed_only(fetcher.PartitionRecords)


_broker_lists_aborts = False  # a fetch response listed an aborted transaction: the broker filters for itself


def _committed_only(partition_records: type) -> type:
    """aiokafka's PartitionRecords, asking a read_committed consumer's record set for committed records only."""

    class CommittedPartitionRecords(partition_records):
        def __init__(self, tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                     check_crcs, isolation_level) -> None:
            global _broker_lists_aborts
            _broker_lists_aborts = _broker_lists_aborts or bool(aborted_transactions)
            if isolation_level == _READ_COMMITTED and not _broker_lists_aborts and isinstance(records, GuardedRecords):
                records.read_committed()
            super().__init__(tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                             check_crcs, isolation_level)

    return CommittedPartitionRecords
