"""The loading thread's OpenMP workers are given back, so the device thread's pool is the only one and
libgomp keeps its workers spinning between a step's parallel regions (engine/kernels/omp_pool.py)."""

import importlib.util
import os

import pytest
import torch

from engine.kernels.omp_pool import release_thread_pool


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_calling_threads_workers_are_given_back(two_threads):
    if importlib.util.find_spec("sentencepiece"):  # not a dependency; where installed, transformers loads it
        import sentencepiece  # noqa: F401 - and with it a second libgomp copy: torch's must be the one released

    torch.ones(1 << 22).add_(1)  # a parallel region: this thread now has a pool with a worker
    with_pool = os_threads()
    assert release_thread_pool()
    assert os_threads() == with_pool - 1  # torch's runtime freed its worker, not the other copy
    assert release_thread_pool() and os_threads() == with_pool - 1  # nothing left to give back
    torch.ones(1 << 22).add_(1)  # the next region builds a fresh pool, with the same result
    assert os_threads() == with_pool
