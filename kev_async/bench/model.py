"""The models every benchmark runs: Kev's (torch threads from --threads, then --model) and transformers'
own model on the same weights, the baseline. `kev --help` imports this module (through the benchmarks'
parsers), so the engine and transformers load inside the functions, when a benchmark runs."""

from __future__ import annotations

import argparse

from kev_async.settings import set_threads


def bench_model(args: argparse.Namespace):
    from engine import load_model  # torch: not for `kev --help`

    set_threads(args.threads)
    return load_model(args.model)


def hf_model(model):
    """transformers' own model on the same weights, precision and device as Kev's (a baseline left on
    the CPU while Kev runs on a GPU would compare devices, not engines); callers put inputs on `hf.device`."""
    import structlog
    from transformers import AutoModelForCausalLM  # heavy: not for `kev --help`

    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype).to(model.device).eval()
    structlog.get_logger("kev.bench").info("bench.baseline_device", device=str(hf.device), dtype=str(hf.dtype))
    return hf
