"""A tiny random-weight model whose chat template has a Hermes-style tool format, for the tool tests: SmolLM2's
tokenizer with `<tool_call>` and `</tool_call>` added as tokens (as Qwen2.5's tokenizer has them) and a
template of our own that renders tools, calls and tool messages the way Kev reads them."""

from __future__ import annotations

import copy

import pytest

from conftest import build_hf_tiny, kev_model_from_hf

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nFunctions you may call, one JSON object per line:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "Call one as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]


@pytest.fixture(scope="session")
def tool_tokenizer(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def tool_model(tool_tokenizer):
    """A tiny Qwen2 whose vocabulary covers the tokenizer's (the added tokens included), so it can write calls, and
    whose end token is the tokenizer's, so a finished call ends the answer."""
    hf = build_hf_tiny("qwen2", seed=45, vocab_size=len(tool_tokenizer), eos_token_id=tool_tokenizer.eos_token_id)
    return kev_model_from_hf(hf, tool_tokenizer, name="tiny-tools")
