"""Several samples of one question (`params.n`) and per-token logprobs: the bounds and the seed rule.

Sample i of a question seeded s draws with `sample_seed(s, i)`: sample 0 with s itself, so `n: 1` is the
question as before, and any sample is reproduced alone by asking once with its derived seed.
"""

from __future__ import annotations

MAX_SAMPLES = 16  # params.n
MAX_TOP_LOGPROBS = 20  # params.top_logprobs, OpenAI's bound
_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index`: `seed` for the first, else splitmix64 of (seed, index), within Seed's range."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
