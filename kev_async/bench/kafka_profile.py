"""`kev bench kafka --profile`: where a question's time goes between its record landing on the questions
topic and its answer's commit, stage by stage, from the in-process worker's own stamps.

The stamps are log lines the worker writes anyway (`question_taken`, `engine_actor.submitted` and
`answer_taken` at debug level, `published` and `committed` at info), caught by a structlog processor for
the length of the run, plus the answer's own timings (queued, first token, end: counted from when the
worker took the question) and the answer record's timestamp (when the worker's producer sent it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kev_async.bench.load.report import percentile

# structlog is imported where it is used: `kev --help` imports this module and must stay quick.

STAMPED = ("question_taken", "engine_actor.submitted", "answer_taken", "published", "committed")

# (name, what it covers, on the Kafka path only?) in the order a question goes through them.
STAGES = (
    ("fetch", "record on the broker until the worker's fetch returned it", True),
    ("intake", "decode, signature and id checks, into the engine's inbox", True),
    ("tokenize", "inbox wait, chat template and tokenizer (worker thread)", False),
    ("admission", "queued until its first step (batching window, free slot)", False),
    ("prefill", "first step until its first token", False),
    ("decode", "first token until its last", False),
    ("hand-off", "engine thread to the publisher", True),
    ("send", "answer encoded and handed to the producer", True),
    ("ack", "sent until the broker acknowledged it (acks=all)", True),
    ("commit", "acked until its offset was committed", True),
)


@dataclass
class StageLog:
    """Stamps caught from the worker's log lines: per question id, event -> (time.time(), fields)."""

    stamps: dict[str, dict[str, tuple[float, dict]]] = field(default_factory=dict)
    commits: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def __call__(self, _logger, method: str, event: dict) -> dict:
        name = event.get("event")
        if name in STAMPED:
            now = time.time()
            if name == "committed":
                self.commits.append((now, dict(event.get("positions") or {})))
            elif question_id := event.get("question_id"):
                self.stamps.setdefault(question_id, {}).setdefault(name, (now, event))
        if method in ("debug", "info"):  # caught for the profile, not printed
            import structlog

            raise structlog.DropEvent
        return event

    def committed_at(self, partition_key: str, offset: int) -> float | None:
        """When the first commit covering `offset` of that partition went through."""
        return next((at for at, positions in self.commits if positions.get(partition_key, -1) > offset), None)


@contextlib.contextmanager
def caught_stages() -> Iterator[StageLog]:
    """Catch the stamp lines for the length of the block (at debug level), then log as before."""
    import structlog

    stages = StageLog()
    before = structlog.get_config()
    structlog.configure(processors=[stages, *before["processors"]],
                        wrapper_class=structlog.make_filtering_bound_logger(10))
    try:
        yield stages
    finally:
        structlog.configure(processors=before["processors"], wrapper_class=before["wrapper_class"])


@dataclass(frozen=True)
class QuestionTimeline:
    """One question's stage boundaries on the wall clock (time.time())."""

    question_id: str
    bounds: tuple[float, ...]  # published, then the end of each of STAGES

    def durations(self) -> tuple[float, ...]:
        return tuple(max(0.0, b - a) for a, b in zip(self.bounds, self.bounds[1:]))


def timeline(stages: StageLog, question_id: str, published: float, answer, sent: float,
             questions_topic: str) -> QuestionTimeline | None:
    """The question's boundaries, or None where a stamp is missing (answered by another worker)."""
    got = stages.stamps.get(question_id, {})
    if not all(name in got for name in ("question_taken", "engine_actor.submitted", "answer_taken", "published")):
        return None
    taken, fields = got["question_taken"]
    acked, ack_fields = got["published"]
    source = f"{questions_topic}:{ack_fields.get('source_partition')}"
    committed = stages.committed_at(source, ack_fields.get("source_offset", -1))
    if committed is None:
        return None
    ms = lambda value: taken + (value or 0.0) / 1000  # noqa: E731 - the answer's timings count from `taken`
    t = answer.timings
    bounds = (published, fields["fetched_at"], taken, got["engine_actor.submitted"][0], ms(t.queued_ms),
              ms(t.ttft_ms), ms(t.e2e_ms), got["answer_taken"][0], sent, acked, committed)
    return QuestionTimeline(question_id, bounds)


def stage_table(timelines: list[QuestionTimeline]) -> list[str]:
    """Markdown rows: each stage's p50 / p99 / mean in ms, and its share of the mean total."""
    per_stage = list(zip(*(t.durations() for t in timelines)))
    total = sum(sum(column) for column in per_stage) / len(timelines)
    rows = ["| stage | what | Kafka only | p50 ms | p99 ms | mean ms | share |", "|---|---|---|---:|---:|---:|---:|"]
    for (name, what, kafka_only), column in zip(STAGES, per_stage):
        mean = sum(column) / len(column)
        rows.append(f"| {name} | {what} | {'yes' if kafka_only else ''} | {percentile(list(column), 50) * 1000:.1f} | "
                    f"{percentile(list(column), 99) * 1000:.1f} | {mean * 1000:.1f} | {mean / total:.0%} |")
    ends = [t.bounds[-1] - t.bounds[0] for t in timelines]
    rows.append(f"| total | publish to commit | | {percentile(ends, 50) * 1000:.1f} | {percentile(ends, 99) * 1000:.1f} "
                f"| {total * 1000:.1f} | 100% |")
    return rows


def draw_timeline(timelines: list[QuestionTimeline], output: Path | str, title: str) -> Path:
    """Left: one bar per question (in publish order), one colour per stage, seconds since the first
    publish. Right: each stage's p50 and p99 in ms on a log scale, where the short Kafka stages show."""
    import matplotlib  # heavy: only when drawing
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ordered = sorted(timelines, key=lambda t: t.bounds[0])
    origin = ordered[0].bounds[0]
    fig = Figure(figsize=(13, max(3.5, 0.12 * len(ordered) + 1.8)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    bars, spans = fig.subplots(1, 2, width_ratios=(3, 1))
    colours = matplotlib.colormaps["tab10"]
    for row, line in enumerate(ordered):
        for n, (start, length) in enumerate(zip(line.bounds, line.durations())):
            bars.barh(row, length, left=start - origin, height=0.8, color=colours(n % 10), linewidth=0)
    bars.set_ylim(len(ordered), -1)
    bars.set_xlabel("seconds since the first question was published")
    bars.set_ylabel("question (publish order)")
    bars.set_title(title, fontsize=10)
    columns = list(zip(*(t.durations() for t in ordered)))
    names = [name for name, _, _ in STAGES]
    for n, column in enumerate(columns):
        p50, p99 = (max(percentile(list(column), q) * 1000, 0.01) for q in (50, 99))
        spans.barh(n, p99, color=colours(n % 10), alpha=0.35, linewidth=0)
        spans.barh(n, p50, color=colours(n % 10), linewidth=0)
    spans.set_xscale("log")
    spans.set_yticks(range(len(names)), [name + (" *" if kafka_only else "") for name, _, kafka_only in STAGES])
    spans.set_ylim(len(names), -1)
    spans.set_xlabel("ms per question: p50 (full), p99 (light)")
    spans.set_title("per stage (* Kafka path only)", fontsize=10)
    fig.legend(handles=[Patch(color=colours(n % 10), label=name) for n, name in enumerate(names)],
               loc="outside lower center", fontsize=8, ncols=len(names))
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
