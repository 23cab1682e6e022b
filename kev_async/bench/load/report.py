"""What `kev bench load` measures per system, from each question's timestamps, and how it prints it.

goodput   = tokens of answers that completed / wall time of the trace (first arrival to last answer)
TTFT      = first token (as the client saw it) - arrival;   e2e = last token - arrival
gap       = time between two pieces of one answer's stream (every streamed answer's gaps pooled): p50, p99
            and the worst; a prompt step that stalls the streams shows as p99 and worst far above p50
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
    gaps: list[float] = field(default_factory=list)  # s between its stream's pieces, where the system streams

    @property
    def completed(self) -> bool:
        return self.error is None and self.finished_s is not None

    @classmethod
    def of_answer(cls, qid: str, arrival_s: float, t0: float, answer, first: float | None, done: float,
                  pieces: list[float] | None = None) -> Outcome:
        """From Kev's AnswerEvent, with the monotonic times its first text (`first`), each streamed piece
        (`pieces`, for its gaps) and its end (`done`) came."""
        return cls(qid, arrival_s, (first or done) - t0, done - t0, answer.usage.completion_tokens,
                   list(answer.token_ids), answer.text, answer.finish_reason,
                   answer.error.code if answer.error else None, gaps_between(pieces or []))


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


def gaps_between(times: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(times, times[1:])]


def gap_stats(run: SystemRun) -> dict:
    """Inter-token gaps over every answer's stream (ms): p50, p99, the worst, and p99 and the worst over p50."""
    gaps = [g for o in run.outcomes if o.completed for g in o.gaps]
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    worst = max(gaps, default=None)
    return {"gap_p50_ms": _ms(p50), "gap_p99_ms": _ms(p99), "gap_max_ms": _ms(worst),
            "gap_p99_over_p50": p99 / p50 if p50 else None, "gap_max_over_p50": worst / p50 if p50 else None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


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
        "identical": identical_count(run, reference), **gap_stats(run), **run.notes,
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summaries: list[dict]) -> str:
    lines = ["| system | done | tokens | wall s | goodput tok/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 "
             "| gap p50 ms | gap p99 ms | worst gap ms | identical to solo |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        same = "-" if s["identical"] is None else f"{s['identical']}/{s['questions']}"
        lines.append(f"| {s['system']} | {s['completed']}/{s['questions']} | {s['tokens']} | {s['wall_s']:.1f} "
                     f"| {s['goodput_tps']:.1f} | {_seconds(s['ttft_p50_s'])} | {_seconds(s['ttft_p99_s'])} "
                     f"| {_seconds(s['e2e_p50_s'])} | {_seconds(s['e2e_p99_s'])} | {_whole(s.get('gap_p50_ms'))} "
                     f"| {_whole(s.get('gap_p99_ms'))} | {_whole(s.get('gap_max_ms'))} | {same} |")
    return "\n".join(lines)


def _whole(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def gap_line(summary: dict) -> str | None:
    """`system`: its streams' gap p99 and worst gap, each over its p50 gap (the stall-free targets' ratios)."""
    if summary.get("gap_p99_over_p50") is None:
        return None
    return (f"{summary['system']}: token gaps p99 {summary['gap_p99_over_p50']:.1f}x p50, worst "
            f"{summary['gap_max_over_p50']:.1f}x p50 ({summary['gap_max_ms']:.0f} ms against "
            f"{summary['gap_p50_ms']:.0f})")


def ratios(summaries: list[dict], base: str, against: str) -> str | None:
    """`base` over `against`: goodput ratio and how many times lower TTFT p50 / e2e p50 / TTFT p99 are
    (below 1: higher)."""
    by_name = {s["system"]: s for s in summaries}
    if base not in by_name or against not in by_name:
        return None
    a, b = by_name[base], by_name[against]
    parts = []
    if b["goodput_tps"]:
        parts.append(f"goodput {a['goodput_tps'] / b['goodput_tps']:.2f}x")
    for key, label in (("ttft_p50_s", "TTFT p50"), ("e2e_p50_s", "e2e p50"), ("ttft_p99_s", "TTFT p99")):
        if a[key] and b[key]:
            parts.append(f"{label} {b[key] / a[key]:.2f}x lower")
    return f"{base} vs {against}: " + ", ".join(parts)


def outcomes_json(run: SystemRun) -> list[dict]:
    return [{k: v for k, v in asdict(o).items() if k not in ("token_ids", "text", "gaps")} for o in run.outcomes]
