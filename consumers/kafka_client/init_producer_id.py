"""InitProducerId as the broker expects it: aiokafka's transactional and idempotent producers on Tansu.

aiokafka 0.14.0 knows InitProducerId v0 only: a transactional id and a timeout. v3 (KIP-360) added
the producer id and epoch a producer already holds, -1 and -1 for a fresh one. The embedded Tansu
(0.6.0) matches on those two fields, (-1, -1), in both of its storage engines and answers any other
form, v0's missing fields included, with UnknownServerError: so aiokafka's transactional producer
could not start there (`UnknownError`, error -1), while librdkafka, which sends v3 and up, could.

`install()` (run once by consumers/kafka_client/clients.py, before any producer exists) makes aiokafka's sender
build `InitProducerIdRequest` below, which offers v0 and v3: aiokafka's own negotiation picks v3 from
any broker that speaks it (Tansu, Apache Kafka 2.5 and later) and v0 from older ones. v3 with -1 and
-1 asks for what v0 asks for, a fresh producer id (or the transactional id's, its epoch bumped), so
nothing else changes. The fix belongs upstream (aiokafka could send v3 itself); `install()` refuses
an aiokafka whose sender no longer builds the request where this expects it.
"""

from __future__ import annotations

from typing import TypeAlias

from aiokafka.protocol import transaction
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import CompactString, Int16, Int32, Int64, Schema, TaggedFields

_API_KEY = 22
_FRESH = -1  # no producer id and epoch yet: the broker hands out new ones


class InitProducerIdResponse_v3(Response):  # noqa: N801 - aiokafka's naming
    FLEXIBLE_VERSION = True
    API_KEY = _API_KEY
    API_VERSION = 3
    SCHEMA = Schema(("throttle_time_ms", Int32), ("error_code", Int16), ("producer_id", Int64),
                    ("producer_epoch", Int16), ("tags", TaggedFields))


class InitProducerIdRequest_v3(RequestStruct):  # noqa: N801
    FLEXIBLE_VERSION = True
    API_KEY = _API_KEY
    API_VERSION = 3
    RESPONSE_TYPE = InitProducerIdResponse_v3
    SCHEMA = Schema(("transactional_id", CompactString("utf-8")), ("transaction_timeout_ms", Int32),
                    ("producer_id", Int64), ("producer_epoch", Int16), ("tags", TaggedFields))


_Structs: TypeAlias = transaction.InitProducerIdRequest_v0 | InitProducerIdRequest_v3


class InitProducerIdRequest(Request[_Structs]):
    """aiokafka's request with v3 beside v0; the sender builds it with the same two arguments."""

    API_KEY = _API_KEY

    def __init__(self, transactional_id: str | None, transaction_timeout_ms: int) -> None:
        self._transactional_id = transactional_id
        self._transaction_timeout_ms = transaction_timeout_ms

    def build(self, request_struct_class: type[_Structs]) -> _Structs:
        if request_struct_class.API_VERSION >= 3:
            return request_struct_class(self._transactional_id, self._transaction_timeout_ms, _FRESH, _FRESH, {})
        return request_struct_class(self._transactional_id, self._transaction_timeout_ms)


def install() -> None:
    """Make every aiokafka producer in this process send InitProducerId v3 where the broker has it (idempotent)."""
    from aiokafka.producer import sender

    current = getattr(sender, "InitProducerIdRequest", None)
    if current is InitProducerIdRequest:
        return
    if current is not transaction.InitProducerIdRequest or hasattr(transaction, "InitProducerIdRequest_v3"):
        raise RuntimeError("aiokafka.producer.sender no longer builds InitProducerIdRequest v0 where "
                           "consumers/kafka_client/init_producer_id.py expects it: this aiokafka is newer than Kev's adapter "
                           "knows (it may send v3 itself); pin aiokafka or update the adapter")
    sender.InitProducerIdRequest = InitProducerIdRequest
