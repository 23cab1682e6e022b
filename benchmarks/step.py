"""`python -m benchmarks.step`: one decode step against its floor, the weight matmuls alone, at each batch size.

A decode step at batch B runs B single-token rows through every layer: the weight matmuls (qkv,
o_proj, gate_up, down per layer, then the output head) plus everything else (norms, rotary, the KV
write and gather, attention, sampling, the step's Python). The matmuls alone, timed on the same
weights with the engine's own `linear` at B rows, are the floor a step cannot go under; step / floor
says how much of a step is not weight GEMM. Attention must also read every row's cached keys and values
once per layer, which no kernel avoids: that many bytes over the memory's read bandwidth (a large
`sum` timed in the same run) is printed beside it, and step / (matmuls + KV read) is the share that
neither floor explains. B questions of `--context` random prompt tokens each are
prefilled first; the timed steps are pure decode steps with all B rows (EOS is ignored here).
`--profile` adds torch.profiler's top operators for the largest batch size's steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

from kev_async.bench.arguments import positive_ints
from kev_async.settings import set_threads
from schemas import DEFAULT_MODEL, Params, QuestionEvent

# torch and the engine are imported inside the functions that use them: --help answers without loading them.


def register(kinds: argparse._SubParsersAction) -> None:
    step = kinds.add_parser(
        "step", help="decode step time against the weight-matmul floor, per batch size",
        description="Median decode step at each batch size (all rows at --context tokens) next to the same "
                    "weight matmuls alone at that many rows; step / floor is the share a step spends outside "
                    "weight GEMMs. --profile lists where the largest batch's step time goes.")
    step.add_argument("--model", default=DEFAULT_MODEL)
    step.add_argument("--batch-sizes", type=positive_ints("batch sizes", "1,8,32,64"), default=[1, 8, 32, 64])
    step.add_argument("--context", type=int, default=400, help="prompt tokens per row before the timed steps "
                                                              "(default 400)")
    step.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size (default 20)")
    step.add_argument("--dtype", default=None, help="fp32 | bf16 (default: the model's load default)")
    step.add_argument("--kv-dtype", default="auto", choices=("auto", "compute", "fp16", "int8"),
                      help="KV cache precision: auto (the compute dtype; fp16 for a GGUF kept as stored under fp32), "
                           "compute, fp16 or int8 (default auto)")
    step.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores, at most 16)")
    step.add_argument("--profile", action="store_true", help="torch.profiler over the largest batch's steps")
    step.add_argument("--matmul", default="auto", choices=("auto", "row_linear", "library", "both"),
                      help="core.matmul for the weight matmuls; both: row_linear and the library side by side, "
                           "alternating per batch size, with their ratio (default auto)")
    step.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from engine import load_model

    set_threads(args.threads)
    if args.matmul == "both":
        models = {kernel: load_model(args.model, dtype=args.dtype, matmul=kernel) for kernel in ("row_linear", "library")}
        compare_kernels(models, args.batch_sizes, context=args.context, steps=args.steps, kv_dtype=args.kv_dtype)
        return 0
    model = load_model(args.model, dtype=args.dtype, matmul=args.matmul)
    bench_step(model, args.batch_sizes, context=args.context, steps=args.steps, profile=args.profile,
               kv_dtype=args.kv_dtype)
    return 0


def bench_step(model, batch_sizes: list[int], *, context: int = 400, steps: int = 20, profile: bool = False,
               kv_dtype: str = "auto", out=print) -> list[dict]:
    import torch

    rows = []
    bandwidth = _read_bandwidth(torch.get_num_threads())
    for batch in batch_sizes:
        row, core = _measure(model, batch, context, steps, kv_dtype, bandwidth)
        rows.append(row)
        if profile and batch == max(batch_sizes):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                _decode_steps(core, batch, min(steps, 10))
            out(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    _report(rows, model, context, steps, bandwidth, kv_dtype, out)
    return rows


def compare_kernels(models: dict, batch_sizes: list[int], *, context: int = 400, steps: int = 20,
                    kv_dtype: str = "auto", out=print) -> list[dict]:
    """The same measurement for each core.matmul kernel's model, taking turns at each batch size (a noisy
    host slows both alike), then library / row_linear per batch size."""
    import torch

    bandwidth = _read_bandwidth(torch.get_num_threads())
    rows = {kernel: [] for kernel in models}
    for batch in batch_sizes:
        for kernel, model in models.items():
            rows[kernel].append(_measure(model, batch, context, steps, kv_dtype, bandwidth)[0])
    for kernel, model in models.items():
        out(f"\ncore.matmul: {kernel}")
        _report(rows[kernel], model, context, steps, bandwidth, kv_dtype, out)
    first, second = list(models)
    out(f"\n| batch | decode step, {second} / {first} | weight matmuls, {second} / {first} |\n|---:|---:|---:|")
    for a, b in zip(rows[first], rows[second]):
        out(f"| {a['batch']} | {b['step_ms'] / a['step_ms']:.2f}x | {b['gemm_ms'] / a['gemm_ms']:.2f}x |")
    return [dict(kernel=kernel, **row) for kernel, kernel_rows in rows.items() for row in kernel_rows]


def _measure(model, batch: int, context: int, steps: int, kv_dtype: str, bandwidth: float) -> tuple[dict, object]:
    """One batch size's row of the table, and the engine it was measured on."""
    core, sequences = _prefilled_core(model, batch, context, steps, kv_dtype)
    # The median timed step's context: the rows' tokens now plus the warm-up and half the timed steps.
    kv_tokens = sum(seq.num_tokens for seq in sequences) + batch * (2 + steps // 2)
    kv_s = kv_tokens * model.spec.kv_bytes_per_token(core.kv.k.dtype) / bandwidth
    step_s = _decode_steps(core, batch, steps)
    floor_s = _gemm_floor(core.runner.weights, batch, model.dtype, repeats=steps)
    return dict(batch=batch, step_ms=step_s * 1000, gemm_ms=floor_s * 1000, ratio=step_s / floor_s,
                kv_read_ms=kv_s * 1000, floor_ratio=step_s / (floor_s + kv_s), tokens_per_s=batch / step_s), core


@functools.lru_cache(maxsize=None)
def _read_bandwidth(threads: int) -> float:
    """Bytes per second the CPU reads from memory at `threads` torch threads: a 256 MiB `sum`, far larger
    than any last-level cache, median of 5. Measured once per process, so runs in one process (e.g. one
    per KV dtype) divide by the same figure."""
    import torch

    buffer = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    times = []
    for _ in range(6):
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return buffer.numel() * buffer.element_size() / statistics.median(times[1:])


def _prefilled_core(model, batch: int, context: int, steps: int, kv_dtype: str = "auto"):
    """An engine holding `batch` questions of `context` random tokens, every one past its prefill."""
    import torch

    from engine import EngineOptions
    from engine.core import EngineCore
    from engine.kv.cache import cache_dtype

    # prompt_chunk_tokens 0: prompts take whole steps (no stall-free cap while early rows decode), so the
    # prefill ends within the steps counted below.
    options = EngineOptions(max_parallel_queries=batch, batch_window_ms=0, kv_dtype=kv_dtype, prompt_chunk_tokens=0)
    # Rows prefilled early decode while later ones prefill: leave room for those tokens too.
    prefill_steps = -(-batch * context // options.max_tokens_per_step) + 2
    new_tokens = prefill_steps + 3 * steps + 8  # prefill, warm-up, timed and profiled steps
    budget = context + new_tokens
    options = dataclasses.replace(options, max_context=budget + 16,
                                  kv_budget_bytes=batch * (budget + 32) * model.spec.kv_bytes_per_token(
                                      cache_dtype(kv_dtype, model)))
    core = EngineCore(model, options)
    core.stop_token_ids = ()  # every row decodes for all timed steps
    ids = torch.randint(100, model.spec.vocab_size - 100, (batch, context), generator=torch.Generator().manual_seed(0))
    sequences = [core.add(QuestionEvent(question_id=f"step-{i}", prompt="-", params=Params(max_new_tokens=new_tokens)),
                          prompt_ids=ids[i].tolist()) for i in range(batch)]
    while not all(seq.output_ids for seq in sequences):  # each row's first token comes with its last chunk
        core.step()
    return core, sequences


def _decode_steps(core, batch: int, steps: int) -> float:
    """Median seconds of `steps` decode steps that each ran all `batch` rows (after 2 untimed ones); every
    row is past its prefill, so each is one token per row."""
    from engine.step_hook import BatchSizes  # the engine (torch): only when timing

    sizes: list[int] = []
    hook = BatchSizes(sizes.append)
    core.hooks.append(hook)
    times = []
    for i in range(steps + 2):
        sizes.clear()
        started = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - started
        if i >= 2 and sizes == [batch]:
            times.append(elapsed)
    core.hooks.remove(hook)
    if not times:
        raise RuntimeError(f"no decode step ran all {batch} rows")
    return statistics.median(times)


def _gemm_floor(weights, batch: int, dtype, repeats: int) -> float:
    """Median seconds of one step's weight matmuls alone at `batch` rows, through the engine's `linear`."""
    import torch

    spec = weights.spec
    x = torch.randn(batch, spec.hidden_size, dtype=dtype)
    attn_out = torch.randn(batch, spec.num_heads * spec.head_dim, dtype=dtype)
    act = torch.randn(batch, spec.intermediate_size, dtype=dtype)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            started = time.perf_counter()
            for layer in weights.layers:
                weights.linear(x, layer.qkv, layer.qkv_bias)
                weights.linear(attn_out, layer.o_proj)
                weights.linear(x, layer.gate_up)
                weights.linear(act, layer.down)
            weights.linear(x, weights.lm_head)
            if i >= 2:
                times.append(time.perf_counter() - started)
    return statistics.median(times)


def _report(rows: list[dict], model, context: int, steps: int, bandwidth: float, kv_dtype: str, out) -> None:
    import torch

    dtype = str(model.dtype).removeprefix("torch.")
    from engine.kv.cache import cache_dtype

    kv = str(cache_dtype(kv_dtype, model)).removeprefix("torch.")
    kernel = model.weights.matmul_kernel
    out(f"model {model.name} ({dtype}, {model.weight_format} weights, {kv} KV, matmul {kernel}), "
        f"{torch.get_num_threads()} threads, every row at ~{context} tokens of context, median of {steps} decode "
        f"steps; memory read {bandwidth / 1e9:.1f} GB/s")
    out("| batch | decode step ms | weight matmuls alone ms | step / matmuls | KV read ms | step / (matmuls + KV read) "
        "| tokens/s |\n|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        out(f"| {r['batch']} | {r['step_ms']:.2f} | {r['gemm_ms']:.2f} | {r['ratio']:.2f}x | {r['kv_read_ms']:.3g} "
            f"| {r['floor_ratio']:.2f}x | {r['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    from benchmarks.command import run_alone

    raise SystemExit(run_alone(register))
