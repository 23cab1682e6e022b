"""What a fault drill must show afterwards, read from the answers topic, the group's commits and the
workers' JSON logs (run.py runs the drill).

- exactly one final answer per question: every question answered; redelivery duplicates counted,
  and each duplicate equal to the first (text, token ids, finish reason); no more duplicates than the
  faults explain, each part counted from the logs and reported on its own (`duplicate_allowance`):
  - worker_sigkill: the answers the SIGKILLed worker had published whose offsets the group had not
    yet committed when it died (its other questions were never answered by it);
  - revocations: at each rebalance, of the partitions that moved, the questions the old owner
    answered past the group's commit at the revocation: acked after it (the ack took longer than the
    publisher's wait for acks in flight) or acked before it while commits failed (broker away). A
    graceful stop duplicates nothing, and answers finished after their partition moved are left to
    the new owner;
  - broker_restart: answers sent before the broker's SIGKILL (the record's CreateTime) and acked
    after it: the broker may have written them without answering, and the producer (idempotence is
    off: Tansu refuses it) sends them again;
- commit after ack: every "committed" line a worker logged (the committer, after the broker
  accepted the commit) covers only offsets whose question some worker had logged "published"
  (after the broker acked the answer) no later; the group's final commit covers every question;
- no KV leak: each worker that stopped gracefully logged engine_actor.stopped with all blocks free;
- with exactly_once delivery (answers read read_committed): no duplicate at all, whatever the faults;
  the allowance is still reported, as what at_least_once would have let through.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from datetime import datetime

import msgspec


# `killed_at` is read just before the broker's SIGKILL is sent (from another thread): answers created
# this much later may still have been in flight when it landed.
_KILL_SLACK_MS = 500


class DrillResult(msgspec.Struct, kw_only=True):
    ok: bool = False
    delivery: str = "at_least_once"  # exactly_once: answers read read_committed, no duplicate allowed
    questions: int = 0
    answered: int = 0
    missing: list[str] = []
    answer_records: int = 0
    duplicates: int = 0  # answer records beyond the first per question
    # The most duplicates the faults explain: the sum of duplicate_allowance, whose parts (worker_sigkill,
    # revocations, broker_restart) are questions counted once per part (see the module's docstring).
    duplicate_bound: int = 0
    duplicate_allowance: dict[str, int] = {}
    duplicates_differing: list[str] = []
    error_answers: int = 0
    prompt_tokens: int = 0  # over first answers
    cached_prompt_tokens: int = 0  # of those, read from a worker's prefix cache (isolation.level shared)
    by_worker: dict[str, int] = {}  # first answers per worker (audit.worker)
    commits_checked: int = 0
    commits_before_ack: list[str] = []
    final_commit_covers_all: bool = False
    kv_pools: dict[str, str] = {}  # worker -> "free 512/512", or why it was not checked
    kv_leaks: list[str] = []
    seconds: float = 0.0  # first question published to last answer
    answers_per_s: float = 0.0
    workers: dict[str, str] = {}  # worker -> fate and exit code
    broker_restart: str = ""
    timeline: list[str] = []


def log_events(text: str, event: str) -> list[dict]:
    """The JSON log lines of `text` whose event is `event`."""
    found = []
    for line in text.splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                found.append(record)
    return found


def check_run(sent: dict[str, tuple[int, int]], answers: list, logs: dict[str, tuple[str, int | None, str]],
              committed: dict[int, int | None], questions_topic: str,
              killed: dict[str, tuple[str, datetime]] | None = None,
              broker_killed_at: datetime | None = None,
              layout: dict[int, dict[int, str]] | None = None, exactly_once: bool = False) -> DrillResult:
    """`answers`: (AnswerEvent, record) in arrival order; `logs`: worker -> (fate, exit code, log text);
    `killed`: SIGKILLed worker -> (its audit name, as answers carry it; when it was killed, UTC);
    `broker_killed_at`: when the broker was SIGKILLed (UTC), if it was; `layout`: partition -> offset ->
    question id of every record on the questions topic as read back (default: the offsets in `sent`);
    `exactly_once`: the workers ran exactly_once delivery and `answers` were read read_committed."""
    result = DrillResult(questions=len(sent), answer_records=len(answers),
                         delivery="exactly_once" if exactly_once else "at_least_once")
    _check_answers(result, sent, answers)
    _check_commits(result, sent, logs, committed, questions_topic, layout)
    result.duplicate_allowance = {
        "worker_sigkill": _killed_worker_allowance(sent, answers, logs, questions_topic, killed or {}),
        "revocations": _revocation_allowance(sent, logs, questions_topic),
        "broker_restart": _broker_restart_allowance(sent, answers, logs, broker_killed_at),
    }
    result.duplicate_bound = sum(result.duplicate_allowance.values())
    _check_pools(result, logs)
    result.workers = {name: f"{fate}, exit {code}" for name, (fate, code, _) in logs.items()}
    result.ok = (not result.missing and not result.duplicates_differing and not result.commits_before_ack
                 and result.final_commit_covers_all and not result.kv_leaks and result.commits_checked > 0
                 and result.duplicates <= (0 if exactly_once else result.duplicate_bound))
    return result


def _check_answers(result: DrillResult, sent: dict, answers: list) -> None:
    first = {}
    for answer, _record in answers:
        if answer.question_id not in first:
            first[answer.question_id] = answer
        elif _content(answer) != _content(first[answer.question_id]):
            result.duplicates_differing.append(answer.question_id)
    counts = Counter(answer.question_id for answer, _ in answers)
    result.answered = len(set(first) & set(sent))
    result.missing = sorted(set(sent) - set(first))
    result.duplicates = sum(n - 1 for n in counts.values())
    result.error_answers = sum(a.error is not None for a in first.values())
    result.prompt_tokens = sum(a.usage.prompt_tokens for a in first.values())
    result.cached_prompt_tokens = sum(getattr(a.usage, "cached_prompt_tokens", 0) for a in first.values())
    result.by_worker = dict(Counter(a.audit.worker for a in first.values()))
    if answers:
        timestamps = [record.timestamp for _, record in answers]
        result.seconds = max(0.001, (max(timestamps) - _first_publish_ms(answers)) / 1000)
        result.answers_per_s = round(result.answered / result.seconds, 2)


def _first_publish_ms(answers: list) -> int:
    # An answer's arrival stamp minus its end-to-end time is when its question reached a worker.
    return min(record.timestamp - answer.timings.e2e_ms for answer, record in answers)


def _content(answer) -> tuple:
    return answer.text, tuple(answer.token_ids), answer.finish_reason, answer.error


def _published(text: str) -> list[dict]:
    """A worker's "published" lines for answers (error answers included), logged after the broker's ack."""
    return [line for line in log_events(text, "published")
            if line.get("question_id") is not None and line.get("kind") in ("answers", "error_answers")]


def _commits(logs: dict, topic: str) -> list[tuple[datetime, int, int, str]]:
    """(time, partition, position, worker) of every "committed" line, logged after the broker accepted it."""
    commits = []
    for name, (_fate, _code, text) in logs.items():
        for line in log_events(text, "committed"):
            for key, position in line["positions"].items():
                name_, _, partition = key.rpartition(":")
                if name_ == topic:
                    commits.append((_time(line), int(partition), position, name))
    return commits


def _commit_positions(commits: list, until: datetime) -> dict[int, int]:
    """partition -> the group's commit position as of `until` (every worker's "committed" lines)."""
    position: dict[int, int] = {}
    for when, partition, committed_to, _worker in commits:
        if when <= until:
            position[partition] = max(position.get(partition, 0), committed_to)
    return position


def _killed_worker_allowance(sent: dict, answers: list, logs: dict, topic: str, killed: dict) -> int:
    commits = _commits(logs, topic)
    bound = 0
    for name, (audit_name, at) in killed.items():
        position = _commit_positions(commits, at)
        # Its answers on the topic also count those acked too late for its "published" line.
        theirs = {line["question_id"] for line in _published(logs.get(name, ("", None, ""))[2])}
        theirs |= {answer.question_id for answer, _ in answers if answer.audit.worker == audit_name}
        bound += sum(1 for qid in theirs if qid in sent and sent[qid][1] >= position.get(sent[qid][0], 0))
    return bound


def _revocation_allowance(sent: dict, logs: dict, topic: str) -> int:
    """Questions of moved partitions that their old owner answered past the commit at the revocation."""
    commits = _commits(logs, topic)
    at_risk: set[str] = set()
    for _name, (_fate, _code, text) in logs.items():
        published = [(_time(line), line["question_id"]) for line in _published(text)]
        for revoked_at, moved, until in _moves(text, topic):
            position = _commit_positions(commits, revoked_at)
            for at, qid in published:
                where = sent.get(qid)
                if at < until and where is not None and where[0] in moved and where[1] >= position.get(where[0], 0):
                    at_risk.add(qid)
    return len(at_risk)


def _moves(text: str, topic: str) -> list[tuple[datetime, set[int], datetime]]:
    """Per revocation in one worker's log: (when, the partitions it lost for good in that rebalance,
    when its next revocation began: acks before then of those partitions' questions are its old ones)."""
    def partitions(line: dict) -> set[int]:
        return {int(p.rpartition(":")[2]) for p in line["partitions"] if p.rpartition(":")[0] == topic}

    events = sorted([(_time(line), "revoked", partitions(line)) for line in log_events(text, "partitions_revoked")]
                    + [(_time(line), "assigned", partitions(line)) for line in log_events(text, "partitions_assigned")],
                    key=lambda event: event[0])
    moves = []
    for i, (at, kind, lost) in enumerate(events):
        if kind != "revoked":
            continue
        kept = next((parts for _, k, parts in events[i + 1:] if k == "assigned"), set())
        until = next((when for when, k, _ in events[i + 1:] if k == "revoked"), datetime.max.replace(tzinfo=at.tzinfo))
        moves.append((at, lost - kept, until))
    return moves


def _broker_restart_allowance(sent: dict, answers: list, logs: dict, killed_at: datetime | None) -> int:
    """Questions with an answer record created before the broker's SIGKILL but acked only after it."""
    if killed_at is None:
        return 0
    acked: dict[str, datetime] = {}  # question_id -> earliest "published" line over every worker
    for _name, (_fate, _code, text) in logs.items():
        for line in _published(text):
            at = _time(line)
            acked[line["question_id"]] = min(at, acked.get(line["question_id"], at))
    kill_ms = killed_at.timestamp() * 1000 + _KILL_SLACK_MS
    sent_before = {answer.question_id for answer, record in answers if record.timestamp <= kill_ms}
    return sum(1 for qid in sent_before if qid in sent and (qid not in acked or acked[qid] >= killed_at))


def _check_commits(result: DrillResult, sent: dict, logs: dict, committed: dict, topic: str,
                   layout: dict[int, dict[int, str]] | None = None) -> None:
    acked = {}  # question_id -> earliest "published" time over every worker
    for _name, (_fate, _code, text) in logs.items():
        for line in _published(text):
            at = _time(line)
            acked[line["question_id"]] = min(at, acked.get(line["question_id"], at))
    commits = _commits(logs, topic)
    by_offset = defaultdict(dict)  # partition -> offset -> question_id
    for qid, (partition, offset) in sent.items():
        by_offset[partition][offset] = qid
    read_past = {}  # partition -> the last offset read back: offsets below it that hold no record are gaps
    for partition, records in (layout or {}).items():  # a copy written twice answers to its question's ack
        for offset, qid in records.items():
            by_offset[partition].setdefault(offset, qid)
        read_past[partition] = max(records, default=-1)
    for at, partition, position, worker in commits:
        result.commits_checked += 1
        for offset in range(position):
            qid = by_offset[partition].get(offset)
            if qid is None and offset < read_past.get(partition, -1):
                continue  # no record there (a control record's offset): nothing to answer
            if qid is None or acked.get(qid) is None or acked[qid] > at:
                result.commits_before_ack.append(f"{worker} committed {topic}:{partition}@{position} at {at} "
                                                 f"before offset {offset} ({qid}) was acked ({acked.get(qid)})")
                break
    ends = defaultdict(int)
    for partition, offset in sent.values():
        ends[partition] = max(ends[partition], offset + 1)
    result.final_commit_covers_all = all((committed.get(p) or 0) >= end for p, end in ends.items())


def _check_pools(result: DrillResult, logs: dict) -> None:
    for name, (fate, code, text) in logs.items():
        stopped = log_events(text, "engine_actor.stopped")
        if fate == "hung":
            result.kv_pools[name] = "not checked: did not exit after SIGTERM (SIGKILLed)"
            result.kv_leaks.append(name)
        elif fate == "killed":
            result.kv_pools[name] = "not checked: SIGKILLed (its pool died with the process)"
        elif not stopped:
            result.kv_pools[name] = f"no engine_actor.stopped line (exit {code})"
            result.kv_leaks.append(name)
        else:
            free, total = stopped[-1].get("kv_blocks_free"), stopped[-1].get("kv_blocks_total")
            result.kv_pools[name] = f"free {free}/{total}"
            if free is None or free != total:
                result.kv_leaks.append(name)


def _time(line: dict) -> datetime:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00"))
