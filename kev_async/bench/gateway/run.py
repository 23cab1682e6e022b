"""`kev bench gateway`'s measurement: what the HTTP gateway adds to a question's latency over publishing
it to Kafka directly, at a given concurrency, on one embedded broker and one worker.

Each round sends C questions at once, either as C concurrent `POST /v1/chat/completions` or as C
QuestionEvents published to kev.questions by a plain aiokafka client that reads the answers from its own
reply topic, as the gateway does. Rounds alternate between the two paths so drift (warm caches, a busy
core) falls on both; a request's latency runs from its send to its answer. The figure is the difference
of the two medians.
"""

from __future__ import annotations

import os
import statistics
from functools import partial

import anyio
import msgspec

from consumers import embedded_kafka
from kev_async.app import serve
from kev_async.bench.gateway.http_client import HttpClient
from kev_async.bench.gateway.kafka_client import DirectClient
from kev_async.bench.gateway.processes import cpu_seconds, run_gateway_process, run_worker_process
from kev_async.gateway.exposure import with_session_trust_key
from kev_async.gateway.server import run_gateway
from kev_async.runtime.lifecycle import Shutdown
from schemas import KevConfig

PROMPT = "Name one colour. Question {i}."  # the i-th question of a round, on either path
WARM_UP_S = 300


async def bench_gateway(model, *, concurrency: int | list[int], rounds: int, max_new_tokens: int,
                        gateway_process: bool = False, gateway_processes: int = 1, worker_process: bool = False,
                        out=print) -> dict:
    """Latencies per path at each concurrency level; the returned figures are the highest level's."""
    if gateway_processes > 1 and not gateway_process:
        raise ValueError("gateway_processes > 1 needs gateway_process: the processes are `kev gateway --processes N`")
    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    cfg = _config(max(32, *levels))
    shutdown = Shutdown(drain_deadline=30)
    async with embedded_kafka(cfg.kafka) as kafka, anyio.create_task_group() as tg:
        cfg = msgspec.structs.replace(cfg, kafka=kafka)
        url, gateway_pid = await _start(tg, cfg, model, shutdown, gateway_as_process=gateway_process,
                                        gateway_processes=gateway_processes, worker_as_process=worker_process)
        direct = DirectClient(cfg.kafka, max_new_tokens, PROMPT)
        await direct.start()
        try:
            http = HttpClient(url, max_new_tokens, PROMPT)
            with anyio.fail_after(WARM_UP_S):  # a worker process loads its model and joins the group first
                await http.round(max(levels))  # warm both paths: group assignment, first forward
                spread = http.spread()
                await direct.round(max(levels))
            measured, cpu_ms = {}, {}
            for level in levels:
                measured[level], cpu_s = await _level(direct, http, level, rounds, gateway_pid)
                if gateway_process:  # in the bench's process the worker's and clients' CPU would count too
                    cpu_ms[level] = cpu_s * 1000 / (level * rounds)
            await http.close()
        finally:
            await direct.stop()
        shutdown.request("bench finished")
    where = {True: "its own process", False: "the bench's process"}
    gateway_in = f"{gateway_processes} processes" if gateway_processes > 1 else where[gateway_process]
    return _report(measured, cpu_ms, model.name, rounds, max_new_tokens, gateway_in, where[worker_process], out,
                   spread if gateway_processes > 1 else None)


def _config(max_parallel: int) -> KevConfig:
    """Defaults, with no worker metrics, a gateway on any free port, and room for a round's questions."""
    cfg, replace = KevConfig(), msgspec.structs.replace
    cfg = replace(cfg, metrics=replace(cfg.metrics, port=0),
                  gateway=replace(cfg.gateway, port=0, served_model_name="bench"),
                  router=replace(cfg.router, max_parallel_queries=max_parallel))
    return with_session_trust_key(cfg)  # the gateway signs its questions with a key the worker knows


async def _start(tg, cfg: KevConfig, model, shutdown: Shutdown, *, gateway_as_process: bool,
                 gateway_processes: int, worker_as_process: bool) -> tuple[str, int]:
    """The worker, then the gateway, each in this event loop or as child processes; the gateway's URL and pid."""
    if worker_as_process:
        await tg.start(run_worker_process, cfg, model, shutdown)
    else:
        await tg.start(partial(serve, cfg, shutdown, model=model))
    if gateway_as_process:
        return await tg.start(run_gateway_process, cfg, gateway_processes, shutdown)
    return (await tg.start(partial(run_gateway, cfg, shutdown))).url, os.getpid()


async def _level(direct: DirectClient, http: HttpClient, level: int, rounds: int,
                 gateway_pid: int) -> tuple[dict[str, list[float]], float]:
    """`rounds` rounds per path at `level` concurrent, alternating; the latencies and the gateway's CPU seconds."""
    latencies: dict[str, list[float]] = {"kafka": [], "gateway": []}
    cpu_s = 0.0
    for _ in range(rounds):
        latencies["kafka"] += await direct.round(level)
        before = cpu_seconds(gateway_pid)
        latencies["gateway"] += await http.round(level)
        cpu_s += cpu_seconds(gateway_pid) - before
    return latencies, cpu_s


def _report(measured: dict[int, dict[str, list[float]]], cpu_ms: dict[int, float], model: str, rounds: int,
            max_new_tokens: int, gateway_in: str, worker_in: str, out, spread: list[int] | None = None) -> dict:
    out(f"model {model}, {rounds} rounds per path and level, <= {max_new_tokens} new tokens, greedy, embedded "
        f"broker, the gateway in {gateway_in}, the worker in {worker_in}")
    if spread is not None:  # keep-alive connections stay where they were accepted
        out(f"connections per gateway process: {' / '.join(map(str, spread))}")
    out("| concurrent | path | requests | p50 ms | p90 ms |\n|---:|---|---:|---:|---:|")
    rows = {}
    for level, latencies in measured.items():
        p50 = {}
        for name, values in latencies.items():
            ms = sorted(v * 1000 for v in values)
            p50[name] = statistics.median(ms)
            out(f"| {level} | {name} | {len(ms)} | {p50[name]:.1f} | {ms[int(0.9 * (len(ms) - 1))]:.1f} |")
        rows[level] = {"p50_ms": p50, "added_p50_ms": p50["gateway"] - p50["kafka"]}
        if level in cpu_ms:
            rows[level]["gateway_cpu_ms_per_request"] = cpu_ms[level]
    for level, row in rows.items():
        cpu = row.get("gateway_cpu_ms_per_request")
        spent = f" (the gateway process used {cpu:.2f} ms of CPU per request)" if cpu is not None else ""
        out(f"gateway adds {row['added_p50_ms']:.1f} ms at p50 with {level} concurrent{spent}")
    return {**rows[max(rows)], "levels": rows, **({"connections_per_process": spread} if spread else {})}
