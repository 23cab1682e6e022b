"""A question's params.n samples inside the engine: one Sequence each, its own name, seed and prompt blocks
shared with its siblings.

Sample 0 keeps the question's id; sample i > 0 is named `<question_id>\\x1f<i>` (the scheduler, the pool and
the output processor key on that name; its answer carries the question's id and `index`). Each sample
draws with schemas.samples.sample_seed(seed, i). The samples of one question read one copy of the prompt's
full KV blocks by reference: they share a prefix-cache salt no other question has (one of their own
under isolation.level strict), so the first to compute a block names it and the others read it
(engine/schedule/prefix_chain.py: a sample whose next block is being computed waits for it).
"""

from __future__ import annotations

import dataclasses
import secrets

from engine.intake import QuestionRejected
from engine.sequence import SamplingParams
from schemas import sample_seed
from schemas.question_decoding import identical_samples_message

SEPARATOR = "\x1f"  # the unit separator: a sample's name is never a question's id by accident


def sample_ids(question_id: str, n: int) -> list[str]:
    return [question_id] + [f"{question_id}{SEPARATOR}{i}" for i in range(1, n)]


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    return params if index == 0 else dataclasses.replace(params, seed=sample_seed(params.seed or 0, index))


def check_samples(question, params: SamplingParams) -> None:
    """A greedy n > 1 whose temperature came from the defaults: refused here, as the intake refuses an explicit one."""
    n = question.params.n
    if n > 1 and params.greedy and not question.params.allow_identical_samples:
        raise QuestionRejected("invalid_field", identical_samples_message(n))


def private_salt() -> str:
    """A prefix-cache scope only one question's samples know."""
    return f"samples:{secrets.token_hex(16)}"
