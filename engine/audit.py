"""The isolation audit: what each forward packed, and a cheap check that no two questions touched.

With speculative decoding on, a question's segments also carry where its drafts came from (`draft`),
how its last one fared (`verified`), and one keyed digest per row of the token that row fed
(`token_digests`), so `kev audit check` can re-derive each question's own token history from the log
and check every prompt-lookup draft against it (docs/speculative.md, "What the audit proves"). A
question that ends right after verifying a draft has no next segment: `question.verified` (DraftEndings)
says how that draft fared, and `engine.drained` marks where every question so far had ended.
"""

from __future__ import annotations

import hashlib
import os

from engine.kernels.attention import Segment

CHAIN_HEX = 16  # hex digits of a block hash kept in a record: 64 bits, plenty to tell prefixes apart
DIGEST_BYTES = 6  # a token digest: 48 bits, so two different tokens look alike once in 2**48 comparisons
# Token digests are keyed per question from a secret that never leaves the process: the log can be
# checked for equalities within one question without showing which tokens they are.
_SECRET = os.urandom(16)


def per_question(owners: list, segments: list[Segment]) -> tuple[list, list[Segment], list[DraftNotes]]:
    """The forward's segments one per chunk: a drafting chunk's single-row verify segments (the runner
    gives each row its own, engine/model/runner.py) become one, as the question's rows are one run.
    Returns (chunks, segments, what each adds about speculative decoding)."""
    chunks: list = []
    merged: list[Segment] = []
    for chunk, seg in zip(owners, segments):
        if chunks and chunks[-1] is chunk:
            last = merged[-1]
            merged[-1] = Segment(last.q_start, last.q_len + seg.q_len, seg.kv_len, last.block_ids, last.generated)
        else:
            chunks.append(chunk)
            merged.append(seg)
    return chunks, merged, [DraftNotes(chunk) for chunk in chunks]


class DraftNotes:
    """What one chunk's segment records about speculative decoding (nothing when its question cannot draft)."""

    def __init__(self, chunk) -> None:
        self.chunk = chunk

    def fields(self) -> dict:
        chunk, seq = self.chunk, self.chunk.seq
        out: dict = {}
        if chunk.draft:
            out["draft_rows"] = len(chunk.draft)
            out["draft"] = {**(seq.draft_origin or {"method": "unknown"}), "tokens": len(chunk.draft)}
        if seq.verified is not None:
            drafted, accepted = seq.verified
            out["verified"] = {"drafted": drafted, "accepted": accepted, "rejected": drafted - accepted}
        if seq.speculative:  # its rows' tokens are the history its later drafts must be copied from
            key = question_key(seq.question_id)
            out["token_digests"] = token_digests(key, chunk.token_ids)
            if 0 < chunk.start == seq.admitted_from:  # positions read from the prefix cache, never rows of its own
                out["context_digests"] = token_digests(key, seq.token_ids[: chunk.start])
        return out


class DraftEndings:
    """The `question.verified` record of a question that ends after a forward in which it verified a draft:
    no later segment of it will say how that draft fared."""

    def __init__(self) -> None:
        # question id -> (the forward of its latest draft, its kept draft tokens before that forward)
        self._latest: dict[str, tuple[int, int]] = {}

    def drafted(self, forward: int, chunks: list) -> None:
        """Before the forward's verification is recorded: which of its questions verify a draft in it."""
        for chunk in chunks:
            if chunk.draft:
                self._latest[chunk.seq.question_id] = (forward, chunk.seq.accepted_draft_tokens)

    def ended(self, seq) -> dict | None:
        """The record for a question that just ended; None unless its latest forward verified a draft.

        `accepted` counts the draft tokens the answer kept: a question that ends inside its draft (a stop
        token, max_new_tokens) keeps fewer than the model agreed with, and its usage counts those."""
        latest = self._latest.pop(seq.question_id, None)
        if seq.verified is None or latest is None:
            return None
        forward, kept_before = latest
        drafted, kept = seq.verified[0], seq.accepted_draft_tokens - kept_before
        return {"question_id": seq.question_id, "forward": forward, "drafted": drafted, "accepted": kept,
                "rejected": drafted - kept, "finish_reason": seq.status.finish_reason}


def question_key(question_id: str) -> bytes:
    return hashlib.blake2b(question_id.encode(), key=_SECRET, digest_size=16).digest()


def token_digests(key: bytes, tokens) -> list[str]:
    """One keyed digest per token: equal tokens of one question give equal digests, nothing more is shown."""
    base = hashlib.blake2b(key=key, digest_size=DIGEST_BYTES)
    out = []
    for token in tokens:
        h = base.copy()
        h.update(int(token).to_bytes(4, "little"))
        out.append(h.hexdigest())
    return out


def forward_summary(step: int, question_ids: list[str], segments: list[Segment], block_size: int,
                    routing: bool = False, prefixes: list[list[bytes]] | None = None,
                    drafts: list | None = None) -> dict:
    """One `forward.mask` record: per question its rows, positions, kv length and blocks.

    `prefixes[i]`: the hash chain of segment i's leading cached (read-only, shareable) blocks; a
    segment with one gets `shared_prefix_len` (tokens) and `prefix_chain` (short hashes).
    `drafts[i]`: segment i's DraftNotes (or its number of draft rows): a segment with drafts gets
    `draft_rows` (its next forward may start up to that many positions before this one's kv_len:
    rejected drafts) and `draft` (method, tokens, origin); see DraftNotes for the rest.
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
    for seg, notes in zip(record["segments"], drafts or ()):
        if isinstance(notes, DraftNotes):
            seg.update(notes.fields())
        elif notes:
            seg["draft_rows"] = notes
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
    return problems + draft_violations(record)


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


def draft_violations(record: dict) -> list[str]:
    """What one record alone shows wrong about drafts: a draft whose origin is missing or impossible (a
    lookup source past the question's own tokens, a draft model fed other than all of them), a draft
    model's cache block held for two questions, more tokens accepted than drafted. Whether each lookup
    draft equals the question's own tokens at its source needs its earlier records: kev audit check."""
    problems: list[str] = []
    holders: dict[int, str] = {}  # draft model cache block -> question drafting from it in this forward
    for seg in record["segments"]:
        qid, rows = seg["question_id"], seg["rows"][1] - seg["rows"][0]
        digests = seg.get("token_digests")
        if digests is not None and len(digests) != rows:
            problems.append(f"{qid}: {len(digests)} token digests for {rows} rows")
        verified = seg.get("verified")
        if verified is not None and not 0 <= verified["accepted"] <= verified["drafted"]:
            problems.append(f"{qid}: {verified['accepted']} draft tokens accepted of {verified['drafted']} drafted")
        if "draft" in seg:
            problems += _origin_problems(qid, seg, rows, record["block_size"], holders)
    return problems


def _origin_problems(qid: str, seg: dict, rows: int, block_size: int, holders: dict[int, str]) -> list[str]:
    draft, known = seg["draft"], seg["positions"][0] + 1  # its tokens when it drafted: up to its last one
    method, tokens = draft.get("method"), draft.get("tokens", 0)
    problems = []
    if tokens != seg.get("draft_rows") or rows != tokens + 1:
        problems.append(f"{qid}: {tokens} draft tokens in {rows} rows (draft_rows {seg.get('draft_rows')})")
    if method == "ngram":
        source, match = draft.get("source"), draft.get("match")
        if not isinstance(source, int) or not isinstance(match, int) or match < 1:
            problems.append(f"{qid}: ngram draft without its source and match length")
        elif source - match < 0 or source + tokens > known:
            problems.append(f"{qid}: ngram draft copied from positions {source}..{source + tokens} after a "
                            f"{match}-token match, outside its own {known} tokens")
    elif method == "draft_model":
        context, kept, blocks = draft.get("context"), draft.get("kept", 0), draft.get("blocks") or []
        if context != known:
            problems.append(f"{qid}: draft model fed {context} tokens, but the question had {known}")
        elif not 0 <= kept <= context:
            problems.append(f"{qid}: draft model kept {kept} of {context} tokens")
        if len(blocks) * block_size < (context or 0) + tokens - 1:
            problems.append(f"{qid}: draft model's {len(blocks)} blocks cannot hold {context} + {tokens - 1} tokens")
        for block in blocks:
            if holders.setdefault(block, qid) != qid:
                problems.append(f"draft model block {block} is held for both {holders[block]} and {qid}")
    else:
        problems.append(f"{qid}: drafter {method!r} records no origin for its draft")
    return problems
