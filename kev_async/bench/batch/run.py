"""`kev bench batch`'s measurement: interactive chat requests through the gateway, alone, then beside a
running batch, then alone again; the p50 beside the batch over the p50 alone.

The interactive requests and the batch's lines come from the same (anonymous) caller, so they are one
principal to the fair scheduler and the batch's priority (-10, below the requests' 0) is what orders them;
the batch's lines take at most gateway.batch_in_flight of the worker's places at a time.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from functools import partial

import anyio
import httpx
import msgspec

from consumers import embedded_kafka
from kev_async.app import serve
from kev_async.bench.machine import cpu_name
from kev_async.gateway.exposure import with_session_trust_key
from kev_async.gateway.server import run_gateway
from kev_async.runtime.lifecycle import Shutdown
from schemas import KevConfig

PROMPT = "In one sentence, why do rivers bend?"
BATCH_PROMPT = "Write a short paragraph about river number {i}."
START_S = 300  # the batch's first lines answered within this (a cold model's first forwards included)


async def bench_batch(model, *, requests: int, max_new_tokens: int, lines: int, batch_max_tokens: int,
                      in_flight: int, out=print) -> dict:
    """Latencies (seconds) per phase, the ratio of the p50s, and whether the batch ran through the middle phase."""
    with tempfile.TemporaryDirectory(prefix="kev-bench-batch-") as files_dir:
        cfg = _config(in_flight, files_dir)
        shutdown = Shutdown(drain_deadline=30)
        async with embedded_kafka(cfg.kafka) as kafka, anyio.create_task_group() as tg:
            cfg = msgspec.structs.replace(cfg, kafka=kafka)
            await tg.start(partial(serve, cfg, shutdown, model=model))
            url = (await tg.start(partial(run_gateway, cfg, shutdown))).url
            async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=600) as client:
                phases, ran = await _phases(client, requests, max_new_tokens, lines, batch_max_tokens)
            shutdown.request("bench finished")
    return _report(phases, ran, model.name, requests, max_new_tokens, lines, batch_max_tokens, in_flight, out)


def _config(in_flight: int, files_dir: str) -> KevConfig:
    cfg, replace = KevConfig(), msgspec.structs.replace
    cfg = replace(cfg, metrics=replace(cfg.metrics, port=0),
                  gateway=replace(cfg.gateway, port=0, served_model_name="bench", files_dir=files_dir,
                                  batch_in_flight=in_flight))
    return with_session_trust_key(cfg)  # the gateway signs its questions with a key the worker knows


async def _phases(client: httpx.AsyncClient, requests: int, max_new_tokens: int, lines: int,
                  batch_max_tokens: int) -> tuple[dict[str, list[float]], dict]:
    await _ask(client, max_new_tokens)  # the first forwards, group assignment: not measured
    phases = {"alone, before": await _asks(client, requests, max_new_tokens)}
    batch_id = await _start_batch(client, lines, batch_max_tokens)
    started = await _wait(client, batch_id, lambda b: b["request_counts"]["completed"] >= 1, START_S)
    phases["beside the batch"] = await _asks(client, requests, max_new_tokens)
    during = await _batch(client, batch_id)
    ran = {"throughout": during["status"] == "in_progress",
           "lines": during["request_counts"]["completed"] - started["request_counts"]["completed"]}
    (await client.post(f"/batches/{batch_id}/cancel")).raise_for_status()
    await _wait(client, batch_id, lambda b: b["status"] == "cancelled", START_S)
    phases["alone, after"] = await _asks(client, requests, max_new_tokens)
    return phases, ran


async def _asks(client: httpx.AsyncClient, requests: int, max_new_tokens: int) -> list[float]:
    return [await _ask(client, max_new_tokens) for _ in range(requests)]


async def _ask(client: httpx.AsyncClient, max_new_tokens: int) -> float:
    body = {"model": "bench", "max_tokens": max_new_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    started = time.perf_counter()
    (await client.post("/chat/completions", json=body)).raise_for_status()
    return time.perf_counter() - started


async def _start_batch(client: httpx.AsyncClient, lines: int, max_tokens: int) -> str:
    content = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "bench", "max_tokens": max_tokens, "temperature": 0,
                                           "messages": [{"role": "user", "content": BATCH_PROMPT.format(i=i)}]}})
                      + "\n" for i in range(lines))
    uploaded = await client.post("/files", data={"purpose": "batch"},
                                 files={"file": ("bench.jsonl", content.encode(), "application/jsonl")})
    uploaded.raise_for_status()
    created = await client.post("/batches", json={"input_file_id": uploaded.json()["id"],
                                                  "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    created.raise_for_status()
    return created.json()["id"]


async def _batch(client: httpx.AsyncClient, batch_id: str) -> dict:
    response = await client.get(f"/batches/{batch_id}")
    response.raise_for_status()
    return response.json()


async def _wait(client: httpx.AsyncClient, batch_id: str, done, timeout_s: float) -> dict:
    with anyio.fail_after(timeout_s):
        while not done(batch := await _batch(client, batch_id)):
            await anyio.sleep(0.05)
    return batch


def _report(phases: dict[str, list[float]], ran: dict, model: str, requests: int, max_new_tokens: int, lines: int,
            batch_max_tokens: int, in_flight: int, out) -> dict:
    out(f"model {model}, {cpu_name()}; {requests} interactive requests per phase, one at a time, <= "
        f"{max_new_tokens} new tokens, greedy; a batch of {lines} lines of <= {batch_max_tokens} tokens, "
        f"{in_flight} in flight; embedded broker, worker and gateway in this process")
    out("| phase | requests | p50 ms | p90 ms |\n|---|---:|---:|---:|")
    p50 = {}
    for name, values in phases.items():
        ms = sorted(v * 1000 for v in values)
        p50[name] = statistics.median(ms)
        out(f"| {name} | {len(ms)} | {p50[name]:.1f} | {ms[int(0.9 * (len(ms) - 1))]:.1f} |")
    alone = statistics.median([v * 1000 for name in ("alone, before", "alone, after") for v in phases[name]])
    ratio = p50["beside the batch"] / alone
    out(f"beside the batch / alone (p50): {ratio:.2f}x; the batch answered {ran['lines']} lines meanwhile"
        + ("" if ran["throughout"] else " and FINISHED before the phase did: raise --lines"))
    return {"p50_ms": p50, "alone_p50_ms": alone, "ratio": ratio, "batch_lines_meanwhile": ran["lines"],
            "batch_ran_throughout": ran["throughout"]}
