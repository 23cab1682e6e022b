"""Kev's Kafka side, more than a consumer: one room each for questions in (`intake/`), answers out
(`publish/`), the control topic (`control/`), the client layer every Kafka client is opened through
(`kafka_client/`) and the embedded broker (`broker/`); `worker.py` runs them as one actor.

Imports only `schemas` (and libraries); anyio memory streams of `Inbound` / `Outbound` connect it
to the engine actor. Everything that touches Kafka runs on anyio's asyncio backend.
"""

from consumers.broker.embedded import EMBEDDED, BrokerStartError, EmbeddedBroker, embedded_kafka
from consumers.control.audit import run_control_audit
from consumers.control.reader import ControlGate, control_record, run_control_reader, send_control
from consumers.intake.offsets import OffsetRegression, OffsetTracker
from consumers.kafka_client.topics import create_topics, ensure_topics, topic_configs, topic_plan
from consumers.messages import Inbound, Outbound, Partition, Position
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
