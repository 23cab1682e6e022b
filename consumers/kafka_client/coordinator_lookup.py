"""A transactional producer that outlives a broker restart in the middle of finding its coordinator.

aiokafka 0.14.0's sender retries a FindCoordinator that fails with NodeNotReady, CoordinatorNotAvailable
or RequestTimedOut, and turns any other KafkaError into a fatal one: its sender routine ends ("Unexpected
error during batch delivery") and the producer is of no more use. A connection the broker closed as it
went down (KafkaConnectionError) is such an error, though the same lookup a moment later succeeds. In
`kev drill --exactly-once` a worker whose TxnOffsetCommit looked up the group's coordinator just as the
broker was SIGKILLed exited 1 that way (nothing lost: its partitions' next owner answered, but a worker
lost to a restart the others rode out).

`install()` (run once by consumers/kafka_client/clients.py) makes the sender retry a lookup whose
connection failed, as it retries one whose node was not ready: after the client's retry backoff, for as
long as the caller waits (Kev bounds every transactional step by `kafka.publish_retry_ms`).
"""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaConnectionError, KafkaError

_PATCHED = "_kev_retries_lost_connections"


def install() -> None:
    """Make every aiokafka producer's sender retry a coordinator lookup whose connection failed (idempotent)."""
    from aiokafka.producer.sender import Sender

    original = getattr(Sender, "_find_coordinator", None)
    if getattr(original, _PATCHED, False):
        return
    if original is None:
        raise RuntimeError("aiokafka's Sender no longer has _find_coordinator, which "
                           "consumers/kafka_client/coordinator_lookup.py retries: pin aiokafka or update the adapter")

    async def find_coordinator(self, coordinator_type, coordinator_key):
        while True:
            try:
                return await original(self, coordinator_type, coordinator_key)
            except KafkaError as error:
                if not isinstance(error.__cause__, KafkaConnectionError):
                    raise
            await asyncio.sleep(self._retry_backoff)

    setattr(find_coordinator, _PATCHED, True)
    Sender._find_coordinator = find_coordinator
