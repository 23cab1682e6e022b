"""Tool calls on Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF (tests/qwen_gguf.py) through `kev gateway`, with the
official `openai` client: its own chat template renders the tools and the conversation's calls; `required` and a
named function always give a valid call to a listed function; `auto` reads the calls the model writes by
itself; a stream's deltas assemble to the same call.

Marked real_model: `make test` and `make test-real` run it (about 90 ms a token here: a few short greedy answers).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from gateway_fixtures import API_KEY, live_stack, stack_config  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = [pytest.mark.real_model, pytest.mark.kafka]

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "description": "IANA zone name"}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(kafka_broker):
    from kafka_fixtures import kafka_config
    from qwen_gguf import assemble

    from engine import load_model

    model = load_model(str(assemble()), device="cpu", dtype="fp32")
    # Deadlines for a loaded 2-core host: a 260-token prompt took 30 s there, a token up to 1.5 s.
    cfg = stack_config(kafka_config(kafka_broker, partitions=1), served_model_name=MODEL, max_prompt_chars=8000,
                       request_timeout_ms=900_000)
    with live_stack(cfg, model) as running, \
            openai.OpenAI(base_url=running.base_url, api_key=API_KEY, max_retries=0, timeout=900) as openai_client:
        yield openai_client


def check_call(call, names=("get_weather", "get_time")) -> dict:
    """A call in OpenAI's shape to a listed function, its arguments valid under that function's schema."""
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(arguments, schema)
    return arguments


def ask(client, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0.0,
                                             "max_tokens": 40, **fields})


def test_required_and_a_named_function_give_a_valid_call(client):
    required = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1, required
    check_call(required.message.tool_calls[0])
    # One call: with parallel calls allowed, Qwen goes on to a second call and runs into max_tokens.
    named = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}},
                parallel_tool_calls=False).choices[0]
    assert named.finish_reason == "tool_calls" and len(named.message.tool_calls) == 1, named
    check_call(named.message.tool_calls[0], names=("get_time",))


def test_auto_reads_the_call_the_model_writes_and_a_stream_assembles_the_same(client):
    whole = ask(client).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls, whole  # Qwen calls it, tags left out
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and check_call(call)["city"] == "Paris"
    chunks = list(ask(client, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    streamed = [c for d in deltas for c in d.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == \
        [(0, call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(d.content or "" for d in deltas).strip()


def test_the_calls_result_goes_back_through_the_template(client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0.0, max_tokens=24).choices[0]
    assert answer.message.tool_calls is None and "21" in answer.message.content, answer
