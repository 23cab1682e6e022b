"""The fetch guard: no record's bytes can stop a consumer.

aiokafka parses every fetched batch inside its fetcher, before `getmany` returns, and decodes header
*names* as strict UTF-8 there. One record whose header name is not UTF-8 (legal on the wire: librdkafka
and the Java client send one), a batch whose CRC or compression is broken, or a record whose structure
does not parse makes `getmany` raise for its whole partition, again at every fetch of the same offset:
the consumer can never get past it, and on a compacted topic replayed from the start (kev.control)
no worker can start any more.

`install()` (run once by consumers/kafka_client/clients.py, before any consumer exists) puts `GuardedRecords` where
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

from consumers.kafka_client.batch_reader import LEGACY_MIN, LOG_OVERHEAD, Unreadable, read_batch, unreadable
from consumers.kafka_client.transaction_filter import READ_COMMITTED, Aborted, batch_fates, committed_only

__all__ = ["GuardedRecords", "Unreadable", "install", "printable_headers", "unreadable"]


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


class GuardedRecords:
    """A fetch response's record set (aiokafka's MemoryRecords interface) whose batches never raise."""

    def __init__(self, data) -> None:
        self._buffer = memoryview(data)
        self._raw = split_batches(self._buffer)
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
        self._previous = read_batch(raw, floor)
        keep = self._fates is None or self._fates[self._handed]
        self._handed += 1
        return self._previous if keep else Aborted(self._previous)

    def read_committed(self) -> None:
        """From now on hand over only committed transactions' records, and nothing from the first batch
        whose transaction's outcome this response does not show (see the module's docstring)."""
        if self._handed == 0:
            self._fates = batch_fates(list(split_batches(self._buffer)))


def split_batches(buffer: memoryview) -> Iterator[memoryview]:
    """The response's whole batches; none past a partial batch at the end (the fetcher asks for it again)."""
    pos = 0
    while len(buffer) - pos >= LOG_OVERHEAD:
        length = struct.unpack_from(">i", buffer, pos + 8)[0]
        if length < LEGACY_MIN - LOG_OVERHEAD:
            # No batch is this short: nothing after it can be found. Hand over what is left as one broken
            # batch (it stands for its base offset), so the partition moves past it.
            yield buffer[pos:]
            return
        end = pos + LOG_OVERHEAD + length
        if end > len(buffer):
            return
        yield buffer[pos:end]
        pos = end


_KNOWN_FETCHER = "aiokafka.consumer.fetcher"


def install() -> None:
    """Make every aiokafka consumer in this process read its fetches through GuardedRecords, and its
    read_committed fetches without aborted transactions' records (idempotent)."""
    from aiokafka.consumer import fetcher

    current = getattr(fetcher, "MemoryRecords", None)
    if current is GuardedRecords:
        return
    if current is None or not hasattr(fetcher, "PartitionRecords") or fetcher.READ_COMMITTED != READ_COMMITTED:
        raise RuntimeError(f"{_KNOWN_FETCHER} no longer builds MemoryRecords where Kev's fetch guard expects it: "
                           "this aiokafka is newer than consumers/kafka_client/record_guard.py knows; pin aiokafka or update the guard")
    fetcher.MemoryRecords = GuardedRecords
    fetcher.PartitionRecords = committed_only(fetcher.PartitionRecords, GuardedRecords)
