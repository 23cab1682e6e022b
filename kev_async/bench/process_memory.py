"""A process's resident memory as Linux counts it, and which local process listens on a TCP port.

Read from /proc: VmHWM is the peak resident set since the process started (a load-time peak included),
VmRSS what is resident now. Elsewhere than Linux, or for a process this user may not inspect, None.
"""

from __future__ import annotations

import os
from pathlib import Path

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]"}


def resident_mib(pid: int | str = "self") -> dict[str, float] | None:
    """{"peak": VmHWM, "now": VmRSS} in MiB, or None when /proc cannot say."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    kib = {line.split(":")[0]: int(line.split()[1]) for line in lines if line.startswith(("VmHWM:", "VmRSS:"))}
    if len(kib) < 2:
        return None
    return {"peak": kib["VmHWM"] / 1024, "now": kib["VmRSS"] / 1024}


def listening_pid(port: int) -> int | None:
    """The process holding a listening TCP socket on `port` on this host, or None when none is visible."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with os.scandir(f"/proc/{entry.name}/fd") as fds:
                if any(os.readlink(fd.path) in targets for fd in fds):
                    return int(entry.name)
        except OSError:  # gone meanwhile, or not ours to inspect
            continue
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "IP:PORT" in hex, state 0A is LISTEN, field 9 the socket's inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes
