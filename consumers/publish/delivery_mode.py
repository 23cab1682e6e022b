"""Which delivery a worker runs, at_least_once or exactly_once: `kafka.delivery`, with `auto` and
`exactly_once` checked against the broker.

`probe(cfg)` says whether the broker can run a transactional producer at all (`kafka.delivery: auto`).
"""

from __future__ import annotations

import time
import uuid

import anyio
from aiokafka import AIOKafkaProducer

from consumers.kafka_client.clients import STOP_TIMEOUT_S, producer_options, quietly
from consumers.publish.delivery import short_error
from schemas import KafkaConfig


class DeliveryUnavailable(RuntimeError):
    """kafka.delivery is exactly_once, and the broker does not run transactions."""


async def choose_delivery(cfg: KafkaConfig, answers_bootstrap: str | None = None) -> tuple[str, str]:
    """(at_least_once | exactly_once, why): kafka.delivery, with `auto` and `exactly_once` checked against the
    broker (`probe`); raises DeliveryUnavailable when exactly_once is asked of a broker that cannot.
    `answers_bootstrap`: where the answers go, when not to the questions' brokers (a transaction lives on one
    cluster: its answers and the offsets of their questions cannot be on two)."""
    if cfg.delivery == "at_least_once":
        return "at_least_once", "configured"
    if answers_bootstrap not in (None, cfg.bootstrap_servers):
        split = f"answers go to {answers_bootstrap}, questions come from {cfg.bootstrap_servers}: one transaction " \
                f"cannot hold both"
        if cfg.delivery == "exactly_once":
            raise DeliveryUnavailable(f"kafka.delivery is exactly_once, but {split}")
        return "at_least_once", f"auto: {split}"
    started = time.monotonic()
    refused = await probe(cfg)
    took = f"{(time.monotonic() - started) * 1000:.0f} ms"
    if refused is None:
        return "exactly_once", f"{cfg.delivery}: the broker started a transactional producer ({took})"
    if cfg.delivery == "exactly_once":
        raise DeliveryUnavailable(f"kafka.delivery is exactly_once, but the broker at {cfg.bootstrap_servers} "
                                  f"does not run transactions: {refused}")
    return "at_least_once", f"auto: the broker does not run transactions ({refused})"


async def probe(cfg: KafkaConfig, timeout_s: float = 10.0) -> str | None:
    """None when the broker starts a transactional producer (InitProducerId with a transactional id, its own
    id each time, so concurrent probes do not fence one another); else why not. Writes no record."""
    producer = AIOKafkaProducer(**producer_options(cfg, transactional_id=f"kev-probe-{uuid.uuid4().hex[:12]}",
                                                   enable_idempotence=True))
    try:
        with anyio.fail_after(timeout_s):
            await producer.start()
        return None
    except TimeoutError:
        return f"no transactional producer within {timeout_s:g}s"
    except Exception as error:  # noqa: BLE001 - any refusal means: not here
        return short_error(error)
    finally:
        with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
            await quietly(producer.stop(), "probe producer")
