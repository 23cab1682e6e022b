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
from contextlib import asynccontextmanager
from functools import partial

import anyio

from kev_async.bench.arguments import positive_int, positive_ints
from kev_async.bench.model import bench_model

PROMPT = "Name one colour. Question {i}."
WARM_UP_S = 300


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
    gateway.add_argument("--gateway-processes", type=positive_int("gateway processes"), default=1, metavar="N",
                         help="with --gateway-process: `kev gateway --processes N`, N event loops on one port "
                              "(default 1; implies --gateway-process); the CPU column sums them")
    gateway.add_argument("--worker-process", action="store_true",
                         help="run the worker as its own `kev serve` process, as deployed, so that the clients' "
                              "work in the bench's event loop does not delay the worker's")
    gateway.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from kev_async.gateway.server import has_uvloop

    model = bench_model(args)
    anyio.run(partial(bench_gateway, model, concurrency=args.concurrency, rounds=args.rounds,
                      max_new_tokens=args.max_new_tokens,
                      gateway_process=args.gateway_process or args.gateway_processes > 1,
                      gateway_processes=args.gateway_processes, worker_process=args.worker_process), backend="asyncio",
              backend_options={"use_uvloop": has_uvloop()})  # clients as lean as the gateway's own loop
    return 0


async def bench_gateway(model, *, concurrency: int | list[int], rounds: int, max_new_tokens: int,
                        gateway_process: bool = False, gateway_processes: int = 1, worker_process: bool = False,
                        out=print) -> dict:
    """Latencies per path at each concurrency level; the returned figures are the highest level's."""
    import msgspec

    from consumers import embedded_kafka
    from kev_async.app import serve
    from kev_async.gateway.exposure import with_session_trust_key
    from kev_async.gateway.server import run_gateway
    from kev_async.runtime.lifecycle import Shutdown
    from schemas import KevConfig

    if gateway_processes > 1 and not gateway_process:
        raise ValueError("gateway_processes > 1 needs gateway_process: the processes are `kev gateway --processes N`")
    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    cfg = KevConfig()
    cfg = msgspec.structs.replace(cfg, metrics=msgspec.structs.replace(cfg.metrics, port=0),
                                  gateway=msgspec.structs.replace(cfg.gateway, port=0, served_model_name="bench"),
                                  router=msgspec.structs.replace(cfg.router, max_parallel_queries=max(32, *levels)))
    cfg = with_session_trust_key(cfg)  # the gateway signs its questions with a key the worker knows
    shutdown = Shutdown(drain_deadline=30)
    async with embedded_kafka(cfg.kafka) as kafka, anyio.create_task_group() as tg:
        cfg = msgspec.structs.replace(cfg, kafka=kafka)
        if worker_process:
            await tg.start(_worker_process, cfg, model, shutdown)
        else:
            await tg.start(partial(serve, cfg, shutdown, model=model))
        if gateway_process:
            url, gateway_pid = await tg.start(_gateway_process, cfg, gateway_processes, shutdown)
        else:
            url, gateway_pid = (await tg.start(partial(run_gateway, cfg, shutdown))).url, os.getpid()
        direct = _DirectClient(cfg.kafka, max_new_tokens)
        await direct.start()
        try:
            http = _HttpClient(url, max_new_tokens, max(levels))
            with anyio.fail_after(WARM_UP_S):  # a worker process loads its model and joins the group first
                await http.round(max(levels))  # warm both paths: group assignment, first forward
                spread = http.spread()
                await direct.round(max(levels))
            measured, cpu_ms = {}, {}
            for level in levels:
                latencies: dict[str, list[float]] = {"kafka": [], "gateway": []}
                cpu_s = 0.0
                for _ in range(rounds):
                    latencies["kafka"] += await direct.round(level)
                    before = _cpu_seconds(gateway_pid)
                    latencies["gateway"] += await http.round(level)
                    cpu_s += _cpu_seconds(gateway_pid) - before
                measured[level] = latencies
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


async def _gateway_process(cfg, processes: int, shutdown, *, task_status) -> None:
    """`kev gateway` as a child process on a free port; started once /metrics answers, stopped with SIGTERM.
    With processes > 1 it is the parent of that many gateway processes."""
    import socket

    import httpx

    from kev_async.gateway.exposure import trust_env
    from kev_async.gateway.metrics import process_of

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {"KEV_GATEWAY__SERVED_MODEL_NAME": "bench", **trust_env(cfg)}
    argv = ["gateway", "--bootstrap-servers", cfg.kafka.bootstrap_servers, "--port", str(port),
            "--processes", str(processes)]
    async with _kev_process(argv, env) as process:
        seen: set[str | None] = set()  # gateway processes that answered: ready once all have
        with anyio.fail_after(60):
            while len(seen) < processes:
                if process.returncode is not None:
                    raise RuntimeError(f"`kev gateway` exited with {process.returncode} before it was ready")
                try:
                    async with httpx.AsyncClient() as client:  # a new connection each time: any process may take it
                        scraped = await client.get(f"{url}/metrics")  # it names the process that answered
                    if scraped.status_code == 200:
                        seen.add(process_of(scraped.text))
                        continue
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.2)
        task_status.started((url, process.pid))
        await shutdown.requested.wait()


def _cpu_seconds(pid: int) -> float:
    """CPU a process, its threads and its child processes (`--processes N`) have used, in seconds."""
    return _own_cpu_seconds(pid) + sum(_cpu_seconds(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                children += [int(child) for child in listed.read().split()]
        except (OSError, ValueError):
            pass
    return children


def _own_cpu_seconds(pid: int) -> float:
    """CPU a process's threads have used, in seconds: nanoseconds from /proc/<pid>/task/*/schedstat, else
    /proc/<pid>/stat's 10 ms ticks; 0 off Linux (the CPU column then reads 0)."""
    try:
        total_ns = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as schedstat:
                total_ns += int(schedstat.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def _worker_process(cfg, model, shutdown, *, task_status) -> None:
    """`kev serve` as a child process with the bench's model, threads and router limit; stopped with SIGTERM.

    Started at once: the warm-up round waits while it loads the model and joins the consumer group.
    """
    import torch

    from kev_async.gateway.exposure import trust_env

    env = {"KEV_CORE__MODEL_PATH": str(model.path), "KEV_CORE__THREADS": str(torch.get_num_threads()),
           "KEV_ROUTER__MAX_PARALLEL_QUERIES": str(cfg.router.max_parallel_queries), "KEV_METRICS__PORT": "0",
           # the embedded broker holds a fetch for its whole wait, so the bench's broker came with a short one
           "KEV_KAFKA__FETCH_MAX_WAIT_MS": str(cfg.kafka.fetch_max_wait_ms), **trust_env(cfg)}
    async with _kev_process(["serve", "--bootstrap-servers", cfg.kafka.bootstrap_servers], env) as process:
        task_status.started()
        async with anyio.create_task_group() as tg:
            async def exited() -> None:
                await process.wait()
                if not shutdown.requested.is_set():
                    raise RuntimeError(f"`kev serve` exited with {process.returncode} during the bench")

            tg.start_soon(exited)
            await shutdown.requested.wait()
            tg.cancel_scope.cancel()


@asynccontextmanager
async def _kev_process(argv: list[str], env: dict[str, str]):
    """`python -m kev_async.cli <argv>` with warnings-only logs; SIGTERM (then SIGKILL after 15 s) on the way out."""
    import signal
    import subprocess
    import sys

    env = {**os.environ, "KEV_LOGGING__LEVEL": "warning", **env}
    process = await anyio.open_process([sys.executable, "-m", "kev_async.cli", *argv], env=env,
                                       stdout=subprocess.DEVNULL, stderr=None)
    try:
        yield process
    finally:
        with anyio.move_on_after(15, shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            await process.wait()
        if process.returncode is None:
            process.kill()


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


class _HttpClient:
    """A lean HTTP/1.1 keep-alive client, one connection per concurrent request.

    Not httpx, nor anyio's streams: the clients run in the bench's process on the same cores as the
    gateway and the worker, and their CPU would count as the gateway's. httpx's pool scans every
    connection per request (milliseconds at 64 concurrent); anyio streams cost ~0.15 ms of CPU per
    request more than the direct path's aiokafka send. A bare asyncio protocol costs least.
    """

    def __init__(self, url: str, max_new_tokens: int, concurrency: int) -> None:
        host_port = url.removeprefix("http://")
        self.host, port = host_port.rsplit(":", 1)
        self.port, self.max_new_tokens = int(port), max_new_tokens
        self.connections: list[_Connection] = []

    def spread(self) -> list[int]:
        """How many of the open connections each gateway process holds, most first."""
        counts: dict[str | None, int] = {}
        for connection in self.connections:
            counts[connection.process] = counts.get(connection.process, 0) + 1
        return sorted(counts.values(), reverse=True)

    async def round(self, concurrency: int) -> list[float]:
        import asyncio

        from kev_async.gateway.metrics import process_of

        loop = asyncio.get_running_loop()
        # uvicorn closes a keep-alive connection idle for 5 s, as a lower level's slow rounds can leave it.
        self.connections = [c for c in self.connections if not c.transport.is_closing()]
        while len(self.connections) < concurrency:
            _, connection = await loop.create_connection(lambda: _Connection(self.host), self.host, self.port)
            status, body = await connection.request("GET", "/metrics")
            if status != 200:
                raise RuntimeError(f"the gateway's /metrics answered HTTP {status}")
            connection.process = process_of(body.decode())
            self.connections.append(connection)
        latencies: list[float] = []

        async def one(i: int) -> None:
            body = {"model": "bench", "max_tokens": self.max_new_tokens,
                    "messages": [{"role": "user", "content": PROMPT.format(i=i)}]}
            started = time.perf_counter()
            status, _ = await self.connections[i].request("POST", "/v1/chat/completions", json.dumps(body).encode())
            if status != 200:
                raise RuntimeError(f"the gateway answered HTTP {status}")
            latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(one(i) for i in range(concurrency)))
        return latencies

    async def close(self) -> None:
        for connection in self.connections:
            connection.transport.close()


class _Connection:
    """One keep-alive connection: a request, then its response's status and body once the body is in."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.transport = None
        self.buffer = b""
        self.response = None  # the future of the request in flight
        self.process: str | None = None  # the gateway process holding the connection (from its /metrics)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0 or self.response is None or self.response.done():
            return
        lines = self.buffer[:head_end].decode("latin-1").split("\r\n")
        length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")),
                      None)
        if length is None:
            self.response.set_exception(RuntimeError(f"a response without content-length: {lines[0]!r}"))
            return
        if len(self.buffer) >= head_end + 4 + length:
            body = self.buffer[head_end + 4:head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length:]
            self.response.set_result((int(lines[0].split()[1]), body))

    def connection_lost(self, error) -> None:
        if self.response is not None and not self.response.done():
            self.response.set_exception(ConnectionError(f"the gateway closed the connection ({error})"))

    def eof_received(self) -> None:
        return None

    def pause_writing(self) -> None:
        return None

    def resume_writing(self) -> None:
        return None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        import asyncio

        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        self.response = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        try:
            return await self.response
        finally:
            self.response = None


class _DirectClient:
    """Publish QuestionEvents and read their answers from a reply topic of its own, as the gateway does."""

    def __init__(self, kafka, max_new_tokens: int) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        from kev_async.gateway.replies import FETCH_MAX_WAIT_MS
        from schemas.signing import Signer

        self.kafka, self.max_new_tokens = kafka, max_new_tokens
        # Signed, and a reply topic of the allowed pattern: as the gateway's, or the worker would not reply there.
        self.signer = Signer.from_config(kafka.trust)
        self.topic = f"kev.replies.bench-{uuid.uuid4().hex[:8]}"
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
        from schemas.signing import QUESTION

        sent: dict[str, float] = {}
        for i in range(concurrency):
            # The very question the gateway makes of its HTTP twin (messages, not a bare prompt).
            question = QuestionEvent(question_id=f"direct-{uuid.uuid4().hex}",
                                     messages=(Message(role="user", content=PROMPT.format(i=i)),),
                                     params=Params(max_new_tokens=self.max_new_tokens), reply_topic=self.topic)
            sent[question.question_id] = time.perf_counter()
            value = encode(question)
            await self.producer.send(self.kafka.questions_topic, value, key=question.question_id.encode(),
                                     headers=self.signer.headers(value, QUESTION))
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
