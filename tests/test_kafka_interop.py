"""A second, independent client (confluent-kafka / librdkafka) asks and reads the answer."""

import anyio
import pytest

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import kafka_config, question, running_worker  # noqa: E402
from polling import eventually_sync  # noqa: E402
from schemas import decode_answer  # noqa: E402

confluent_kafka = pytest.importorskip("confluent_kafka")

pytest_plugins = ["kafka_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


def confluent_produce(bootstrap: str, topic: str, value: bytes, key: bytes) -> None:
    # Explicit: Tansu rejects idempotent producers (InitProducerId fails).
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": False,
                                         "acks": "all"})
    errors = []
    producer.produce(topic, value, key=key, on_delivery=lambda error, _: errors.append(error))
    assert producer.flush(10) == 0 and errors == [None]


def confluent_read_one(bootstrap: str, topic: str, timeout: float = 20.0):
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "interop-reader",
                                         "enable.auto.commit": False})
    consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
    def a_record() -> list:  # in a list: a Message with an empty value is falsy
        message = consumer.poll(0.2)
        return [message] if message is not None and message.error() is None else []

    try:
        return eventually_sync(a_record, timeout=timeout, every=0, what=f"a record on {topic}")[0]
    finally:
        consumer.close()


async def test_a_confluent_kafka_client_asks_and_reads_the_answer(kafka_broker):
    cfg = kafka_config(kafka_broker, partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    async with running_worker(cfg):
        value = question("from-librdkafka", "hello from C", request_id="req-7")
        await anyio.to_thread.run_sync(confluent_produce, bootstrap, cfg.questions_topic, value, b"from-librdkafka")
        message = await anyio.to_thread.run_sync(confluent_read_one, bootstrap, cfg.answers_topic)

    assert message.key() == b"from-librdkafka"
    assert dict(message.headers()) == {"schema": b"1", "content-type": b"application/json",
                                       "question_id": b"from-librdkafka", "request_id": b"req-7",
                                       "principal": b"unsigned/-"}
    answer = decode_answer(message.value())
    assert (answer.question_id, answer.request_id, answer.text) == ("from-librdkafka", "req-7", "echo: hello from C")
