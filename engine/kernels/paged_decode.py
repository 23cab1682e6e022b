"""Single-token decode attention that reads each question's keys and values where they lie in the block
pool, instead of gathering them into a padded batch first (CPU; fp32, bf16, fp16 and int8 caches).

The gather was a third of an fp32 decode step at 64 rows of 400 tokens (`python -m benchmarks.step --profile`):
it copies every row's whole context out of the pool, per layer, per step, at the memory's speed, and
attention then reads the copy again. This kernel reads each key and value once, from its slot.

A task is a whole question when the step has enough rows (it then reads the question's blocks in
order, all KV heads of a position lying together), else one KV head of a question, so every thread
has work. Either way each query head scores every visible key of its question (its own block table,
up to its own length), softmaxes and sums the values in fp32, in the same order whatever the task
holds. A task never reads another question's slots and its arithmetic does not depend on which other
rows share the step, so a row's result is the same alone or packed (the tests check both splits).

An int8 cache is read as it is stored: each key's dot product with the query is multiplied by that
key's scale, and each softmax weight by its value's scale before it weighs the int8 value, so a step
reads a quarter of fp32's bytes and never writes a dequantised copy.

The C++ is compiled once per machine with the host's instruction set (`-march=native`), with Kev's other
CPU kernels (engine/kernels/native.py), into torch's extension cache under a name keyed by the sources,
the compiler flags and the CPU's flags, so a cache carried to another CPU compiles anew. Without a compiler, or with KEV_PAGED_DECODE=0 when an engine is built, decodes
use the SDPA path (engine/kernels/attention.py's _DecodeGroups).
"""

from __future__ import annotations

import itertools
import os

import torch

from engine.kernels import native

_CFLAGS = native.CFLAGS


def kernel():
    """The compiled `paged_decode` op, or None (no compiler, not Linux, or KEV_PAGED_DECODE=0)."""
    if os.environ.get("KEV_PAGED_DECODE", "1") == "0":
        return None
    return compiled(_CFLAGS)


def compiled(cflags: tuple[str, ...]):
    """The op built with these compiler flags (the tests also build one without AVX-512, the path CPUs
    without it take), or None where it cannot be built (the SDPA path works)."""
    module = native.compiled(tuple(cflags))
    return module.paged_decode if module is not None else None


# The kernels compiled: head sizes and query heads per KV head (others take the SDPA path); groups 5-7 at
# head sizes 64 and 128 only (the Qwen2.5 family's shapes).
HEAD_SIZES = (16, 32, 64, 128, 256)
GROUPS = (1, 2, 3, 4, 8)
WIDE_GROUPS = {64: (5, 6, 7), 128: (5, 6, 7)}


def compiled_shape(head_dim: int, group: int) -> bool:
    return head_dim in HEAD_SIZES and (group in GROUPS or group in WIDE_GROUPS.get(head_dim, ()))


def usable(kv) -> bool:
    """Whether decodes over this cache can take the kernel: CPU, fp32 or bf16 queries over a cache of
    their dtype or int8 (fp32 ones also fp16), a compiled head shape."""
    return (kv.k.device.type == "cpu" and kv.compute_dtype in (torch.float32, torch.bfloat16)
            and (kv.quantized or kv.reads_plain)
            and compiled_shape(kv.k.shape[-1], kv.group) and kernel() is not None)


class PagedDecodes:
    """Single-token decodes of any lengths, each attending its own slots in place: no padding, no gather."""

    def __init__(self, segments: list, block_size: int, device: torch.device):
        widest = max(len(s.block_ids) for s in segments)
        # Padding names the row's own first block (never read: a row stops at its length).
        self.table = torch.tensor([s.block_ids + s.block_ids[:1] * (widest - len(s.block_ids)) for s in segments],
                                  dtype=torch.long)
        self.lengths = torch.tensor([s.kv_len for s in segments], dtype=torch.long)
        self.rows = torch.tensor([s.q_start for s in segments], device=device)
        self.block_size = block_size
        self.op = kernel()  # once per step, not per layer

    @classmethod
    def every_row(cls, segments: list, block_size: int) -> "PagedDecodes":
        """Every row of every segment as a decode of its own position: row i of a chunk reads its question's
        first cached + i + 1 keys, in place. Deterministic mode attends prompt rows so (a row's arithmetic
        then depends on its own position and keys alone). Segments must cover the step's rows in order."""
        assert [s.q_start for s in segments] == list(itertools.accumulate((s.q_len for s in segments[:-1]), initial=0))
        widest = max(len(s.block_ids) for s in segments)
        tables = torch.tensor([s.block_ids + s.block_ids[:1] * (widest - len(s.block_ids)) for s in segments],
                              dtype=torch.long)
        rows = cls.__new__(cls)
        counts = [s.q_len for s in segments]
        # A decode step (one row each) needs no repeat: ~0.1 ms of a step that takes a few.
        rows.table = tables if max(counts) == 1 else tables.repeat_interleave(torch.tensor(counts), dim=0)
        rows.lengths = torch.tensor([n for s in segments for n in range(s.cached + 1, s.kv_len + 1)], dtype=torch.long)
        rows.rows, rows.block_size, rows.op = None, block_size, kernel()
        return rows

    def attend(self, q: torch.Tensor, cache) -> torch.Tensor:
        """q: [B, H, D], the decode rows only, in segment order; the result in the same order. The layer's
        form (cache.form) gives the score scale, the sliding window and the soft cap."""
        scales = (cache.k_scale, cache.v_scale) if cache.quantized else (None, None)
        form = cache.form
        args = (q.contiguous(), cache.k, cache.v, self.table, self.lengths, self.block_size, form.scale,
                form.window or 0, form.softcap or 0.0, *scales)
        if not torch.autograd._profiler_enabled():  # a record_function costs ~8 us even with no profiler
            return self.op(*args)
        with torch.profiler.record_function("kev::paged_decode"):  # named in `python -m benchmarks.step --profile`
            return self.op(*args)
