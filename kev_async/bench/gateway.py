"""`kev bench gateway` (also `python -m kev_async.bench.gateway`): what the HTTP gateway adds to a question's latency over publishing it to Kafka
directly, at a given concurrency, on one embedded broker and one in-process worker.

Each round sends C questions at once, either as C concurrent `POST /v1/chat/completions` (httpx) or
as C QuestionEvents published to kev.questions by a plain aiokafka client that reads the answers
from its own reply topic, as the gateway does. Rounds alternate between the two paths so drift
(warm caches, a busy core) falls on both; a request's latency runs from its send to its answer.
The figure is the difference of the two medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from functools import partial

import anyio

from kev_async.bench.arguments import positive_ints
from kev_async.bench.model import bench_model

PROMPT = "Name one colour. Question {i}."


def register(kinds: argparse._SubParsersAction) -> None:
    gateway = kinds.add_parser(
        "gateway", help="latency the HTTP gateway adds over publishing to Kafka directly",
        description="Send --concurrency questions at once, --rounds times per path, alternately through "
                    "`kev gateway` (HTTP, non-streaming) and straight to kev.questions (aiokafka); print each "
                    "path's p50/p90 latency and the p50 the gateway adds. A list (--concurrency 1,8,64) "
                    "repeats the measurement per level: a fixed cost shows at 1, queueing in the gateway's one "
                    "event loop grows with the level.")
    gateway.add_argument("--model", default="smollm2-135m-instruct")
    gateway.add_argument("--concurrency", type=positive_ints("concurrency levels", "64 or 1,8,64"), default=[64],
                         help="questions at once, or a comma list of levels (default 64)")
    gateway.add_argument("--rounds", type=int, default=5, help="rounds per path (default 5)")
    gateway.add_argument("--max-new-tokens", type=int, default=1)
    gateway.add_argument("--threads", type=int, default=None)
    gateway.add_argument("--gateway-process", action="store_true",
                         help="run the gateway as its own `kev gateway` process, as deployed, instead of in the "
                              "bench's event loop beside the worker and both clients")
    gateway.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    model = bench_model(args)
    anyio.run(partial(bench_gateway, model, concurrency=args.concurrency, rounds=args.rounds,
                      max_new_tokens=args.max_new_tokens, gateway_process=args.gateway_process), backend="asyncio")
    return 0


async def bench_gateway(model, *, concurrency: int | list[int], rounds: int, max_new_tokens: int,
                        gateway_process: bool = False, out=print) -> dict:
    """Latencies per path at each concurrency level; the returned figures are the highest level's."""
    import msgspec

    from consumers import embedded_kafka
    from kev_async.app import serve
    from kev_async.gateway.server import run_gateway
    from kev_async.runtime.lifecycle import Shutdown
    from schemas import KevConfig

    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    cfg = KevConfig()
    cfg = msgspec.structs.replace(cfg, metrics=msgspec.structs.replace(cfg.metrics, port=0),
                                  gateway=msgspec.structs.replace(cfg.gateway, port=0, served_model_name="bench"),
                                  router=msgspec.structs.replace(cfg.router, max_parallel_queries=max(32, *levels)))
    shutdown = Shutdown(drain_deadline=30)
    async with embedded_kafka(cfg.kafka) as kafka, anyio.create_task_group() as tg:
        cfg = msgspec.structs.replace(cfg, kafka=kafka)
        await tg.start(partial(serve, cfg, shutdown, model=model))
        if gateway_process:
            url = await tg.start(_gateway_process, cfg.kafka.bootstrap_servers, shutdown)
        else:
            url = (await tg.start(partial(run_gateway, cfg, shutdown))).url
        direct = _DirectClient(cfg.kafka, max_new_tokens)
        await direct.start()
        try:
            http = _HttpClient(url, max_new_tokens, max(levels))
            await http.round(max(levels))  # warm both paths: group assignment, first forward
            await direct.round(max(levels))
            measured = {}
            for level in levels:
                latencies: dict[str, list[float]] = {"kafka": [], "gateway": []}
                for _ in range(rounds):
                    latencies["kafka"] += await direct.round(level)
                    latencies["gateway"] += await http.round(level)
                measured[level] = latencies
            await http.close()
        finally:
            await direct.stop()
        shutdown.request("bench finished")
    where = "its own process" if gateway_process else "the bench's process"
    return _report(measured, model.name, rounds, max_new_tokens, where, out)


async def _gateway_process(bootstrap_servers: str, shutdown, *, task_status) -> None:
    """`kev gateway` as a child process on a free port; started once /health answers, stopped with SIGTERM."""
    import signal
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KEV_GATEWAY__SERVED_MODEL_NAME": "bench", "KEV_LOGGING__LEVEL": "warning"}
    process = await anyio.open_process([sys.executable, "-m", "kev_async.cli", "gateway", "--bootstrap-servers",
                                        bootstrap_servers, "--port", str(port)], env=env,
                                       stdout=subprocess.DEVNULL, stderr=None)
    try:
        async with httpx.AsyncClient() as client:
            with anyio.fail_after(60):
                while True:
                    if process.returncode is not None:
                        raise RuntimeError(f"`kev gateway` exited with {process.returncode} before it was ready")
                    try:
                        if (await client.get(f"{url}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.2)
        task_status.started(url)
        await shutdown.requested.wait()
    finally:
        with anyio.move_on_after(15, shield=True):
            process.send_signal(signal.SIGTERM)
            await process.wait()
        if process.returncode is None:
            process.kill()


def _report(measured: dict[int, dict[str, list[float]]], model: str, rounds: int, max_new_tokens: int,
            where: str, out) -> dict:
    out(f"model {model}, {rounds} rounds per path and level, <= {max_new_tokens} new tokens, greedy, embedded "
        f"broker, one in-process worker, the gateway in {where}")
    out("| concurrent | path | requests | p50 ms | p90 ms |\n|---:|---|---:|---:|---:|")
    rows = {}
    for level, latencies in measured.items():
        p50 = {}
        for name, values in latencies.items():
            ms = sorted(v * 1000 for v in values)
            p50[name] = statistics.median(ms)
            out(f"| {level} | {name} | {len(ms)} | {p50[name]:.1f} | {ms[int(0.9 * (len(ms) - 1))]:.1f} |")
        rows[level] = {"p50_ms": p50, "added_p50_ms": p50["gateway"] - p50["kafka"]}
    for level, row in rows.items():
        out(f"gateway adds {row['added_p50_ms']:.1f} ms at p50 with {level} concurrent")
    return {**rows[max(rows)], "levels": rows}


class _HttpClient:
    """A lean HTTP/1.1 keep-alive client, one connection per concurrent request.

    Not httpx: its connection pool scans every connection for every request, which at 64 concurrent
    requests costs milliseconds of this event loop per request, and the gateway and the worker share
    that loop here; the figure would be httpx's, not the gateway's.
    """

    def __init__(self, url: str, max_new_tokens: int, concurrency: int) -> None:
        host_port = url.removeprefix("http://")
        self.host, port = host_port.rsplit(":", 1)
        self.port, self.max_new_tokens = int(port), max_new_tokens
        self.connections: list = []

    async def round(self, concurrency: int) -> list[float]:
        while len(self.connections) < concurrency:
            self.connections.append(await _Connection.open(self.host, self.port))
        latencies: list[float] = []

        async def one(i: int) -> None:
            body = {"model": "bench", "max_tokens": self.max_new_tokens,
                    "messages": [{"role": "user", "content": PROMPT.format(i=i)}]}
            started = time.perf_counter()
            status = await self.connections[i].post("/v1/chat/completions", json.dumps(body).encode())
            if status != 200:
                raise RuntimeError(f"the gateway answered HTTP {status}")
            latencies.append(time.perf_counter() - started)

        async with anyio.create_task_group() as tg:
            for i in range(concurrency):
                tg.start_soon(one, i)
        return latencies

    async def close(self) -> None:
        for connection in self.connections:
            await connection.stream.aclose()


class _Connection:
    def __init__(self, stream, host: str) -> None:
        from anyio.streams.buffered import BufferedByteReceiveStream

        self.stream, self.host = stream, host
        self.reader = BufferedByteReceiveStream(stream)

    @classmethod
    async def open(cls, host: str, port: int) -> "_Connection":
        return cls(await anyio.connect_tcp(host, port), host)

    async def post(self, path: str, body: bytes) -> int:
        head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        await self.stream.send(head + body)
        lines = (await self.reader.receive_until(b"\r\n\r\n", 65536)).decode("latin-1").split("\r\n")
        length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
        await self.reader.receive_exactly(length)
        return int(lines[0].split()[1])


class _DirectClient:
    """Publish QuestionEvents and read their answers from a reply topic of its own, as the gateway does."""

    def __init__(self, kafka, max_new_tokens: int) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        from kev_async.gateway.replies import FETCH_MAX_WAIT_MS

        self.kafka, self.max_new_tokens = kafka, max_new_tokens
        self.topic = f"kev.bench-replies.{uuid.uuid4().hex[:8]}"
        self.producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all", linger_ms=0)
        self.consumer = AIOKafkaConsumer(self.topic, bootstrap_servers=kafka.bootstrap_servers, group_id=None,
                                         auto_offset_reset="earliest", fetch_max_wait_ms=FETCH_MAX_WAIT_MS)

    async def start(self) -> None:
        from consumers import create_topics

        await create_topics(self.kafka.bootstrap_servers, {self.topic: 1})
        await self.producer.start()
        await self.consumer.start()

    async def stop(self) -> None:
        await self.producer.stop()
        await self.consumer.stop()

    async def round(self, concurrency: int) -> list[float]:
        from schemas import Message, Params, QuestionEvent, decode_answer, encode

        sent: dict[str, float] = {}
        for i in range(concurrency):
            # The very question the gateway makes of its HTTP twin (messages, not a bare prompt).
            question = QuestionEvent(question_id=f"direct-{uuid.uuid4().hex}",
                                     messages=(Message(role="user", content=PROMPT.format(i=i)),),
                                     params=Params(max_new_tokens=self.max_new_tokens), reply_topic=self.topic)
            sent[question.question_id] = time.perf_counter()
            await self.producer.send(self.kafka.questions_topic, encode(question), key=question.question_id.encode())
        latencies = []
        while len(latencies) < concurrency:
            for records in (await self.consumer.getmany(timeout_ms=1000)).values():
                for record in records:
                    started = sent.pop(decode_answer(record.value).question_id, None)
                    if started is not None:
                        latencies.append(time.perf_counter() - started)
        return latencies


def main(argv: list[str] | None = None) -> int:
    """`python -m kev_async.bench.gateway ...`, the same as `kev bench gateway ...`."""
    parser = argparse.ArgumentParser(prog="kev bench")
    register(parser.add_subparsers(dest="bench_command", required=True))
    import sys

    args = parser.parse_args(["gateway", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
