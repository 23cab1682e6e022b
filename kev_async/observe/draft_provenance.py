"""`kev audit check`'s speculative-decoding half: every draft re-checked against its own question's tokens.

The engine's records (engine/audit.py) give, for each question that may draft, one keyed digest per row
of the token that row fed. Replayed in order they rebuild each question's own token history, position
by position: the latest row written at a position below the question's current start is a kept token
(a rejected draft's position is written again by the next forward, which starts there). Against that
history, from the log alone:

- a prompt-lookup draft (`method: ngram`) must equal the question's own tokens at its recorded source,
  and the `match` tokens before the source must equal the question's last `match` tokens (the lookup's
  n-gram): a draft copied from anything but the question's own history fails, whatever the drafter's
  code believed;
- a draft-model draft cannot be re-derived without running the model; what is checked is that the draft
  model was fed exactly the question's token count and no block of its cache is listed for two questions
  in one forward (engine/audit.py), and that the K/V it reused (`kept`) sits in blocks no other question
  drafted from since this one last did;
- `verified` (reported on the question's next segment) must name as many drafted tokens as the draft had,
  accept no more than that, and agree with where the next forward starts (1 + accepted positions on);
  a question that ends right after verifying a draft reports it in a `question.verified` record instead,
  checked alike and naming the draft's forward. Once the engine logs `engine.drained` (every question has
  ended), a draft still unreported is a problem; at the log's end one may belong to a question still running.

Digests are 48-bit keyed hashes: equal tokens of one question give equal digests, unequal ones collide
once in 2**48; tokens of two questions cannot be compared (nor need to be).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Draft:
    start: int  # the drafting segment's first position (its last token)
    tokens: int
    method: str
    where: str = ""


@dataclass
class DraftLedger:
    """Per (run, question id): its token digests by position, its last unverified draft; per (run, draft
    model block): the question whose draft last listed it."""

    history: dict[tuple, dict[int, str]] = field(default_factory=dict)
    pending: dict[tuple, _Draft] = field(default_factory=dict)
    model_blocks: dict[tuple[int, int], str] = field(default_factory=dict)
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lookups: int = 0  # prompt-lookup drafts
    proven: int = 0  # of those, shown equal to their question's own tokens
    model_drafts: int = 0  # draft-model drafts: their origin checked by count and blocks only
    unchecked: int = 0  # drafts whose sources lie before the log's first record

    def check(self, run: int, seg: dict, where: str, complete: bool, block_size: int) -> list[str]:
        """Problems of one segment, given the segments before it; `complete`: the run's log begins at
        forward 1, so every position a question computed is in it."""
        key, qid, start = (run, seg["question_id"]), seg["question_id"], seg["positions"][0]
        problems = self._verified(key, seg, start, complete)
        history = self.history.setdefault(key, {})
        for pos, digest in enumerate(seg.get("context_digests") or ()):
            history[pos] = digest
        for pos, digest in enumerate(seg.get("token_digests") or (), start):
            history[pos] = digest
        draft = seg.get("draft")
        if not draft:
            return problems
        self.drafts += 1
        self.drafted_tokens += draft.get("tokens", 0)
        method = draft.get("method")
        if method == "ngram":
            self.lookups += 1
            problems += self._lookup(qid, seg, history, complete)
        elif method == "draft_model":
            self.model_drafts += 1
            problems += self._model(run, qid, draft, block_size)
        self.pending[key] = _Draft(start, draft.get("tokens", 0), method, where)
        return problems

    def ended(self, run: int, record: dict, where: str, complete: bool) -> list[str]:
        """A `question.verified` record: settles the question's last draft, which `where` (the label of the
        record's forward) must name."""
        key, qid = (run, record["question_id"]), record["question_id"]
        last = self.pending.pop(key, None)
        verified = {name: record.get(name) for name in ("drafted", "accepted", "rejected")}
        if last is None:
            if complete:
                return [f"{qid}: reports a verified draft ({verified}) at its end, but has no draft left unreported"]
            return []
        problems = self._outcome(qid, verified, last)
        if record["accepted"] < 0:
            problems.append(f"{qid}: accepted {record['accepted']} draft tokens ({last.where})")
        if where != last.where:
            problems.append(f"{qid}: its question.verified record names {where}, but its last draft was in "
                            f"{last.where}")
        return problems

    def drained(self, run: int, where: str) -> list[str]:
        """`engine.drained`: every question of the run has ended, so every draft must have been reported."""
        left = {key: draft for key, draft in self.pending.items() if key[0] == run}
        for key in left:
            del self.pending[key]
        return [f"{qid}: its draft of {draft.tokens} tokens ({draft.where}) is never reported verified, though "
                f"every question had ended by {where}" for (_, qid), draft in left.items()]

    def summary(self) -> str:
        parts = [f"{self.drafts} ({self.drafted_tokens} tokens, {self.accepted_tokens} accepted as reported)"]
        if self.lookups:
            parts.append(f"{self.proven} of {self.lookups} prompt-lookup drafts shown copied from their own "
                         f"question's tokens" + (f" ({self.unchecked} copied from before the log)" if self.unchecked else ""))
        if self.model_drafts:
            parts.append(f"{self.model_drafts} draft-model drafts fed their own question's token count")
        return "; ".join(parts)

    @property
    def all_proven(self) -> bool:
        return self.proven == self.drafts

    def _verified(self, key: tuple, seg: dict, start: int, complete: bool) -> list[str]:
        qid, verified, last = key[1], seg.get("verified"), self.pending.pop(key, None)
        if last is None:
            if verified is not None and complete:
                return [f"{qid}: reports a verified draft ({verified}) but drafted nothing in its previous forward"]
            return []
        if verified is None:
            return [f"{qid}: its draft of {last.tokens} tokens ({last.where}) is never reported verified"]
        accepted, problems = verified.get("accepted", 0), self._outcome(qid, verified, last)
        if accepted <= last.tokens and start > last.start and start != last.start + 1 + accepted:  # not a restart
            problems.append(f"{qid}: accepted {accepted} draft tokens ({last.where}), but its next forward starts "
                            f"at {start}, not {last.start + 1 + accepted}")
        return problems

    def _outcome(self, qid: str, verified: dict, last: _Draft) -> list[str]:
        """What a report of how `last` fared (a next segment's `verified`, or `question.verified`) must say:
        as many drafted tokens as it had, no more accepted than that."""
        accepted, problems = verified.get("accepted", 0), []
        self.accepted_tokens += max(0, accepted)
        if verified.get("drafted") != last.tokens:
            problems.append(f"{qid}: verified {verified.get('drafted')} drafted tokens, but its draft "
                            f"({last.where}) had {last.tokens}")
        if accepted > last.tokens:
            problems.append(f"{qid}: accepted {accepted} draft tokens of the {last.tokens} drafted ({last.where})")
        return problems

    def _lookup(self, qid: str, seg: dict, history: dict[int, str], complete: bool) -> list[str]:
        draft, known = seg["draft"], seg["positions"][0] + 1
        source, match, tokens = draft.get("source"), draft.get("match"), draft.get("tokens", 0)
        digests = seg.get("token_digests")
        if digests is None:
            return [f"{qid}: ngram draft without token digests: its source cannot be checked"]
        if not isinstance(source, int) or not isinstance(match, int) or match < 1 or source - match < 0:
            return []  # engine.audit.draft_violations reports it
        wanted = list(range(source - match, source + tokens)) + list(range(known - match, known))
        missing = [pos for pos in wanted if pos not in history]
        if missing:
            if complete:
                return [f"{qid}: ngram draft's source position {missing[0]} is none of its own computed tokens "
                        f"in the log"]
            self.unchecked += 1
            return []
        problems = []
        if [history[p] for p in range(source - match, source)] != [history[p] for p in range(known - match, known)]:
            problems.append(f"{qid}: ngram draft's {match} matched tokens before position {source} are not its "
                            f"last {match} tokens")
        copied = [history[p] for p in range(source, source + tokens)]
        for i, (drafted, own) in enumerate(zip(digests[1:], copied)):
            if drafted != own:
                problems.append(f"{qid}: draft token {i} is not its own token at position {source + i}: the draft "
                                f"did not come from this question's tokens")
                break
        if not problems:
            self.proven += 1
        return problems

    def _model(self, run: int, qid: str, draft: dict, block_size: int) -> list[str]:
        """The K/V a draft model reused for `qid` must sit in blocks no other question drafted from since
        `qid` last listed them (a draft the scheduler dropped before the forward is not in the log, so
        reuse without an earlier listing is not itself a fault)."""
        kept, blocks, problems = draft.get("kept", 0), draft.get("blocks") or [], []
        for block in blocks[: -(-kept // block_size)] if kept > 0 else ():
            holder = self.model_blocks.get((run, block))
            if holder not in (qid, None):
                problems.append(f"{qid}: draft model reused K/V in its block {block}, which {holder} drafted from "
                                f"since {qid} last did")
        for block in blocks:
            self.model_blocks[(run, block)] = qid
        return problems
