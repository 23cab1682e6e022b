"""matplotlib, which only Kev's pictures need (`kev audit render`, `kev pipeline --picture`, `kev bench load
--plot`, `kev bench kafka --profile`'s timeline): it is the `bench` extra, not a dependency of the service. The
drawing modules import it when they draw; the commands ask for it here first, so a missing extra is one line
before the work, not a traceback after it."""

from __future__ import annotations

import importlib.util
import sys


def matplotlib_missing(command: str, instead: str | None = None) -> bool:
    """Whether matplotlib is absent; if so, one line on stderr naming the extra that brings it (and `instead`,
    how to do without the picture)."""
    if importlib.util.find_spec("matplotlib") is not None:
        return False
    print(f"{command}: error: drawing needs matplotlib, Kev's bench extra: pip install 'kev[bench]' (in a clone: "
          f".venv/bin/pip install -e '.[bench]')" + (f"; or {instead}" if instead else ""), file=sys.stderr)
    return True
