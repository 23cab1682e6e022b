"""The isolation audit: what each forward packed, and a cheap check that no two questions touched."""

from __future__ import annotations

from engine.attention import Segment


def forward_summary(step: int, question_ids: list[str], segments: list[Segment], block_size: int,
                    routing: bool = False) -> dict:
    """One `forward.mask` record: per question its rows, positions, kv length and blocks."""
    record = {
        "forward": step,
        "tokens": sum(s.q_len for s in segments),
        "block_size": block_size,
        "segments": [
            {
                "question_id": qid,
                "rows": [seg.q_start, seg.q_start + seg.q_len],
                "positions": [seg.cached, seg.kv_len],
                "kv_len": seg.kv_len,
                "blocks": list(seg.block_ids),
            }
            for qid, seg in zip(question_ids, segments)
        ],
    }
    if routing:
        record["routing"] = routing_table(record)
    return record


def routing_table(record: dict) -> list[list]:
    """Token-level table: row -> [row, question, position, block, offset in block]."""
    size = record["block_size"]
    table = []
    for seg in record["segments"]:
        for row, pos in zip(range(*seg["rows"]), range(*seg["positions"])):
            table.append([row, seg["question_id"], pos, seg["blocks"][pos // size], pos % size])
    return table


def violations(record: dict) -> list[str]:
    """Every broken isolation invariant in one forward record; empty when all hold."""
    problems = []
    next_row, owners = 0, {}
    for seg in record["segments"]:
        qid, (row_start, row_end), (pos_start, pos_end) = seg["question_id"], seg["rows"], seg["positions"]
        if row_start != next_row:
            problems.append(f"{qid}: rows start at {row_start}, expected {next_row} (segments overlap or gap)")
        next_row = row_end
        if pos_end - pos_start != row_end - row_start:
            problems.append(f"{qid}: {row_end - row_start} rows but positions {pos_start}..{pos_end}")
        if seg["kv_len"] != pos_end:
            problems.append(f"{qid}: kv_len {seg['kv_len']} != last position + 1 ({pos_end})")
        if len(seg["blocks"]) * record["block_size"] < seg["kv_len"]:
            problems.append(f"{qid}: {len(seg['blocks'])} blocks cannot hold {seg['kv_len']} tokens")
        for block in seg["blocks"]:
            if owners.setdefault(block, qid) != qid:
                problems.append(f"block {block} is held by both {owners[block]} and {qid}")
    if next_row != record["tokens"]:
        problems.append(f"segments cover {next_row} rows of {record['tokens']}")
    return problems
