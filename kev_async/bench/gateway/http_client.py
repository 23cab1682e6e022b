"""The HTTP path of `kev bench gateway`: concurrent non-streaming `POST /v1/chat/completions` over
keep-alive connections, one per concurrent request, each remembering which gateway process holds it."""

from __future__ import annotations

import asyncio
import json
import time

from kev_async.gateway.metrics import process_of


# Not httpx: the client runs in the bench's process, on the gateway's and the worker's cores (by default in
# the gateway's own event loop), so its CPU counts as the gateway's. Client CPU per request, measured against
# a stub uvicorn server on 2 cores with uvloop (median of 3 runs at 1 / 8 / 64 concurrent): this client
# 0.11 / 0.05 / 0.04 ms; httpx, one pooled AsyncClient, 0.97 / 1.39 / 4.17 ms; httpx, one AsyncClient per
# connection, 1.00 / 0.86 / 0.96 ms.
class HttpClient:
    """A lean HTTP/1.1 keep-alive client on bare asyncio protocols, one connection per concurrent request."""

    def __init__(self, url: str, max_new_tokens: int, prompt: str) -> None:
        host_port = url.removeprefix("http://")
        self.host, port = host_port.rsplit(":", 1)
        self.port, self.max_new_tokens, self.prompt = int(port), max_new_tokens, prompt
        self.connections: list[Connection] = []

    def spread(self) -> list[int]:
        """How many of the open connections each gateway process holds, most first."""
        counts: dict[str | None, int] = {}
        for connection in self.connections:
            counts[connection.process] = counts.get(connection.process, 0) + 1
        return sorted(counts.values(), reverse=True)

    async def round(self, concurrency: int) -> list[float]:
        """`concurrency` requests at once; each one's seconds from its send to its whole response."""
        await self._connect(concurrency)
        latencies: list[float] = []

        async def one(i: int) -> None:
            body = {"model": "bench", "max_tokens": self.max_new_tokens,
                    "messages": [{"role": "user", "content": self.prompt.format(i=i)}]}
            started = time.perf_counter()
            status, _ = await self.connections[i].request("POST", "/v1/chat/completions", json.dumps(body).encode())
            if status != 200:
                raise RuntimeError(f"the gateway answered HTTP {status}")
            latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(one(i) for i in range(concurrency)))
        return latencies

    async def _connect(self, count: int) -> None:
        """At least `count` open connections, each asked once for /metrics to learn its gateway process."""
        loop = asyncio.get_running_loop()
        # uvicorn closes a keep-alive connection idle for 5 s, as a lower level's slow rounds can leave it.
        self.connections = [c for c in self.connections if not c.transport.is_closing()]
        while len(self.connections) < count:
            _, connection = await loop.create_connection(lambda: Connection(self.host), self.host, self.port)
            status, body = await connection.request("GET", "/metrics")
            if status != 200:
                raise RuntimeError(f"the gateway's /metrics answered HTTP {status}")
            connection.process = process_of(body.decode())
            self.connections.append(connection)

    async def close(self) -> None:
        for connection in self.connections:
            connection.transport.close()


class Connection(asyncio.Protocol):
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

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        self.response = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        try:
            return await self.response
        finally:
            self.response = None
