"""`kev bench gateway` stays runnable: a tiny model, 4 concurrent questions, one round per path.

Its own module: the bench starts a worker of its own, and a module-scoped live stack (test_gateway.py)
would already hold the CPU device's one scheduler actor.
"""

from __future__ import annotations

from functools import partial

import anyio
import pytest

pytest.register_assert_rewrite("gateway_fixtures")
from gateway_fixtures import SESSION_ENV  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka


def test_bench_gateway_runs_and_reports_the_added_p50(tiny_model, monkeypatch):
    from kev_async.bench.gateway.run import bench_gateway

    for name, value in SESSION_ENV.items():
        monkeypatch.setenv(name, value)
    lines: list[str] = []
    bench = partial(bench_gateway, tiny_model, concurrency=4, rounds=1, max_new_tokens=1, out=lines.append)
    result = anyio.run(bench, backend="asyncio")
    assert set(result["p50_ms"]) == {"kafka", "gateway"} and result["p50_ms"]["gateway"] > 0
    assert lines[-1].startswith("gateway adds ")


def test_bench_gateway_can_run_the_gateway_as_its_own_process(tiny_model, monkeypatch):
    """As deployed: `kev gateway` in a child process, not in the bench's event loop."""
    from kev_async.bench.gateway.run import bench_gateway

    for name, value in SESSION_ENV.items():
        monkeypatch.setenv(name, value)
    lines: list[str] = []
    bench = partial(bench_gateway, tiny_model, concurrency=2, rounds=1, max_new_tokens=1, gateway_process=True,
                    out=lines.append)
    result = anyio.run(bench, backend="asyncio")
    assert result["p50_ms"]["gateway"] > 0
    assert "the gateway in its own process" in lines[0]


def test_bench_gateway_can_run_the_gateway_and_the_worker_as_processes(tiny_model, monkeypatch):
    """As deployed: `kev gateway --processes 2` and `kev serve` in child processes; the CPU per request read is
    the gateway processes' together."""
    from kev_async.bench.gateway.run import bench_gateway

    for name, value in SESSION_ENV.items():
        monkeypatch.setenv(name, value)
    lines: list[str] = []
    bench = partial(bench_gateway, tiny_model, concurrency=2, rounds=2, max_new_tokens=1, gateway_process=True,
                    gateway_processes=2, worker_process=True, out=lines.append)
    result = anyio.run(bench, backend="asyncio")
    assert result["p50_ms"]["kafka"] > 0 and result["p50_ms"]["gateway"] > 0
    assert "the gateway in 2 processes, the worker in its own process" in lines[0]
    assert result["gateway_cpu_ms_per_request"] > 0  # per-thread schedstat, in ns: 4 requests do register
    assert "of CPU per request" in lines[-1]
