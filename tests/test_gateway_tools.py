"""Tool calls on chat completions: `<tool_call>` blocks read into OpenAI's tool_calls (whole and streamed),
the request's checks, the grammar built from the tools' schemas (on token sequences), and through a live
stack with the official `openai` client: a template without a tool format refuses tools with a 400. The calls
a model makes through the gateway: test_gateway_tool_calls.py."""

from __future__ import annotations

import json
import random

import llguidance
import openai
import pytest

from engine.constrain.grammars import llg_tokenizer
from engine.prompt import encode_prompt, tool_format_missing
from kev_async.gateway.errors import ApiError
from kev_async.gateway.openai_requests import ChatRequest, parse_request, to_question
from kev_async.gateway.tool_calls import CallReader, message_with_calls
from kev_async.gateway.tools import tool_use
from schemas import decode_question

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures", "tool_fixtures")
from tool_fixtures import TOOLS, WEATHER  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures", "tool_fixtures"]

NAMES = frozenset({"get_weather", "get_time"})
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CLOCK_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def without_ids(message: dict) -> dict:
    calls = [{k: v for k, v in call.items() if k != "id"} for call in message.get("tool_calls", ())]
    return {**message, "tool_calls": calls}


# -- reading answers -----------------------------------------------------------------------------------

def test_blocks_become_openai_tool_calls_and_the_rest_stays_text():
    message, called = message_with_calls(f"Let me check.\n{CALL}\n{CLOCK_CALL}", NAMES, parallel=True)
    assert called and message["content"] == "Let me check."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
        {"name": "get_time", "arguments": '{"zone": "CET"}'}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    only_first, _ = message_with_calls(f"{CALL}\n{CLOCK_CALL}", NAMES, parallel=False)
    assert [c["function"]["name"] for c in only_first["tool_calls"]] == ["get_weather"]
    assert only_first["content"] is None


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"launch_rockets\", \"arguments\": {}}\n</tool_call>",  # not one of the tools
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \n</tool_call>",  # not JSON
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": [1]}\n</tool_call>",  # arguments not an object
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"",  # cut by max_tokens: unclosed
    "Plain text, no calls.",
    '{"name": "get_time", "arguments": {"zone": "CET"}} and some words',  # an object, then more: text
    '{"answer": 42}',
])
def test_what_is_not_a_call_to_a_listed_tool_stays_text(text):
    message, called = message_with_calls(text, NAMES, parallel=True)
    assert not called and "tool_calls" not in message and message["content"] == text


def test_an_answer_that_is_only_a_call_without_tags_is_a_call():
    message, called = message_with_calls('\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n', NAMES, True)
    assert called and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


@pytest.mark.parametrize("text", [f"  Checking two things. {CALL}\n{CLOCK_CALL}\nDone <tool_ca",
                                  ' {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}',
                                  '{"name": "get_weather"} is what I would call, with ' + CALL])
def test_a_stream_in_any_pieces_assembles_to_the_whole_message(text):
    whole, _ = message_with_calls(text, NAMES, parallel=True)
    rng = random.Random(45)
    for _ in range(20):
        reader, deltas, at = CallReader(NAMES), [], 0
        while at < len(text):
            size = rng.randint(1, 12)
            deltas += reader.feed(text[at:at + size])
            at += size
        deltas += reader.end()
        calls = [call for d in deltas for call in d.get("tool_calls", ())]
        assert [c["index"] for c in calls] == list(range(len(whole.get("tool_calls", ()))))
        assert all(len(d) == 1 for d in deltas)  # each delta is content or one call, whole
        for call in calls:
            del call["index"]
        streamed = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas) or None,
                    "refusal": None, "tool_calls": calls}
        if not calls:
            del streamed["tool_calls"]
        assert without_ids(streamed) == without_ids(whole)
    assert whole["content"] in ("Checking two things.\nDone <tool_ca", None, '{"name": "get_weather"} is what I '
                                "would call, with")


# -- the request's checks --------------------------------------------------------------------------------

def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": ASK, **fields}).encode()


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rockets"}}}, "tool_choice",
     '"launch_rockets" is not among'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "expected 'none', 'auto', 'required'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function",
     "missing required field `name`"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "match"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": "required"}, "tools", "Invalid type: strnig"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give one of them"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_tool_requests_are_400s_naming_the_field(fields, param, words):
    with pytest.raises(ApiError) as error:
        request = parse_request(chat(**fields), ChatRequest)
        to_question(request, question_id="q", tenant=None, reply_topic="r", timeout_ms=1000, adapter=None,
                    max_prompt_chars=10_000)
    assert error.value.status == 400 and error.value.param == param and words in error.value.message, \
        error.value.body()


def test_tool_messages_and_calls_travel_to_the_worker_and_render(tool_tokenizer):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    request = parse_request(chat(messages=history, tools=TOOLS), ChatRequest)
    question = to_question(request, question_id="q", tenant=None, reply_topic="r", timeout_ms=1000, adapter=None,
                           max_prompt_chars=10_000)
    assert [t.function.name for t in question.tools] == ["get_weather", "get_time"]
    assert question.params.response_format is None  # auto: the model chooses
    text = tool_tokenizer.decode(encode_prompt(tool_tokenizer, question))
    assert '"name": "get_time"' in text and '<tool_response>\nSunny, 21 C\n</tool_response>' in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in text  # arguments as an object
    none = parse_request(chat(tools=TOOLS, tool_choice="none"), ChatRequest)
    assert tool_use(none) is None
    plain = to_question(none, question_id="q", tenant=None, reply_topic="r", timeout_ms=1000, adapter=None,
                        max_prompt_chars=10_000)
    assert plain.tools == () and plain.params.response_format is None


def test_smollm2s_template_has_no_tool_format_and_the_worker_refuses_tools(smollm2_tokenizer, tool_tokenizer):
    assert "no tool-call format" in tool_format_missing(smollm2_tokenizer)
    assert tool_format_missing(tool_tokenizer) is None
    question = decode_question(json.dumps({"question_id": "q", "messages": ASK, "tools": TOOLS}))
    with pytest.raises(ValueError, match="tools: the model's chat template has no tool-call format"):
        encode_prompt(smollm2_tokenizer, question)


# -- the grammar, on token sequences ---------------------------------------------------------------------

def grammar_for(choice, parallel: bool = True) -> str:
    request = parse_request(chat(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel), ChatRequest)
    return tool_use(request).grammar()


def accepts(tokenizer, grammar: str, text: str, *, end: bool = True) -> bool:
    """Whether the grammar takes the text's tokens (as the tokenizer encodes it), and then (`end`) lets the answer
    end there."""
    matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer, tokenizer.eos_token_id), grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and (not end or matcher.is_accepting())


def test_the_grammar_takes_only_valid_calls_to_the_chosen_tools(tool_tokenizer):
    required, one, named = grammar_for("required"), grammar_for("required", parallel=False), \
        grammar_for({"type": "function", "function": {"name": "get_time"}})
    assert accepts(tool_tokenizer, required, CALL) and accepts(tool_tokenizer, required, f"{CALL}\n{CLOCK_CALL}")
    assert accepts(tool_tokenizer, one, CLOCK_CALL) and not accepts(tool_tokenizer, one, f"{CALL}\n{CLOCK_CALL}")
    assert accepts(tool_tokenizer, named, CLOCK_CALL) and not accepts(tool_tokenizer, named, CALL)
    for bad in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name":"get_time","arguments":{"zone":"CET"}}\n</tool_call>',  # not the template's
                "Sure! " + CALL, "The weather is fine."):
        assert not accepts(tool_tokenizer, required, bad), bad
    unclosed = CALL.removesuffix("</tool_call>")
    assert accepts(tool_tokenizer, required, unclosed, end=False)
    assert not accepts(tool_tokenizer, required, unclosed)  # the answer may end only once a call is complete


# -- through the gateway, with the official client ----------------------------------------------------------

@pytest.mark.kafka
def test_a_template_without_a_tool_format_refuses_tools_with_a_400(client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, stream=stream)
        assert "no tool-call format" in error.value.body["message"], error.value.body
    # tool_choice none leaves the tools out of the prompt: any model answers in text
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                            max_tokens=4)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
