"""logprobs and n through the gateway with the official `openai` client, against a live stack (the embedded
Tansu broker, an in-process worker on the tiny random-weight Llama, the gateway): OpenAI's shapes, whole and
streamed; logprobs equal to transformers' on the same weights; n seeded choices, each the same question asked
alone with its derived seed."""

from __future__ import annotations

import openai
import pytest
import torch

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures", "gateway_fixtures")
from schemas import sample_seed  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]
pytestmark = pytest.mark.kafka

MODEL = "tiny"
SEA = [{"role": "user", "content": "Say something about the sea."}]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def test_completion_logprobs_equal_transformers(client, tiny_model, hf_tiny):
    prompt = "The sea is"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    choice = completion.choices[0]
    prompt_ids = tiny_model.tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf_tiny.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=6, pad_token_id=0,
                               eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    expected = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = choice.logprobs
    assert logprobs.tokens == [tiny_model.tokenizer.decode([i]) for i in ids]
    assert logprobs.token_logprobs == pytest.approx([expected[k, i].item() for k, i in enumerate(ids)], abs=TOLERANCE)
    for k, top in enumerate(logprobs.top_logprobs):
        assert len(top) <= 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert top[logprobs.tokens[k]] == pytest.approx(logprobs.token_logprobs[k], abs=TOLERANCE)  # greedy: the top
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == choice.text


def test_chat_logprobs_whole_and_streamed_agree(client):
    params = dict(model=MODEL, messages=SEA, max_tokens=10, temperature=0.9, seed=5, logprobs=True, top_logprobs=4)
    whole = client.chat.completions.create(**params).choices[0]
    content = whole.logprobs.content
    assert len(content) >= 1 and "".join(entry.token for entry in content).startswith(whole.message.content)
    for entry in content:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + TOLERANCE
        assert bytes(entry.bytes).decode() == entry.token
    streamed = [entry for chunk in client.chat.completions.create(**params, stream=True)
                for choice in chunk.choices if choice.logprobs is not None for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_n_seeded_choices_differ_and_each_is_its_seed_asked_alone(client):
    params = dict(model=MODEL, messages=SEA, max_tokens=8, temperature=1.0)
    completion = client.chat.completions.create(**params, n=3, seed=21)
    texts = [choice.message.content for choice in completion.choices]
    assert [choice.index for choice in completion.choices] == [0, 1, 2] and len(set(texts)) == 3
    alone = [client.chat.completions.create(**params, seed=sample_seed(21, i)) for i in range(3)]
    assert texts == [answer.choices[0].message.content for answer in alone]
    assert completion.usage.completion_tokens == sum(answer.usage.completion_tokens for answer in alone)
    assert completion.usage.prompt_tokens == alone[0].usage.prompt_tokens
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(**params, n=3, seed=21, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}


def test_completions_n_and_a_greedy_n_refused_unless_allowed(client):
    completion = client.completions.create(model=MODEL, prompt="Waves", max_tokens=5, temperature=0.8, seed=3, n=2)
    assert sorted(choice.index for choice in completion.choices) == [0, 1]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Waves", max_tokens=5, temperature=0, n=2)
    assert refused.value.body["param"] == "n" and "identical" in refused.value.body["message"]
    same = client.completions.create(model=MODEL, prompt="Waves", max_tokens=5, temperature=0, n=2,
                                     extra_body={"allow_identical_samples": True})
    assert same.choices[0].text == same.choices[1].text
