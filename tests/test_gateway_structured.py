"""`response_format` through `kev gateway` with the official `openai` client: chat and completions,
json_schema (and the client's own `parse` with a pydantic model), json_object, regex; a bad schema is
OpenAI's 400 and nothing is published. A live stack: embedded broker, worker on a tiny random-weight
Llama with SmolLM2's vocabulary, gateway."""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Literal

import anyio
import jsonschema
import openai
import pydantic
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from kafka_fixtures import read_topic  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

MODEL = "tiny"
ASK = [{"role": "user", "content": "Rate this review: the soup was cold."}]
SCHEMA = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                           "score": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["sentiment", "score"], "additionalProperties": False}


class Review(pydantic.BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    stars: int = pydantic.Field(ge=1, le=5)
    summary: str = pydantic.Field(max_length=12)


def json_schema_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "review", "schema": schema, "strict": True}}


def published(stack) -> int:
    kafka = stack.cfg.kafka
    return len(anyio.run(partial(read_topic, kafka.bootstrap_servers, kafka.questions_topic, 10**6, timeout=1.0,
                                 linger=0), backend="asyncio"))


def test_chat_json_schema_answers_parse_and_validate(client):
    for seed, temperature in ((None, 0.0), (7, 1.0)):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=80, temperature=temperature, seed=seed,
            response_format=json_schema_format())
        completion = raw.parse()
        assert completion.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(completion.choices[0].message.content), SCHEMA)
        assert json.loads(raw.headers["x-kev-audit"])["audit"]["constraint"].startswith("json_schema:")


def test_the_clients_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=120, response_format=Review)
    review = completion.choices[0].message.parsed
    assert isinstance(review, Review) and 1 <= review.stars <= 5


def test_chat_json_object_and_completions_regex(client):
    # Any JSON object has no bound on its length: a random model may run out of tokens inside a string.
    # What ends "stop" parses; one of a few seeds ends.
    ended = 0
    for seed in range(4):
        chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, seed=seed, temperature=1.0,
                                              response_format={"type": "json_object"})
        if chat.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(chat.choices[0].message.content), dict)
            ended += 1
        else:
            assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content.startswith("{")
    assert ended
    plain = client.completions.create(model=MODEL, prompt="Call us at", max_tokens=20,
                                      extra_body={"response_format": {"type": "regex",
                                                                      "pattern": r" \d{3}-\d{4}"}})
    assert re.fullmatch(r" \d{3}-\d{4}", plain.choices[0].text) and plain.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("response_format,words", [
    (json_schema_format({"type": "object", "not": {"required": ["a"]}}), 'Unimplemented keys: ["not"]'),
    (json_schema_format({"type": "strnig"}), "Invalid type: strnig"),
    ({"type": "regex", "pattern": "(ab"}, "unclosed group"),
    ({"type": "xml"}, "'xml' is not one of: text, json_object, json_schema, regex, grammar"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "json_schema.name"),
])
def test_a_bad_response_format_is_a_400_and_nothing_is_published(client, stack, response_format, words):
    before = published(stack)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format)
    assert error.value.status_code == 400
    body = error.value.body
    assert body["param"] == "response_format" and words in body["message"], body
    assert published(stack) == before
