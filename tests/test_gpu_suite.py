"""tests/gpu never passes green and empty: without CUDA each test skips (so CI stays green), and on a machine
that must run it (CUDA present, or KEV_GPU_REQUIRED=1 as ops/gpu-check.sh sets) each skip is a failure
that names why. Run here as a user would run it, in a subprocess with CUDA hidden."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_gpu_suite(**env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env}
    environment.pop("KEV_GPU_TEST_DEVICE", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)


def test_without_cuda_every_gpu_test_skips():
    run = run_gpu_suite(KEV_GPU_REQUIRED="0")
    last = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and "skipped" in last and "passed" not in last and "failed" not in last, run.stdout


def test_where_the_gpu_suite_must_run_a_skip_is_a_failure():
    run = run_gpu_suite(KEV_GPU_REQUIRED="1")
    last = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1 and "skipped" not in last and "passed" not in last, run.stdout
    assert "counts as a failure: Skipped: needs an NVIDIA GPU" in run.stdout
