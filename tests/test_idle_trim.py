"""When its last question ends, the engine hands the steps' freed buffers back to the system: a burst of long
prompts leaves the process's resident size where it was before the burst, not ~its activations higher."""

import random

import pytest

from engine import EngineOptions
from engine.core import EngineCore
from kev_async.bench.process_memory import resident_mib
from schemas import Params, QuestionEvent

pytestmark = pytest.mark.skipif(resident_mib() is None, reason="needs /proc/self/status")


def _burst(core: EngineCore, tag: str, prompt_tokens: int, rng: random.Random) -> None:
    for i in range(4):
        ids = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
        core.add(QuestionEvent(question_id=f"{tag}-{i}", prompt="-", params=Params(max_new_tokens=2)), prompt_ids=ids)
    while core.has_work:
        core.step()


def test_a_burst_of_long_prompts_leaves_no_resident_growth(smollm2):
    rng = random.Random(0)
    core = EngineCore(smollm2, EngineOptions(max_parallel_queries=4, batch_window_ms=0, prefix_caching=False,
                                             max_tokens_per_step=4096, max_context=1100))
    _burst(core, "warm", 64, rng)  # first-call allocations (the extension, the pool's pages)
    before = resident_mib()["now"]
    _burst(core, "burst", 1000, rng)  # 4,000 prompt rows in one step: tens of MiB of activations
    after = resident_mib()["now"]
    assert after - before < 12, f"resident {before:.0f} MiB before the burst, {after:.0f} MiB after it went idle"
