"""`SlotTable`: each tenant's requests in flight, counted for all the processes of one
`kev gateway --processes N` together, so a tenant's cap holds for the fleet, not per process.

    table = SlotTable.create(tenants)                  # the parent, before it starts its children
    ... pass_fds=(table.fileno(),) ...                 # each child inherits the descriptor
    table = SlotTable(fd, tenants)                     # a child: the same counts, mapped
    if table.take("acme", limit): ... table.release("acme")

The table is a small unlinked file (one 32-bit count per tenant; index 0 is every anonymous caller
together) that every process maps into memory. A take or a release is a read and a write of one
count under a POSIX record lock on the file (`lockf`: two system calls, a few microseconds, never
held across an await), so two processes never both take a tenant's last slot. The kernel drops a
dead process's lock; the counts it held are not given back, but a child that dies stops the whole
fleet (processes.py). The tenants are known at start: they are the values of gateway.api_keys
(the parent hands every child the same keys), in sorted order.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
from collections.abc import Iterable

COUNT_BYTES = 4


class SlotTable:
    def __init__(self, fd: int, tenants: Iterable[str]) -> None:
        self._fd = fd
        self._index: dict[str | None, int] = {None: 0}
        self._index.update((tenant, i) for i, tenant in enumerate(sorted(set(tenants)), start=1))
        self._map = mmap.mmap(fd, COUNT_BYTES * len(self._index))
        self._counts = memoryview(self._map).cast("I")

    @classmethod
    def create(cls, tenants: Iterable[str]) -> SlotTable:
        """A new table, every count 0; keep it open while the children that inherit its descriptor run."""
        tenants = sorted(set(tenants))
        fd, path = tempfile.mkstemp(prefix="kev-gateway-slots-")
        os.unlink(path)  # only the descriptors keep it: nothing is left behind on disk
        os.ftruncate(fd, COUNT_BYTES * (len(tenants) + 1))
        return cls(fd, tenants)

    def fileno(self) -> int:
        return self._fd

    def take(self, tenant: str | None, limit: int) -> bool:
        """One more request in flight for `tenant`, unless it already has `limit` (then False)."""
        index = self._index[tenant]
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            held = self._counts[index]
            if held >= limit:
                return False
            self._counts[index] = held + 1
            return True
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def release(self, tenant: str | None) -> None:
        index = self._index[tenant]
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            self._counts[index] = max(0, self._counts[index] - 1)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def held(self, tenant: str | None) -> int:
        return self._counts[self._index[tenant]]

    def close(self) -> None:
        self._counts.release()
        self._map.close()
        os.close(self._fd)
