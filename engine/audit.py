"""The isolation audit: what each forward packed, and a cheap check that no two questions touched."""

from __future__ import annotations

from engine.kernels.attention import Segment

CHAIN_HEX = 16  # hex digits of a block hash kept in a record: 64 bits, plenty to tell prefixes apart


def per_question(owners: list, segments: list[Segment]) -> tuple[list, list[Segment], list[int]]:
    """The forward's segments one per chunk: a drafting chunk's single-row verify segments (the runner
    gives each row its own, engine/model/runner.py) become one, as the question's rows are one run.
    Returns (chunks, segments, draft rows of each)."""
    chunks: list = []
    merged: list[Segment] = []
    for chunk, seg in zip(owners, segments):
        if chunks and chunks[-1] is chunk:
            last = merged[-1]
            merged[-1] = Segment(last.q_start, last.q_len + seg.q_len, seg.kv_len, last.block_ids, last.generated)
        else:
            chunks.append(chunk)
            merged.append(seg)
    return chunks, merged, [len(chunk.draft) for chunk in chunks]


def forward_summary(step: int, question_ids: list[str], segments: list[Segment], block_size: int,
                    routing: bool = False, prefixes: list[list[bytes]] | None = None,
                    drafts: list[int] | None = None) -> dict:
    """One `forward.mask` record: per question its rows, positions, kv length and blocks.

    `prefixes[i]`: the hash chain of segment i's leading cached (read-only, shareable) blocks; a
    segment with one gets `shared_prefix_len` (tokens) and `prefix_chain` (short hashes).
    `drafts[i]`: speculative draft rows at the end of segment i; a segment with any gets `draft_rows`
    (its next forward may start up to that many positions before this one's kv_len: rejected drafts).
    """
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
    for seg, rows in zip(record["segments"], drafts or ()):
        if rows:
            seg["draft_rows"] = rows
    for seg, chain in zip(record["segments"], prefixes or ()):
        if chain:
            seg["shared_prefix_len"] = len(chain) * block_size
            seg["prefix_chain"] = [h.hex()[:CHAIN_HEX] for h in chain]
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
    """Every broken isolation invariant in one forward record; empty when all hold.

    A block may appear in two segments only as a shared prefix block: at the same index of both,
    under the same chain hash (same salt -- tenant, adapter, model -- and the same tokens up to its
    end), and below both segments' writes.
    """
    problems = []
    next_row, owners, shared = 0, {}, {}
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
        problems += _block_problems(seg, record["block_size"], owners, shared)
    if next_row != record["tokens"]:
        problems.append(f"segments cover {next_row} rows of {record['tokens']}")
    return problems


def _block_problems(seg: dict, block_size: int, owners: dict, shared: dict) -> list[str]:
    """`owners`: private block -> question; `shared`: shared block -> (index, chain hash, first reader)."""
    qid, problems = seg["question_id"], []
    chain = seg.get("prefix_chain") or []
    if len(chain) * block_size > seg["positions"][0]:
        problems.append(f"{qid}: writes position {seg['positions'][0]} inside its read-only shared prefix")
    for i, block in enumerate(seg["blocks"]):
        if i < len(chain):
            index, digest, reader = shared.setdefault(block, (i, chain[i], qid))
            if (index, digest) != (i, chain[i]):
                problems.append(f"block {block} is read by {reader} and {qid} under different prefixes")
            if block in owners:
                problems.append(f"block {block} is held by both {owners[block]} and {qid}")
        elif owners.setdefault(block, qid) != qid or block in shared:
            other = owners[block] if owners[block] != qid else shared[block][2]
            problems.append(f"block {block} is held by both {other} and {qid}")
    return problems
