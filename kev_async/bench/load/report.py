"""What `kev bench load` measures per system, from each question's timestamps, and how it prints it.

goodput   = tokens of answers that completed / wall time of the trace (first arrival to last answer)
TTFT      = first token (as the client saw it) - arrival;   e2e = last token - arrival
identical = answers token-identical to the same question answered alone (greedy)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class Outcome:
    """One question as one system served it; times are seconds after the trace started."""

    qid: str
    arrival_s: float
    first_token_s: float | None = None
    finished_s: float | None = None
    tokens: int = 0  # completion tokens (EOS included where the system reports it)
    token_ids: list[int] | None = None  # None where the system returns only text
    text: str = ""
    finish_reason: str = ""
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.finished_s is not None

    @classmethod
    def of_answer(cls, qid: str, arrival_s: float, t0: float, answer, first: float | None, done: float) -> Outcome:
        """From Kev's AnswerEvent, with the monotonic times its first text (`first`) and its end (`done`) came."""
        return cls(qid, arrival_s, (first or done) - t0, done - t0, answer.usage.completion_tokens,
                   list(answer.token_ids), answer.text, answer.finish_reason,
                   answer.error.code if answer.error else None)


@dataclass
class SystemRun:
    name: str
    outcomes: list[Outcome]
    notes: dict = field(default_factory=dict)  # e.g. the static batch size


@dataclass
class Reference:
    """Solo greedy answers per question id: token ids, and their text for systems that return only text."""

    token_ids: dict[str, list[int]]
    texts: dict[str, str]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def identical_count(run: SystemRun, reference: Reference | None) -> int | None:
    if reference is None:
        return None
    same = 0
    for o in run.outcomes:
        if not o.completed:
            continue
        if o.token_ids is not None:
            same += o.token_ids == reference.token_ids.get(o.qid)
        else:
            same += o.text == reference.texts.get(o.qid)
    return same


def summarize(run: SystemRun, reference: Reference | None = None) -> dict:
    done = [o for o in run.outcomes if o.completed]
    wall = max((o.finished_s for o in done), default=0.0) - min((o.arrival_s for o in run.outcomes), default=0.0)
    tokens = sum(o.tokens for o in done)
    ttft = [o.first_token_s - o.arrival_s for o in done if o.first_token_s is not None]
    e2e = [o.finished_s - o.arrival_s for o in done]
    return {
        "system": run.name, "questions": len(run.outcomes), "completed": len(done),
        "errors": len(run.outcomes) - len(done), "tokens": tokens, "wall_s": wall,
        "goodput_tps": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "identical": identical_count(run, reference), **run.notes,
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summaries: list[dict]) -> str:
    lines = ["| system | done | tokens | wall s | goodput tok/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 "
             "| identical to solo |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        same = "-" if s["identical"] is None else f"{s['identical']}/{s['questions']}"
        lines.append(f"| {s['system']} | {s['completed']}/{s['questions']} | {s['tokens']} | {s['wall_s']:.1f} "
                     f"| {s['goodput_tps']:.1f} | {_seconds(s['ttft_p50_s'])} | {_seconds(s['ttft_p99_s'])} "
                     f"| {_seconds(s['e2e_p50_s'])} | {_seconds(s['e2e_p99_s'])} | {same} |")
    return "\n".join(lines)


def ratios(summaries: list[dict], base: str, against: str) -> str | None:
    """`base` over `against`: goodput ratio and how many times lower e2e p50 / TTFT p99 are."""
    by_name = {s["system"]: s for s in summaries}
    if base not in by_name or against not in by_name:
        return None
    a, b = by_name[base], by_name[against]
    parts = []
    if b["goodput_tps"]:
        parts.append(f"goodput {a['goodput_tps'] / b['goodput_tps']:.2f}x")
    for key, label in (("e2e_p50_s", "e2e p50"), ("ttft_p99_s", "TTFT p99")):
        if a[key] and b[key]:
            parts.append(f"{label} {b[key] / a[key]:.2f}x lower")
    return f"{base} vs {against}: " + ", ".join(parts)


def outcomes_json(run: SystemRun) -> list[dict]:
    return [{k: v for k, v in asdict(o).items() if k not in ("token_ids", "text")} for o in run.outcomes]
