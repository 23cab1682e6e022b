"""router.normalize (engine/normalization.py): seed 002's clean-up of a question's user text, the same for a
question alone or packed, and said in its answer's audit."""

from __future__ import annotations

import random

import pytest

from engine.normalization import normalize_text, normalized
from schemas import Message, Params, QuestionEvent

CASES = [
    ("Um, how do I get a refund???", "How do I get a refund?"),
    ("  ....  嗯，请问怎么退款？？？", "怎么退款？"),
    ("那个，怎么退款", "怎么退款"),
    ("嗯嗯嗯。。。我想问一下，发货要多久", "发货要多久"),
    ("Hmm... iPhone won't charge!!", "iPhone won't charge!"),
    ("So, what is 2+2?", "What is 2+2?"),
    ("----\nTitle\n\n\n\n\nbody   text  \n    indented   code", "Title\n\nbody text\n    indented code"),
    # words that only begin like a filler, and marks that mean something when repeated, stay
    ("那个人是谁", "那个人是谁"),
    ("额度怎么提高", "额度怎么提高"),
    ("呃逆怎么办", "呃逆怎么办"),
    ("so what is 2+2?", "so what is 2+2?"),
    ("umbrella prices?", "umbrella prices?"),
    ("https://x.y/a//b ... `a == b` **bold** a::b", "https://x.y/a//b ... `a == b` **bold** a::b"),
    ("```python\nx = 1\n```", "```python\nx = 1\n```"),
    ("嗯，", ""),
]


@pytest.mark.parametrize(("text", "want"), CASES)
def test_the_rules(text, want):
    assert normalize_text(text) == want


def test_normalising_twice_changes_nothing_more():
    pieces = ["um", "Um", ",", " ", "  ", "\n", "\n\n\n", "?", "??", "！！", "嗯", "那个", "，", "请问", "how",
              "iP", "----", "...", "So,", "well,", "\t", "。", "、", "额", "度", "hmm", ":", "-", "*", "É", "x"]
    rng = random.Random(40)
    for _ in range(5000):
        once = normalize_text("".join(rng.choice(pieces) for _ in range(rng.randrange(9))))
        assert normalize_text(once) == once


def test_only_the_user_text_of_a_question_changes():
    system, said = "Be   terse!!", "Sure!!  Ask."
    question = QuestionEvent(question_id="a", system=system, messages=(
        Message("user", "um, hi??"), Message("assistant", said), Message("user", "嗯，再见")))
    got = normalized(question)
    assert [m.content for m in got.messages] == ["hi?", said, "再见"] and got.system == system
    raw = QuestionEvent(question_id="b", prompt="um, continue this...  ", raw=True)
    clean = QuestionEvent(question_id="c", prompt="What is 2+2?")
    assert normalized(raw) is raw and normalized(clean) is clean  # the same object: nothing changed


@pytest.fixture(scope="module")
def text_model(smollm2_tokenizer, harness):
    """A tiny random Llama with SmolLM2's vocabulary and chat template: real text goes in."""
    hf = harness.build_hf_tiny("llama", seed=41, vocab_size=len(smollm2_tokenizer))
    return harness.kev_model_from_hf(hf, smollm2_tokenizer)


def answers(model, options, questions):
    from engine import EngineCore

    core = EngineCore(model, options)
    for question in questions:
        core.add(question)
    out = {}
    while core.has_work:
        out.update((a.question_id, a) for a in core.step().answers)
    return out


def test_normalize_gives_the_same_answer_alone_and_packed_and_says_so(text_model, harness):
    greedy = Params(max_new_tokens=12, temperature=0.0)
    messy = QuestionEvent(question_id="messy", prompt="Um,   what is  the capital of France???", params=greedy)
    tidy = QuestionEvent(question_id="tidy", prompt="What is the capital of France?", params=greedy)
    others = [QuestionEvent(question_id=f"o{i}", prompt=text, params=greedy)
              for i, text in enumerate(["嗯，请问怎么退款？？", "Write a haiku.", "Explain TCP   in one line!!!"])]
    on = harness.tiny_options(normalize=True)
    alone = answers(text_model, on, [messy])["messy"]
    packed = answers(text_model, on, [others[0], messy, *others[1:], tidy])
    as_if_typed_tidy = answers(text_model, harness.tiny_options(), [tidy])["tidy"]
    assert max(packed["messy"].audit.batch_sizes) == 5 and max(alone.audit.batch_sizes) == 1
    assert alone.token_ids == packed["messy"].token_ids == as_if_typed_tidy.token_ids
    assert alone.usage.prompt_tokens == as_if_typed_tidy.usage.prompt_tokens
    assert alone.audit.normalized and packed["messy"].audit.normalized and packed["o0"].audit.normalized
    assert not packed["tidy"].audit.normalized and not packed["o1"].audit.normalized
    off = answers(text_model, harness.tiny_options(), [messy])["messy"]
    assert not off.audit.normalized and off.usage.prompt_tokens > alone.usage.prompt_tokens
