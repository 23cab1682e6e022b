"""policy auto: how likely a question's next draft tokens are to be kept.

A prompt-lookup draft's first token is kept far more often after a long n-gram match than after a
one-token one. With policy always on SmolLM2 (64 new tokens, greedy): open chat at 16 questions kept
the first token of 22% of its drafts after a 1-token match, 50% after 2 and 86% after 3; extraction
39%, 67% and 100%. One rate per question hides that: a chat question's 1-token matches were priced at
its mixed rate (about 0.5) and verified at 16 questions, where only drafts kept more than half the
time pay. So the first token's chance is learned per kind of draft (its match length; 0 for a draft
model): the engine's running rate for that kind is the prior, and the question's own drafts of that
kind move it. The tokens after the first follow the question's own running rate: a draft that got its
first token right is copying text that really repeats.

Plain numbers, no torch. The rates decide only which drafts are verified, never what is emitted: the
engine-wide rate pools questions' outcomes for speed alone (docs/speculative.md, "Policy").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence

# A rate starts at PRIOR_RATE, worth PRIOR_TRIALS observations.
PRIOR_RATE = 0.5
PRIOR_TRIALS = 2.0
# A question's old observations fade each step it could draft: text that starts quoting later (or
# stops) is noticed, and a question that stopped drafting tries again once its failures faded (~20 steps).
DECAY = 0.95
# The engine's rates fade each step the policy decides: a kind it stopped verifying (its drafts were
# rarely kept) comes back to the prior and is tried again after some hundred steps, and a change of
# workload is followed.
ENGINE_DECAY = 0.99


def rate(hits: float, trials: float, prior: float = PRIOR_RATE) -> float:
    """Kept over tried, with the prior mixed in."""
    return (hits + prior * PRIOR_TRIALS) / (trials + PRIOR_TRIALS)


@dataclass
class KindRates:
    """The engine's first-token rate per kind of draft, over every question's drafts, fading."""

    counts: dict[int, list[float]] = field(default_factory=dict)  # kind -> [kept, tried]

    def first(self, kind: int) -> float:
        kept, tried = self.counts.get(kind, (0.0, 0.0))
        return rate(kept, tried)

    def record(self, kind: int, kept: bool) -> None:
        counts = self.counts.setdefault(kind, [0.0, 0.0])
        counts[0] += kept
        counts[1] += 1

    def fade(self) -> None:
        for counts in self.counts.values():
            counts[0] *= ENGINE_DECAY
            counts[1] *= ENGINE_DECAY


@dataclass(frozen=True)
class Odds:
    """A question's offer to the policy: its first draft token's chance, each later one's (given the
    one before was kept), and how many drafts it may take."""

    first: float
    then: float
    most: int


def odds(seq: Sequence, kind: int, engine: KindRates, most: int) -> Odds:
    """The chances of `seq`'s next draft, of `kind`; its past fades a little each time it is asked."""
    seq.draft_hits *= DECAY
    seq.draft_trials *= DECAY
    mine = seq.first_draft_counts.setdefault(kind, [0.0, 0.0])
    mine[0] *= DECAY
    mine[1] *= DECAY
    return Odds(rate(mine[0], mine[1], engine.first(kind)), rate(seq.draft_hits, seq.draft_trials), most)


def record(seq: Sequence, kind: int, engine: KindRates, drafted: int, accepted: int) -> None:
    """A verified draft of `kind`: whether its first token was kept, then, past the first, each kept
    token and the first rejected one."""
    first_kept = accepted > 0
    engine.record(kind, first_kept)
    mine = seq.first_draft_counts.setdefault(kind, [0.0, 0.0])
    mine[0] += first_kept
    mine[1] += 1
    if first_kept and drafted > 1:
        seq.draft_hits += accepted - 1
        seq.draft_trials += accepted - 1 + (1 if accepted < drafted else 0)


def draft_kind(origin: dict | None) -> int:
    """A draft's kind: a prompt lookup's match length; 0 for anything else (a draft model)."""
    return int((origin or {}).get("match", 0))
