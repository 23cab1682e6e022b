"""A torch C++ extension compiled from a .cpp file beside Kev's kernels, once per machine and source.

The library goes into torch's extension cache under a name keyed by the source, its compiler flags, the
CPU's flags and torch's version, so an edit, other flags or a cache carried to another CPU compile anew;
a later start imports the library directly. Kev's CPU kernels are built here (engine/kernels/native.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys
import time

import structlog
import torch

log = structlog.get_logger("kev.engine.extension")

STALE_LOCK_S = 600.0  # ten builds' time: older, the lock's builder is gone


def build(stem: str, sources: list[pathlib.Path], functions: list[str], cflags: tuple[str, ...]):
    """The compiled module `<stem>_<key>` exposing `functions`, or None where it cannot be built (no
    compiler, no headers, flags this CPU or compiler refuses); the reason is logged. `sources` are
    compiled as one translation unit, in order, so a later file calls an earlier one's functions."""
    text = "\n".join(source.read_text() for source in sources)
    name = f"{stem}_{_build_key(text, cflags)}"
    try:
        return _import_built(name)
    except Exception:  # not built on this machine yet (or not loadable): build it
        pass
    try:
        from torch.utils.cpp_extension import load_inline  # pulls in setuptools: only when a build is needed

        _clear_stale_lock(name)
        log.info("kernel.building", kernel=stem, note="once per machine, about a minute")
        started = time.monotonic()
        module = load_inline(name=name, cpp_sources=text, functions=functions, extra_cflags=list(cflags),
                             extra_ldflags=["-fopenmp"], verbose=False)
        log.info("kernel.built", kernel=stem, seconds=round(time.monotonic() - started, 1))
        return module
    except Exception as error:
        log.warning("kernel.unavailable", kernel=stem, error=f"{type(error).__name__}: {error}"[:300])
        return None


def _import_built(name: str):
    """The library an earlier build left, imported directly: load_inline would re-run ninja under a lock
    file on every start, and a process killed while holding that lock leaves later starts waiting on it."""
    library = os.path.join(build_directory(name), f"{name}.so")
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or not os.path.exists(library):
        raise FileNotFoundError(library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_directory(name: str) -> str:
    """Where torch's builder puts module `name` (torch.utils.cpp_extension._get_build_directory's path, made
    here without importing that module: it pulls in setuptools, ~4 MiB resident in every serving process)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch._appdirs import user_cache_dir

        accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                       f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")), f"{python}_{accelerator}")
    return os.path.join(root, name)


def _clear_stale_lock(name: str) -> None:
    """torch's build waits, without end, while its lock file exists: a process killed mid-build (a worker
    stopped during its first start) would leave every later start waiting silently. A build takes about
    a minute, so a lock older than STALE_LOCK_S has no live builder; it is removed and logged."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = pathlib.Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
        log.warning("kernel.stale_lock_removed", kernel=name, lock=str(lock), age_s=round(age))


def _build_key(text: str, cflags: tuple[str, ...]) -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1((text + " ".join(cflags) + flags + torch.__version__).encode()).hexdigest()[:12]
