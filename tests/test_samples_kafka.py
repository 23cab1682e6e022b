"""A question's params.n answers on Kafka: one answer event per sample, each with its index, sent together;
its offset committed only once every one is acked; with exactly_once all in one transaction."""

import anyio
import msgspec
import pytest

from consumers import Outbound

pytest.register_assert_rewrite("kafka_fixtures")
from kafka_fixtures import (  # noqa: E402
    committed,
    kafka_config,
    produce,
    question,
    read_topic,
    running_worker,
    wait_committed,
)
from polling import eventually  # noqa: E402
from schemas import AnswerEvent, decode_answer  # noqa: E402
from test_exactly_once import committed_answers  # noqa: E402

pytest_plugins = ["kafka_fixtures"]
pytestmark = [pytest.mark.kafka]
SAMPLES = 4


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka is asyncio-only


class SamplingEngine:
    """Test code in the engine's place: answers each sample of a question, the last only once `last` is set."""

    def __init__(self) -> None:
        self.last = anyio.Event()
        self.sent_before_last = anyio.Event()

    async def __call__(self, inbox, outbox) -> None:
        async with inbox, outbox:
            async for inbound in inbox:
                q = inbound.question
                for index in range(q.params.n):
                    if index == q.params.n - 1:
                        self.sent_before_last.set()
                        await self.last.wait()
                    answer = AnswerEvent(question_id=q.question_id, text=f"sample {index}", index=index)
                    await outbox.send(Outbound(answer, inbound))


@pytest.mark.anyio
@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_the_samples_go_out_together_and_settle_the_question_at_the_last(kafka_broker, delivery):
    cfg = kafka_config(kafka_broker, partitions=1, delivery=delivery, transaction_ms=50)
    engine = SamplingEngine()
    asked = question("q", params={"n": SAMPLES, "temperature": 0.8})
    async with running_worker(cfg, engine) as worker:
        await produce(cfg.bootstrap_servers, cfg.questions_topic, [asked])
        with anyio.fail_after(20):
            await engine.sent_before_last.wait()
        # The publisher holds the samples so far: nothing of the question is out or committed until the last.
        await eventually(lambda: worker.statistics().samples_gathering == SAMPLES - 1)
        assert await committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, 1) == {0: None}
        assert await read_topic(cfg.bootstrap_servers, cfg.answers_topic, 0, timeout=0.1, linger=0.2) == []
        engine.last.set()
        records = (await committed_answers(cfg, SAMPLES) if delivery == "exactly_once"
                   else await read_topic(cfg.bootstrap_servers, cfg.answers_topic, SAMPLES))
        await wait_committed(cfg.bootstrap_servers, cfg.group_id, cfg.questions_topic, {0: 1})
    answers = [decode_answer(r.value) for r in records]
    assert sorted((a.question_id, a.index, a.text) for a in answers) == [
        ("q", i, f"sample {i}") for i in range(SAMPLES)]
    assert len({r.partition for r in records}) == 1


def test_an_answer_with_logprobs_is_cut_with_its_tokens_to_fit_the_record_limit():
    from consumers.publish.delivery import cut_answer
    from consumers.publish.records import _answer_size
    from schemas import TokenLogprob, TopLogprob

    entry = TokenLogprob("tok", 7, -0.5, tuple(TopLogprob(f"t{i}", i, -1.0 - i) for i in range(20)))
    answer = AnswerEvent(question_id="q", text="tok" * 400, token_ids=(7,) * 400, logprobs=(entry,) * 400)
    limit = _answer_size(answer) // 3
    cut = cut_answer(answer, _answer_size, limit)
    assert cut.truncated and _answer_size(cut) <= limit and 0 < len(cut.logprobs) == len(cut.token_ids) < 400
    assert msgspec.json.decode(msgspec.json.encode(cut), type=AnswerEvent) == cut
