"""Tool calls through `kev gateway` with the official `openai` client, on a tiny random-weight model whose chat
template has a Hermes-style tool format (tool_fixtures.py): under `required` or a named function the grammar
holds it to valid calls whatever its weights, whole and streamed; under `auto` it answers text."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures", "tool_fixtures")
from gateway_fixtures import API_KEY, live_stack, stack_config  # noqa: E402
from tool_fixtures import TOOLS  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures", "tool_fixtures"]
pytestmark = pytest.mark.kafka

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_client(kafka_broker, tool_model):
    from kafka_fixtures import kafka_config

    cfg = stack_config(kafka_config(kafka_broker, partitions=1))
    with live_stack(cfg, tool_model) as running, \
            openai.OpenAI(base_url=running.base_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_required_and_named_choices_always_make_valid_calls(tool_client):
    for seed, choice in ((1, "required"), (2, "required"), (3, {"type": "function", "function": {"name": "get_time"}})):
        answer = tool_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                     parallel_tool_calls=False, max_tokens=60, temperature=1.0,
                                                     seed=seed)
        choice_out = answer.choices[0]
        assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None, choice_out
        (call,) = choice_out.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_streamed_calls_assemble_to_the_same_call(tool_client):
    asked = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 max_tokens=60, temperature=1.0, seed=5)
    whole = tool_client.chat.completions.create(**asked).choices[0]
    chunks = list(tool_client.chat.completions.create(**asked, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [call for d in deltas for call in d.tool_calls or ()]
    assert len(streamed) == 1 and streamed[0].index == 0
    (call,) = whole.message.tool_calls
    assert (streamed[0].function.name, streamed[0].function.arguments) == (call.function.name, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(d.content or "" for d in deltas)


def test_auto_answers_text_when_the_model_makes_no_call(tool_client):
    answer = tool_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=8,
                                                 temperature=0.0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
