"""One batch of a fetch response, read so that nothing in it can raise (the fetch guard's reader,
consumers/kafka_client/record_guard.py): aiokafka's own reader first; the records it cannot read are read again here
record by record, header names decoded with `surrogateescape`, and what does not parse at all comes
through as one stand-in record whose checksum is an `Unreadable` naming why."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

from aiokafka import codec
from aiokafka.record.default_records import DefaultRecordBatch
from aiokafka.record.legacy_records import LegacyRecordBatch
from aiokafka.record.util import decode_varint

LOG_OVERHEAD = 12  # base offset (int64) + length (int32), the same in every magic
MAGIC_AT = 16
V2_HEADER = struct.Struct(">qiibIhiqqqhii")  # aiokafka's DefaultRecordBatch.HEADER_STRUCT
LEGACY_MIN = LOG_OVERHEAD + 14  # the smallest v0 message
_CODEC_MASK, _TIMESTAMP_TYPE_MASK = 0x07, 0x08
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


class _Record:
    """What aiokafka's fetcher reads from a record (it builds the ConsumerRecord from these)."""

    __slots__ = ("offset", "timestamp", "timestamp_type", "key", "value", "headers", "checksum")

    def __init__(self, offset, timestamp, timestamp_type, key, value, headers, checksum=None) -> None:
        self.offset, self.timestamp, self.timestamp_type = offset, timestamp, timestamp_type
        self.key, self.value, self.headers, self.checksum = key, value, headers, checksum


def read_batch(raw: memoryview, floor: int):
    """`floor`: where the previous batch of the response ended; no batch moves the fetcher back before it."""
    base = struct.unpack_from(">q", raw, 0)[0]
    magic = raw[MAGIC_AT] if len(raw) > MAGIC_AT else -1
    try:
        if magic >= 2 and len(raw) >= V2_HEADER.size:
            return _GuardedBatch(DefaultRecordBatch(raw), raw, base, floor)
        if magic in (0, 1) and len(raw) >= LEGACY_MIN:
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
     count) = V2_HEADER.unpack_from(raw, 0)
    body = raw[V2_HEADER.size:]
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
