"""A live Kev behind its HTTP gateway, for the gateway tests: the embedded Tansu broker, an in-process
`kev serve` worker on a tiny random-weight Llama, and `kev gateway`, all on one anyio event loop in a
background thread (a blocking portal), so tests can use the synchronous `openai` client as users do.

Load with `pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import anyio
import httpx
import msgspec
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from schemas import KevConfig
from schemas.kafka_config import TrustKey

API_KEY = "sk-kev-test-1"
TENANT = "acme"
TRUST_KEY_ID, TRUST_SECRET = "test", "a-test-secret-of-32-characters!!"  # the gateway's kafka.trust key
OPS_KEY_ID, OPS_SECRET = "ops", "an-operator-secret-of-32-chars!!"  # an operator's tool: control commands
GATEWAY_KEY = TrustKey(secret=TRUST_SECRET, scopes=("questions", "cancel"))  # all a gateway may sign
TRUST_KEYS = {TRUST_KEY_ID: GATEWAY_KEY, OPS_KEY_ID: TrustKey(secret=OPS_SECRET, scopes=("control",))}  # a worker's
SESSION_ENV = {"KEV_KAFKA_SESSION_TIMEOUT_MS": "3000"}  # Tansu's group waits, kept short


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replace(cfg: KevConfig, **sections) -> KevConfig:
    """`cfg` with some keys of some sections changed: replace(cfg, core={"device": "cpu"})."""
    changed = {name: msgspec.structs.replace(getattr(cfg, name), **keys) for name, keys in sections.items()}
    return msgspec.structs.replace(cfg, **changed)


def stack_config(kafka, *, metrics_port: int = 0, **gateway) -> KevConfig:
    """A worker and gateway config: API key API_KEY is tenant TENANT, which sees Kev's audit; the gateway
    signs with the trust key the worker knows (questions, cancel), the worker also obeys the operator's key
    (control); up to 256 requests in flight per tenant."""
    trust = msgspec.structs.replace(kafka.trust, keys=TRUST_KEYS, sign_key=TRUST_KEY_ID)
    kafka = msgspec.structs.replace(kafka, trust=trust)
    return replace(KevConfig(kafka=kafka), core={"max_context": 1024, "device": "cpu"},
                   router={"max_parallel_queries": 32}, kv_cache={"num_blocks": 1024},
                   scheduler={"batch_window_ms": 2.0}, metrics={"port": metrics_port},
                   gateway={"port": 0, "api_keys": {API_KEY: TENANT}, "served_model_name": "tiny",
                            "max_prompt_chars": 2000, "audit_tenants": [TENANT], "max_concurrent_per_tenant": 256,
                            **gateway})


def signer_for(purpose: str):
    """The test key that may sign `purpose`: the operator's for control, the gateway's for questions and cancels."""
    from schemas.signing import CONTROL, Signer

    if purpose == CONTROL:
        return Signer.hmac(OPS_KEY_ID, OPS_SECRET, scopes=("control",))
    return Signer.hmac(TRUST_KEY_ID, TRUST_SECRET, scopes=GATEWAY_KEY.scopes)


async def produce_commands(bootstrap: str, topic: str, events: list) -> None:
    """Control commands as an operator's tool sends them (cancels as the gateway does): signed, keyed by what
    each changes."""
    from consumers.control.reader import control_record, purpose_of
    from schemas.control import control_key

    records = [control_record(e, signer_for(purpose_of(control_key(e))), topic) for e in events]
    await _send(bootstrap, topic, records)


async def produce_signed(bootstrap: str, topic: str, values: list[bytes], purpose: str, *,
                         keys: list[bytes | None] | None = None) -> None:
    """Send each value signed for `purpose` with the test key that may sign it, and wait for the acks."""
    signer = signer_for(purpose)
    keys = keys or [None] * len(values)
    await _send(bootstrap, topic, [(key, value, signer.headers(purpose, topic, key, value))
                                   for value, key in zip(values, keys)])


async def _send(bootstrap: str, topic: str, records) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(topic, value, key=key, headers=headers)
    finally:
        await producer.stop()


@dataclass
class LiveStack:
    cfg: KevConfig
    url: str  # the gateway, http://127.0.0.1:PORT
    reply_topic: str
    worker: str
    metrics_url: str | None
    portal: BlockingPortal

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def kv_blocks_used(self) -> float:
        """The worker's `kev_kv_blocks_used` gauge, scraped from its metrics endpoint."""
        text = httpx.get(self.metrics_url, timeout=5).text
        for line in text.splitlines():
            if line.startswith("kev_kv_blocks_used "):
                return float(line.split()[1])
        raise AssertionError("no kev_kv_blocks_used in the worker's metrics")


@contextmanager
def live_stack(cfg: KevConfig, model=None, *, worker: bool = True) -> Iterator[LiveStack]:
    """Worker (unless worker=False) and gateway on `cfg`, running until the block ends, then stopped gracefully."""
    from kev_async.app import serve
    from kev_async.gateway.server import run_gateway
    from kev_async.runtime.lifecycle import Shutdown

    saved = {name: os.environ.get(name) for name in SESSION_ENV}
    os.environ.update(SESSION_ENV)
    try:
        with start_blocking_portal(backend="asyncio") as portal:
            shutdown = portal.call(partial(_make_shutdown, Shutdown))
            futures = []
            running = None
            if worker:
                future, running = portal.start_task(partial(serve, cfg, shutdown, model=model))
                futures.append(future)
            future, gateway = portal.start_task(partial(run_gateway, cfg, shutdown))
            futures.append(future)
            metrics_url = f"http://127.0.0.1:{cfg.metrics.port}/metrics" if cfg.metrics.port else None
            try:
                yield LiveStack(cfg, gateway.url, gateway.reply_topic, running.worker if running else "",
                                metrics_url, portal)
            finally:
                portal.call(shutdown.request, "test over")
                for future in futures:
                    future.result(timeout=60)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def _make_shutdown(cls):
    return cls(drain_deadline=20.0)


@pytest.fixture(scope="module")
def stack(kafka_broker, tiny_model) -> Iterator[LiveStack]:
    from kafka_fixtures import kafka_config

    cfg = stack_config(kafka_config(kafka_broker, partitions=2), metrics_port=free_port())
    with live_stack(cfg, tiny_model) as running:
        yield running


@pytest.fixture
def client(stack):
    from openai import OpenAI

    with OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=60) as openai_client:
        yield openai_client
