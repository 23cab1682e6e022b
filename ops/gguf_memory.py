"""Peak memory at load and resident memory after one answer, for one weights format, in this fresh process
(docs/speed.md, "GGUF weights as stored"): VmHWM after load_model, VmRSS after a 32-token answer, with a
KV pool of 32,768 tokens (llama-server's -c 32768).

    python ops/gguf_memory.py FILE.gguf auto|full|int8 fp32|bf16
"""

import sys
import time

from engine import EngineOptions, load_model
from engine.pipeline import IsolatedBatchPipeline


def status_mib(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(path: str, weights: str, dtype: str) -> None:
    started = time.time()
    model = load_model(path, dtype=dtype, weights=weights)
    load_s, peak_at_load = time.time() - started, status_mib("VmHWM")
    pipe = IsolatedBatchPipeline(model, max_batch_size=1, options=EngineOptions(num_blocks=2048, block_size=16))
    pipe.run(["Write a Python function that checks whether a number is prime."], max_new_tokens=32, temperature=0.0)
    print(f"weights={weights} dtype={dtype} format={model.weight_format} load_s={load_s:.1f} "
          f"weights_MiB={model.weights.nbytes / 2**20:.0f} peak_at_load_MiB={peak_at_load:.0f} "
          f"rss_after_answer_MiB={status_mib('VmRSS'):.0f} peak_MiB={status_mib('VmHWM'):.0f}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
