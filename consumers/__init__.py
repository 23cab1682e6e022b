"""Kev's Kafka side: the question consumer, the answer publisher, offsets, the DLQ, the control
reader, the embedded broker.

Imports only `schemas` (and libraries); anyio memory streams of `Inbound` / `Outbound` connect it
to the engine actor. Everything that touches Kafka runs on anyio's asyncio backend.
"""

from consumers.broker import EMBEDDED, BrokerStartError, EmbeddedBroker, embedded_kafka
from consumers.control import ControlGate, control_record, run_control_reader, send_control
from consumers.control_audit import run_control_audit
from consumers.messages import Inbound, Outbound, Partition, Position
from consumers.offsets import OffsetRegression, OffsetTracker
from consumers.topics import create_topics, ensure_topics, topic_configs, topic_plan
from consumers.worker import KafkaStatistics, KafkaWorker, run_kafka_io

__all__ = [
    "EMBEDDED",
    "BrokerStartError",
    "ControlGate",
    "EmbeddedBroker",
    "Inbound",
    "KafkaStatistics",
    "KafkaWorker",
    "OffsetRegression",
    "OffsetTracker",
    "Outbound",
    "Partition",
    "Position",
    "control_record",
    "create_topics",
    "embedded_kafka",
    "ensure_topics",
    "run_control_audit",
    "run_control_reader",
    "run_kafka_io",
    "send_control",
    "topic_configs",
    "topic_plan",
]
