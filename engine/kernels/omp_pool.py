"""The calling thread's OpenMP worker pool, handed back before another thread takes over the math.

libgomp keeps a pool of worker threads for every thread that ever ran a parallel region, and once it
manages more threads than there are CPUs it cuts each worker's spin-wait to about a hundred turns:
after every parallel region the workers park in the kernel and must be woken for the next, and a step
of the layer stack runs some 240 regions. A model loaded on one thread (the event loop's, a loader's)
and stepped on the engine's device thread leaves two pools. On 2 cores a decode step of 4 questions
at 1,000 tokens then took 60-66 ms on another thread against 25-26 ms on the loading thread, and the
load trace's decode steps ran at half speed. So the thread that loaded the model or built the core
gives its pool back (OpenMP 5.0's omp_pause_resource_all) before the device thread starts, and a
device thread gives its own back when its engine closes (anyio keeps the thread for later work); a
later parallel region on any of them builds a fresh pool.

No torch import: it reads which OpenMP runtimes the process loaded from /proc/self/maps.
"""

from __future__ import annotations

import ctypes
import re

import structlog

log = structlog.get_logger("kev.kernels")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what can be rebuilt cheaply
_RUNTIME = re.compile(r"/lib(gomp|omp|iomp5)[^/]*\.so[^/]*$")


_found: list = []  # the runtime's omp_pause_resource_all, once found (looked for again until then)


def _pause_all():
    """omp_pause_resource_all of the OpenMP runtime this process loaded, or None."""
    if _found:
        return _found[0]
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if _RUNTIME.search(line.strip())}
    except OSError:  # not Linux: nothing to find, nothing released
        return None
    # Other wheels bundle their own copy (sentencepiece's libgomp-<hash>.so): torch's is the one whose
    # pools the kernels use, so it is tried first.
    for path in sorted(paths, key=lambda path: "/torch/lib/" not in path):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        _found.append(pause)
        return pause
    return None


def release_thread_pool() -> bool:
    """Give back the calling thread's OpenMP workers; True where a runtime took the request."""
    pause = _pause_all()
    if pause is None:
        return False
    released = pause(OMP_PAUSE_SOFT) == 0  # -1 inside a parallel region: the pool is in use
    log.debug("openmp.pool_released", released=released)
    return released
