"""Kev's topics and their partition counts, created if missing (an existing topic is left as it is).

The control topic is compacted (cleanup.policy=compact): its commands are keyed by what they change
(schemas.control_key), so Kafka keeps the latest command per key for good and a replay at start-up
stays short; with the default delete policy, adapters loaded a retention period ago would vanish at
the next restart. A control topic created before this keeps its policy: alter it with the broker's
tools (kafka-configs --alter --add-config cleanup.policy=compact).
"""

from __future__ import annotations

from collections.abc import Mapping

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import for_code

from consumers.security import client_options
from schemas import KafkaConfig, SecurityConfig

_TOPIC_ALREADY_EXISTS = 36
COMPACTED = {"cleanup.policy": "compact"}


def topic_plan(cfg: KafkaConfig) -> dict[str, int]:
    """Topic name → partitions. Answers are keyed by question_id, so they spread like questions."""
    return {
        cfg.questions_topic: cfg.partitions,
        cfg.answers_topic: cfg.partitions,
        cfg.deltas_topic: cfg.partitions,
        cfg.dlq_topic: 1,
        cfg.control_topic: 1,
    }


def topic_configs(cfg: KafkaConfig) -> dict[str, dict[str, str]]:
    """Topic name → the topic configs it is created with (those not listed get the broker's defaults)."""
    return {cfg.control_topic: COMPACTED}


async def ensure_topics(cfg: KafkaConfig, *, replication_factor: int = 1) -> None:
    await create_topics(cfg.bootstrap_servers, topic_plan(cfg), cfg.security, replication_factor=replication_factor,
                        configs=topic_configs(cfg))


async def create_topics(
    bootstrap_servers: str,
    topics: Mapping[str, int],
    security: SecurityConfig = SecurityConfig(),
    *,
    replication_factor: int = 1,
    configs: Mapping[str, Mapping[str, str]] | None = None,  # topic name -> topic configs
) -> None:
    """Create each missing topic with its partition count; raise on any error but "already exists"."""
    configs = configs or {}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, **client_options(security))
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(name, partitions, replication_factor, topic_configs=dict(configs.get(name, {})))
             for name, partitions in topics.items()]
        )
    finally:
        await admin.close()
    for topic, code, message, *_ in response.topic_errors:
        if code not in (0, _TOPIC_ALREADY_EXISTS):
            raise for_code(code)(f"creating topic {topic!r}: {message}")
