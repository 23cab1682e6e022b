"""Per-token logprobs for the rows whose question asked (params.logprobs), from the logits the sampler has.

"raw" (the default, as vLLM's): log_softmax of the model's own logits, before any response_format mask,
repetition penalty, temperature or top-k/p. "processed": of the scores the token was drawn from (the
sampler hands them over, engine/model/sampler.py). Rows that did not ask cost nothing: no log_softmax
runs over the batch, only over the asking rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """One drawn token's logprob and the `top` most likely (id, logprob) pairs at its place, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def asking_rows(rows) -> list[int]:
    """Indices of the rows whose question asked for logprobs."""
    return [i for i, row in enumerate(rows) if row.params.logprobs is not None]


def raw_scores(logits: torch.Tensor, rows, asking: list[int]) -> dict[int, torch.Tensor]:
    """The raw logits of the asking rows in "raw" mode, read before the sampler changes any of them in place."""
    raw = [i for i in asking if rows[i].params.logprobs_mode == "raw"]
    if not raw:
        return {}
    picked = logits[torch.tensor(raw, device=logits.device)].float()  # a gather: a copy, safe from the sampler
    return dict(zip(raw, picked))


def logprobs_of(scores: dict[int, torch.Tensor], rows, tokens: list[int]) -> list[Logprob | None]:
    """Per row, its drawn token's Logprob (None for a row that did not ask): one log_softmax over the asking rows."""
    out: list[Logprob | None] = [None] * len(rows)
    if not scores:
        return out
    order = sorted(scores)
    logs = torch.log_softmax(torch.stack([scores[i] for i in order]), dim=-1)
    chosen = logs.gather(1, torch.tensor([[tokens[i]] for i in order], device=logs.device)).squeeze(1).tolist()
    widest = max(rows[i].params.logprobs for i in order)
    top_values, top_ids = (torch.topk(logs, widest, dim=-1) if widest else (None, None))
    for k, i in enumerate(order):
        wanted = rows[i].params.logprobs
        top = () if not wanted else tuple(zip(top_ids[k, :wanted].tolist(), top_values[k, :wanted].tolist()))
        out[i] = Logprob(tokens[i], chosen[k], top)
    return out


def attach_logprobs(row_chunks, logprobs: list[Logprob | None], new_tokens) -> None:
    """Append to each question's `logprobs` those of the tokens it emitted this step. A drafting chunk's
    j-th emitted token is the one its row j drew (engine/speculate/speculation.py settles so)."""
    rows_of: dict[int, list[Logprob]] = {}
    for chunk, entry in zip(row_chunks, logprobs):
        if entry is not None:
            rows_of.setdefault(id(chunk.seq), []).append(entry)
    taken: dict[int, int] = {}
    for seq, token in new_tokens:
        entries = rows_of.get(id(seq))
        if entries is None or seq.logprobs is None:
            continue
        j = taken.get(id(seq), 0)
        taken[id(seq)] = j + 1
        seq.logprobs.append(entries[j])
