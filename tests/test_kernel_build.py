"""Building Kev's C++ kernels survives a build that was killed half-way.

torch's builder waits, without end, while a lock file from an earlier build exists. A worker killed
during its first start (the kernels build once per machine) left one behind, and every later start
sat at `kernel.building`, idle, until someone deleted the file by hand.
"""

import os
import subprocess
import sys
import time
import uuid

from torch.utils.cpp_extension import _get_build_directory

from engine.kernels import extension

SOURCE = "#include <torch/extension.h>\nint64_t twice(int64_t x) { return 2 * x; }  // %s\n"


def _build_dir(tmp_path, tag: str):
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE % tag)
    name = f"kevtest_{extension._build_key(source.read_text(), ('-O1',))}"
    return source, name, _get_build_directory(name, verbose=False)


def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_goes_on(tmp_path):
    source, name, directory = _build_dir(tmp_path, uuid.uuid4().hex)
    lock = os.path.join(directory, "lock")
    open(lock, "w").close()
    old = time.time() - 2 * extension.STALE_LOCK_S
    os.utime(lock, (old, old))
    # A subprocess, so a regression fails on the timeout instead of hanging the suite.
    code = ("import pathlib, sys; from engine.kernels import extension; "
            f"m = extension.build('kevtest', [pathlib.Path({str(source)!r})], ['twice'], ('-O1',)); "
            "sys.exit(0 if m is not None and m.twice(21) == 42 else 1)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel.stale_lock_removed" in done.stdout + done.stderr


def test_a_fresh_lock_is_left_to_the_build_that_holds_it(tmp_path):
    _, name, directory = _build_dir(tmp_path, uuid.uuid4().hex)
    lock = os.path.join(directory, "lock")
    open(lock, "w").close()
    extension._clear_stale_lock(name)
    assert os.path.exists(lock)
    os.remove(lock)


def test_the_build_directory_is_torch_s_own(monkeypatch, tmp_path):
    """Kev finds a built kernel where torch's builder put it without importing the builder (setuptools,
    ~4 MiB in every serving process): the same path as torch's, by default and under TORCH_EXTENSIONS_DIR."""
    assert extension.build_directory("kev_probe") == _get_build_directory("kev_probe", verbose=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension.build_directory("kev_probe") == _get_build_directory("kev_probe", verbose=False)
