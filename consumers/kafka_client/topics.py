"""Kev's topics and their partition counts, created if missing (an existing topic is left as it is).

Every topic Kev creates (reply topics too) takes `kafka.replication_factor` (default -1: the broker's
default.replication.factor) and, where set, `kafka.min_insync_replicas`: on a cluster of several brokers
`acks=all` protects an answer only as far as these reach.

The control topic is compacted (cleanup.policy=compact): its commands are keyed by what they change
(schemas.control_key), so Kafka keeps the latest command per key for good and a replay at start-up
stays short; with the default delete policy, adapters loaded a retention period ago would vanish at
the next restart. A control topic that already exists keeps the policy it was created with: alter it
with the broker's tools (kafka-configs --alter --add-config cleanup.policy=compact).
"""

from __future__ import annotations

from collections.abc import Mapping

from aiokafka.admin import NewTopic
from aiokafka.errors import for_code

from consumers.kafka_client.clients import open_admin
from schemas import KafkaConfig

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


def new_topics(cfg: KafkaConfig, topics: Mapping[str, int],
               configs: Mapping[str, Mapping[str, str]] | None = None) -> list[NewTopic]:
    """What Kev asks the broker to create: each topic with its partitions, the fleet's replication factor
    and min.insync.replicas, and its own configs."""
    durability = {} if cfg.min_insync_replicas is None else {"min.insync.replicas": str(cfg.min_insync_replicas)}
    # -1 (the broker's default) is legal only beside a replica assignment, and an empty one says "none".
    assignments = {} if cfg.replication_factor == -1 else None
    return [NewTopic(name, partitions, cfg.replication_factor, replica_assignments=assignments,
                     topic_configs={**durability, **(configs or {}).get(name, {})})
            for name, partitions in topics.items()]


async def ensure_topics(cfg: KafkaConfig) -> None:
    await create_topics(cfg, topic_plan(cfg), configs=topic_configs(cfg))


async def create_topics(
    cfg: KafkaConfig,
    topics: Mapping[str, int],
    *,
    configs: Mapping[str, Mapping[str, str]] | None = None,  # topic name -> topic configs
) -> None:
    """Create each missing topic with its partition count; raise on any error but "already exists"."""
    async with open_admin(cfg) as admin:
        response = await admin.create_topics(new_topics(cfg, topics, configs))
    for topic, code, message, *_ in response.topic_errors:
        if code not in (0, _TOPIC_ALREADY_EXISTS):
            raise for_code(code)(f"creating topic {topic!r}: {message}")
