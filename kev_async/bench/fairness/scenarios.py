"""Who asks what, and when: the questions of `kev bench fairness`, each with its tenant and arrival time."""

from __future__ import annotations

from dataclasses import dataclass

from kev_async.sample_questions import QUESTIONS
from schemas import Params, QuestionEvent


@dataclass(frozen=True)
class Asked:
    tenant: str
    arrival_s: float  # after the scenario starts
    question: QuestionEvent


@dataclass(frozen=True)
class Scenario:
    name: str
    asked: list[Asked]
    weights: dict[str, float]  # tenants.<name>.weight

    def only(self, tenant: str) -> Scenario:
        """The same scenario with `tenant`'s questions alone."""
        return Scenario(f"{self.name}, {tenant} alone", [a for a in self.asked if a.tenant == tenant], self.weights)


def flood(count: int, tokens: int, small: int, small_tokens: int, after_s: float) -> Scenario:
    """Tenant bulk asks `count` questions at once; `after_s` later tenant chat asks `small` short ones."""
    bulk = [_asked("bulk", 0.0, f"bulk-{i}", QUESTIONS[i % len(QUESTIONS)], tokens) for i in range(count)]
    chat = [_asked("chat", after_s, f"chat-{i}", QUESTIONS[(7 * i + 3) % len(QUESTIONS)], small_tokens)
            for i in range(small)]
    return Scenario("flood", bulk + chat, {"bulk": 1.0, "chat": 1.0})


def backlogs(count: int, tokens: int, weights: tuple[float, float]) -> Scenario:
    """Tenants a and b each ask `count` questions at once (the same questions), weighted `weights`."""
    asked = [_asked(tenant, 0.0, f"{tenant}-{i}", QUESTIONS[i % len(QUESTIONS)], tokens)
             for i in range(count) for tenant in ("a", "b")]
    return Scenario(f"shares {weights[0]:g}:{weights[1]:g}", asked, {"a": weights[0], "b": weights[1]})


def _asked(tenant: str, arrival_s: float, qid: str, prompt: str, tokens: int) -> Asked:
    question = QuestionEvent(question_id=qid, prompt=prompt, tenant=tenant,
                             params=Params(max_new_tokens=tokens, temperature=0.0))
    return Asked(tenant, arrival_s, question)
