"""The audit checker: read and re-check the per-forward isolation records the engine logs.

With `EngineOptions(audit=True)` every forward logs one structlog record, `forward.mask` (info) or
`forward.isolation_violation` (error), holding each question's rows, positions, kv length and
blocks (engine/audit.py). `kev audit check LOG` re-verifies every record and the continuity between
them; `kev audit render LOG --forward N -o mask.png` draws one forward's attention visibility.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kev_async.observe.draft_provenance import DraftLedger

AUDIT_EVENTS = ("forward.mask", "forward.isolation_violation")
# Speculative decoding: how a question's last draft fared when it ended, and where every question had ended.
ENDING_EVENTS = ("question.verified", "engine.drained")


@dataclass
class ForwardRecord:
    """One audit record, with where it came from."""

    run: int  # 1-based: a new run starts whenever the forward counter does not go up (a new engine)
    line: int  # 1-based line in the log file
    data: dict

    @property
    def forward(self) -> int:
        return self.data["forward"]

    @property
    def label(self) -> str:
        return f"forward {self.forward}" if self.run == 1 else f"run {self.run} forward {self.forward}"


@dataclass
class AuditLog:
    records: list[ForwardRecord] = field(default_factory=list)
    lines: int = 0
    not_json: int = 0
    other_events: int = 0
    malformed: list[str] = field(default_factory=list)  # audit records missing required fields
    endings: list[ForwardRecord] = field(default_factory=list)  # ENDING_EVENTS, in the run logged before them

    @property
    def runs(self) -> int:
        return self.records[-1].run if self.records else 0

    def find(self, forward: int, run: int | None = None) -> list[ForwardRecord]:
        return [r for r in self.records if r.forward == forward and (run is None or r.run == run)]


class AuditLogError(Exception):
    """The log cannot be read, or holds no audit records."""


_REQUIRED = ("forward", "tokens", "block_size", "segments")
_SEGMENT_REQUIRED = ("question_id", "rows", "positions", "kv_len", "blocks")


def read_audit_log(path: Path | str) -> AuditLog:
    """Every `forward.mask` / `forward.isolation_violation` record of a structlog JSON-lines file.

    Other lines (console output, other events, broken JSON) are counted and skipped. A run boundary is
    placed where the forward counter fails to increase: each EngineCore counts from 1.
    """
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise AuditLogError(f"{path}: cannot read: {exc.strerror or exc}") from None
    log = AuditLog()
    run, last_forward = 0, None
    for number, line in enumerate(text.splitlines(), 1):
        log.lines += 1
        line = line.strip()
        if not line.startswith("{"):
            log.not_json += bool(line)
            continue
        try:
            data = json.loads(line)
        except ValueError:
            log.not_json += 1
            continue
        if not isinstance(data, dict) or data.get("event") not in AUDIT_EVENTS + ENDING_EVENTS:
            log.other_events += 1
            continue
        problem = _shape_problem(data) if data["event"] in AUDIT_EVENTS else _ending_shape_problem(data)
        if problem:
            log.malformed.append(f"line {number}: {problem}")
            continue
        if data["event"] in ENDING_EVENTS:  # names a forward logged before it: no new run
            log.endings.append(ForwardRecord(run, number, data))
            continue
        if last_forward is None or data["forward"] <= last_forward:
            run += 1
        last_forward = data["forward"]
        log.records.append(ForwardRecord(run, number, data))
    return log


def _shape_problem(data: dict) -> str | None:
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        return f"{data.get('event')} record lacks {', '.join(missing)}"
    if not isinstance(data["forward"], int) or not isinstance(data["segments"], list):
        return "forward must be an int and segments a list"
    for i, seg in enumerate(data["segments"]):
        if not isinstance(seg, dict):
            return f"segment {i} is not an object"
        missing = [key for key in _SEGMENT_REQUIRED if key not in seg]
        if missing:
            return f"segment {i} lacks {', '.join(missing)}"
        if len(seg["rows"]) != 2 or len(seg["positions"]) != 2:
            return f"segment {i}: rows and positions must be [start, end)"
    return None


def _ending_shape_problem(data: dict) -> str | None:
    wanted = ("forward",) if data["event"] == "engine.drained" else ("question_id", "forward", "drafted", "accepted")
    wrong = [key for key in wanted if not isinstance(data.get(key), str if key == "question_id" else int)]
    return f"{data['event']} record lacks {', '.join(wrong)} (or not as a string / int)" if wrong else None


# -- check -----------------------------------------------------------------------------------------

@dataclass
class CheckReport:
    forwards: int = 0
    runs: int = 0
    questions: int = 0
    tokens: int = 0
    max_batch: int = 0
    max_batch_forward: str = ""
    restarts: int = 0  # questions that began again at position 0 (preempted and recomputed)
    drafts: DraftLedger = field(default_factory=DraftLedger)  # speculative decoding's drafts, re-checked
    problems: list[tuple[str, str]] = field(default_factory=list)  # (where, what)

    @property
    def clean(self) -> bool:
        return not self.problems


def check_log(log: AuditLog) -> CheckReport:
    """Re-verify every record (engine.audit.violations), then what that per-record check leaves out:
    a block held by two questions in one forward (read-only shared-prefix blocks excepted), a question
    in two segments, and each question's positions continuing from where its previous forward left
    them (or restarting at 0 after a preemption); with speculative decoding, that every draft came from
    its own question's tokens and was reported verified, by the question's next segment or by its
    `question.verified` record (observe/draft_provenance.py)."""
    from engine.audit import violations  # imports torch: only when checking, not on every `kev` start

    report = CheckReport(forwards=len(log.records), runs=log.runs)
    report.problems += [("log", f"malformed audit record at {m}") for m in log.malformed]
    questions: set[tuple[int, str]] = set()
    last_end: dict[tuple[int, str], tuple[int, str, int]] = {}  # (run, qid) -> (kv_len, its forward, draft rows)
    from_start = {r.run for r in log.records if r.forward == 1}  # runs whose log begins at forward 1
    for rec in sorted(log.records + log.endings, key=lambda r: r.line):
        if rec.data["event"] in ENDING_EVENTS:
            report.problems += _ending_problems(report.drafts, rec, rec.run in from_start)
            continue
        data, where = rec.data, rec.label
        found: list[str] = []
        if data.get("event") == "forward.isolation_violation":
            found += [f"engine flagged: {p}" for p in data.get("problems") or ["(no problems listed)"]]
        found += violations(data)
        segments = data["segments"]
        report.tokens += data["tokens"]
        if len(segments) > report.max_batch:
            report.max_batch, report.max_batch_forward = len(segments), where
        seen_here: set[str] = set()
        owners: dict[int, str] = {}  # block -> the question holding it in this forward
        for seg in segments:
            qid = seg["question_id"]
            key = (rec.run, qid)
            questions.add(key)
            if qid in seen_here:
                found.append(f"{qid}: appears in more than one segment")
            seen_here.add(qid)
            shared = seg.get("shared_prefix_len") or 0  # read-only prefix blocks may be shared
            for i, block in enumerate(seg["blocks"]):
                if (i + 1) * data["block_size"] <= shared:
                    continue
                holder = owners.setdefault(block, qid)
                if holder != qid:
                    found.append(f"block {block} is held by both {holder} and {qid}")  # engine's wording
            start = seg["positions"][0]
            if key in last_end:
                previous, prev_where, drafted = last_end[key]
                if previous - drafted <= start < previous:  # its rejected drafts' positions, computed again
                    pass
                elif start in (0, shared) and start < previous:  # preempted: recomputed past its cached prefix
                    report.restarts += 1
                elif start > previous:
                    found.append(f"{qid}: positions start at {start}, but its previous forward ({prev_where}) "
                                 f"ended at kv_len {previous} (position gap)")
                elif start < previous:
                    found.append(f"{qid}: positions start at {start}, but its previous forward ({prev_where}) "
                                 f"already reached kv_len {previous} (positions repeat)")
            elif start not in (0, shared) and rec.run in from_start:
                found.append(f"{qid}: first seen at position {start}, not 0 (its earlier positions were "
                             f"never computed)")
            last_end[key] = (seg["kv_len"], where, seg.get("draft_rows") or 0)
            found += report.drafts.check(rec.run, seg, where, rec.run in from_start, data["block_size"])
        for problem in dict.fromkeys(found):  # keep order, drop duplicates
            report.problems.append((where, problem))
    report.questions = len(questions)
    return report


def _ending_problems(drafts: DraftLedger, rec: ForwardRecord, complete: bool) -> list[tuple[str, str]]:
    if rec.data["event"] == "engine.drained":
        where = f"engine.drained after {rec.label}"
        return [(where, problem) for problem in drafts.drained(rec.run, rec.label)]
    where = f"question.verified of {rec.label}"
    return [(where, problem) for problem in drafts.ended(rec.run, rec.data, rec.label, complete)]


def format_report(path: str, log: AuditLog, report: CheckReport) -> str:
    lines = [f"audit log {path}: {report.forwards} forwards"
             + (f" in {report.runs} runs" if report.runs > 1 else ""),
             f"  questions:  {report.questions}",
             f"  tokens:     {report.tokens} (rows computed over all forwards)",
             f"  max batch:  {report.max_batch} questions ({report.max_batch_forward})",
             f"  restarts:   {report.restarts} (questions recomputed from position 0 after preemption)"]
    drafts = report.drafts
    if drafts.drafts:
        lines.append(f"  drafts:     {drafts.summary()}")
    skipped = log.not_json + log.other_events
    if skipped:
        lines.append(f"  skipped:    {skipped} lines ({log.not_json} not JSON, {log.other_events} other events)")
    if report.clean:
        lines.append("OK: every forward keeps its questions isolated"
                     + (", and every draft came from its own question" if drafts.drafts and drafts.all_proven
                        else ", and every draft's recorded origin is its own question" if drafts.drafts else ""))
    else:
        lines.append(f"VIOLATIONS: {len(report.problems)}")
        lines += [f"  {where}: {what}" for where, what in report.problems]
    return "\n".join(lines)
