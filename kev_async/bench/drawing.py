"""matplotlib, which only the benchmarks' pictures need (`kev bench load --plot`, `kev bench kafka --profile`'s
timeline): it is Kev's `bench` extra, not a dependency of the service. The drawing modules import it when they
draw; the commands ask for it here first, so a missing extra is one line before a run, not a traceback after it."""

from __future__ import annotations

import importlib.util
import sys


def matplotlib_missing(command: str, option: str) -> bool:
    """Whether matplotlib is absent; if so, say which extra brings it (and `option` to do without) on stderr."""
    if importlib.util.find_spec("matplotlib") is not None:
        return False
    print(f"{command}: error: drawing needs matplotlib, Kev's bench extra: pip install 'kev[bench]' "
          f"(in a clone: .venv/bin/pip install -e '.[bench]'), or {option}", file=sys.stderr)
    return True
