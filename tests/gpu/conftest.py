"""The GPU suite: skipped where there is no CUDA, and never green-and-empty where there is.

On a machine whose torch sees CUDA (or with KEV_GPU_REQUIRED=1, which ops/gpu-check.sh sets), every
skip under tests/gpu is reported as a failure, at collection and at run time: a GPU run either runs
each test or says why it could not. Elsewhere each test skips through its module's `skipif`.

Fixtures: a tiny random Llama on the device three times over the same weights (transformers' in fp32,
the reference; Kev's in fp32 and bf16), and the served model: the real SmolLM2 when its files are on the
machine (KEV_GPU_MODEL, or the built-in package), else a tiny Llama saved as an HF directory. The device,
and the attention backends to test on it, are gpu_models.py's.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch

from gpu.gpu_models import DEVICE, byte_tokenizer, keep_fp32_exact, kev_model_on, save_model_dir, tiny_llama

REQUIRED = torch.cuda.is_available() or os.environ.get("KEV_GPU_REQUIRED") == "1"


def _as_failure(report, when: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped {when} on a machine that must run the GPU suite (CUDA present or "
                       f"KEV_GPU_REQUIRED=1), which counts as a failure: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report, "at " + report.when)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped:  # a module-level skip or importorskip
        _as_failure(report, "at collection")


@dataclass
class TinyGpu:
    """A random Llama on the device three times over the same weights: transformers' in fp32 (the reference)
    and Kev's in fp32 and bf16."""

    hf: object
    fp32: object
    bf16: object


@pytest.fixture(scope="session")
def gpu_tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_gpu(gpu_tokenizer) -> TinyGpu:
    keep_fp32_exact()
    cpu = tiny_llama(seed=3)
    kev = {dtype: kev_model_on(cpu, gpu_tokenizer, DEVICE, dtype, name=f"tiny-gpu-{name}")
           for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    return TinyGpu(copy.deepcopy(cpu).to(DEVICE), kev[torch.float32], kev[torch.bfloat16])


@dataclass
class Served:
    source: str  # what load_model is given
    kind: str  # where it came from: KEV_GPU_MODEL, the built-in SmolLM2, or the tiny stand-in


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Served:
    """The model `kev ask` would serve on this machine: KEV_GPU_MODEL, else the built-in SmolLM2, else a
    tiny random Llama saved as an HF directory (its files are ~98 MB, over what a GPU run may carry)."""
    from engine.model.loader import ModelNotFound, resolve_model_dir
    from schemas import DEFAULT_MODEL

    given = os.environ.get("KEV_GPU_MODEL")
    if given:
        resolve_model_dir(given)  # a model named but missing fails here, loudly
        return Served(given, "KEV_GPU_MODEL")
    try:
        resolve_model_dir(DEFAULT_MODEL)
        return Served(DEFAULT_MODEL, "built-in SmolLM2")
    except ModelNotFound:
        return Served(str(save_model_dir(tmp_path_factory.mktemp("tiny-served"))),
                      "tiny random Llama stand-in (no SmolLM2 on this machine)")
