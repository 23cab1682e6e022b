"""One question's decode ms/token and a 512-token prompt's prefill, Kev's weight formats side by side on one
GGUF (docs/speed.md, "GGUF weights as stored"). Kev's side of `kev bench peer` (EOS ignored, one question
at a time), the formats loaded in one process and run in turn within each repeat; medians.

    python ops/gguf_decode.py FILE.gguf [REPEATS] [NEW_TOKENS]
"""

import statistics
import sys

import torch

from engine import load_model
from kev_async.bench.machine import cpu_name
from kev_async.bench.peer import KevSide, decode_prompt, prefill_prompts

FORMATS = [("gguf fp32", "fp32", "auto"), ("gguf bf16", "bf16", "auto"), ("int8 bf16", "bf16", "int8"),
           ("full bf16", "bf16", "full")]  # name, core.precision, core.weights


def main(path: str, repeats: int = 5, new_tokens: int = 64) -> None:
    torch.set_num_threads(2)
    sides = {}
    for name, dtype, weights in FORMATS:
        model = load_model(path, dtype=dtype, weights=weights)
        sides[name] = (model, KevSide(model, 1200))
    first = sides[FORMATS[0][0]][0]
    prompt, long_prompts = decode_prompt(first), prefill_prompts(first, 512, repeats)
    ms = {name: [] for name in sides}
    prefill = {name: [] for name in sides}
    answers = {}
    for repeat in range(repeats):
        for name, (_, side) in sides.items():
            per_token, answers[name] = side.decode(prompt, new_tokens)
            ms[name].append(per_token)
            prefill[name].append(side.prefill(long_prompts[repeat]))
    print(f"{cpu_name()}, torch threads 2, {repeats} repeats, {new_tokens} new tokens after a {len(prompt)}-token prompt")
    base = statistics.median(ms["int8 bf16"])
    for name, (model, _) in sides.items():
        per_token = statistics.median(ms[name])
        same = sum(a == b for a, b in zip(answers[name], answers[FORMATS[0][0]]))
        print(f"| {name} | {per_token:.1f} ms/token | {base / per_token:.2f}x int8 bf16's speed | "
              f"prefill {statistics.median(prefill[name]):.0f} tokens/s | weights {model.weights.nbytes / 2**20:.0f} MiB | "
              f"tokens equal to {FORMATS[0][0]}'s {same}/{new_tokens} |")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:4]))
