"""transformers as the reference for the GPU suite: its logits on a whole sequence, its greedy answer,
and the checks that compare Kev's recorded draws with them (messages say where and by how much)."""

from __future__ import annotations

import torch


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `token_ids`, in float32, on the model's device."""
    with torch.no_grad():
        ids = torch.tensor([token_ids], device=hf.device)
        return hf(ids).logits[0].float()


def hf_greedy(hf, prompt: list[int], new_tokens: int, exact: bool = True) -> list[int]:
    """transformers' own greedy answer (its generate loop and KV cache): `new_tokens` long when `exact`,
    else up to and with the model's end-of-sequence token, as Kev's answers end."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=hf.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens if exact else None, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def teacher_forced(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' rows that drew each of Kev's tokens, fed Kev's own sequence (one early flip does not
    cascade): row i is the distribution Kev's token i was drawn from."""
    return hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1:]


def assert_logits_close(kev_rows: list[torch.Tensor], reference: torch.Tensor, tolerance: float, what: str) -> None:
    """Each of Kev's rows within `tolerance` x the largest |reference logit| of transformers' row."""
    assert len(kev_rows) == len(reference), f"{what}: {len(kev_rows)} draws, {len(reference)} reference rows"
    scale = reference.abs().max().item()
    for step, (row, expected) in enumerate(zip(kev_rows, reference)):
        assert torch.isfinite(row).all(), f"{what}, step {step}: non-finite logits"
        diff = (row.to(expected.device) - expected).abs().max().item()
        assert diff <= tolerance * scale, (f"{what}, step {step}: max |kev - transformers| = {diff:.3g}, "
                                           f"over {tolerance:.1%} of {scale:.3g}")


def assert_follows_greedy(tokens: list[int], reference: torch.Tensor, gap: float, agree: float, what: str) -> None:
    """Each of Kev's greedy tokens is transformers' best or within `gap` of it (a near-tie reduced
    precision may flip), and at least `agree` of them are its best exactly."""
    exact = 0
    for step, (token, row) in enumerate(zip(tokens, reference)):
        best = int(row.argmax())
        behind = (row[best] - row[token]).item()
        assert behind <= gap, (f"{what}, step {step}: Kev drew {token}, {behind:.3g} below transformers' "
                               f"best {best} (allowed {gap:.3g})")
        exact += token == best
    assert exact >= agree * len(tokens), f"{what}: {exact} of {len(tokens)} tokens are transformers' best"


def assert_same_or_near_tie(hf, prompt: list[int], got: list[int], expected: list[int], gap: float, what: str) -> bool:
    """Two greedy answers to one prompt are equal, or part where transformers in fp32 finds both tokens
    within `gap` of its best: reduced precision rounds a product differently when its shape changes
    (a packed batch, a chunk after a cached prefix), which can flip a near-tie and nothing else. A
    question that saw another's keys, or lost its own, parts at a token far behind. True when equal."""
    if got == expected:
        return True
    step = next((i for i, (x, y) in enumerate(zip(got, expected)) if x != y), None)
    assert step is not None, f"{what}: one answer is a prefix of the other ({len(got)} vs {len(expected)} tokens)"
    row = teacher_forced(hf, prompt, expected[: step + 1])[step]
    behind = {token: (row.max() - row[token]).item() for token in (got[step], expected[step])}
    assert max(behind.values()) <= gap, (f"{what}: answers part at step {step} on tokens {behind} behind "
                                         f"transformers' best (a near-tie would be within {gap:.3g})")
    return False


def first_difference(a: list[int], b: list[int]) -> str:
    """Where two token lists part, for assertion messages."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"
