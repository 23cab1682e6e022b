"""Which kernel multiplies the weights on a CPU: row_linear, or the library (oneDNN / MKL).

row_linear (engine/kernels/row_linear.py) keeps a row's bits whatever shares its call, so with it every
question's logits are the same alone or packed, at every precision: isolation by construction, not only
in deterministic mode. The library's kernels pick their blocking by shape, and on CPUs with AMX they
multiply bf16 prompts many times faster than row_linear's AVX-512 can. Weight-only int8 models compare
row_linear's int8 panels with torch's int8 kernel the same way.

`core.matmul: auto` measures both on two of the model's own matrices at a decode-sized and a
prompt-sized row count, alternating, and takes row_linear unless the library is clearly faster
(LIBRARY_MARGIN) at either: isolation is worth some speed, and near a tie a noisy host would make the
verdict change from start to start. Each figure is the best of REPEATS (a busy neighbour only ever
adds time). The verdict and the figures are logged once as `matmul.kernel`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import structlog
import torch

from engine.kernels import row_linear
from engine.kernels.packed_weight import PackedWeight, can_pack
from engine.kernels.quant import Int8Weight
from engine.kernels.row_linear import RowWeight

log = structlog.get_logger("kev.matmul")

MatmulKernel = Literal["auto", "row_linear", "library"]
KERNELS = ("auto", "row_linear", "library")
PROBE_ROWS = (8, 256)  # a decode step's rows, a prompt chunk's rows
REPEATS = 5
# The library must be this much faster before auto gives up row_linear's invariance for it (AMX's bf16
# prompts are several times faster; AVX-512 machines measured so far are within 0.5-2x either way).
LIBRARY_MARGIN = 1.5
# Matrices whose prompt-sized probe is under this many multiply-adds are not timed (call overheads would
# decide, and a test model's verdict would change from run to run): row_linear.
TIMED_MACS = 2e8


@dataclass(frozen=True)
class MatmulChoice:
    kernel: Literal["row_linear", "library"]
    reason: str
    ms: dict = field(default_factory=dict)  # "row_linear_8_ms" -> ms for the probe matrices at 8 rows, ...

    @property
    def batch_invariant(self) -> bool:
        return self.kernel == "row_linear"


def choose(requested: str, dtype: torch.dtype, device: torch.device, probes: list[torch.Tensor],
           quantized: bool = False) -> MatmulChoice:
    """The kernel for a model's matrices; `probes`: a few of its plain matrices to time (auto only)."""
    if requested not in KERNELS:
        raise ValueError(f"core.matmul {requested!r} is not one of {', '.join(KERNELS)}")
    unable = _why_not_row_linear(dtype, device)
    if requested == "library":
        return _logged(MatmulChoice("library", "core.matmul: library"))
    if unable:
        if requested == "row_linear":
            raise ValueError(f"core.matmul: row_linear cannot run here: {unable}")
        return _logged(MatmulChoice("library", unable))
    if requested == "row_linear":
        return _logged(MatmulChoice("row_linear", "core.matmul: row_linear"))
    if not quantized and not can_pack(dtype, device):
        return _logged(MatmulChoice("row_linear", "the library has no packed kernel for this dtype here"))
    if sum(m.numel() for m in probes) * PROBE_ROWS[-1] < TIMED_MACS:
        return _logged(MatmulChoice("row_linear", "matrices too small to time; row_linear"))
    return _logged(_measured(probes, quantized))


def stored_blocks(isa: str) -> MatmulChoice:
    """A GGUF's matrices kept in their block formats: block_linear (engine/kernels/block_weight.py), whose
    rows are as batch-invariant as row_linear's; core.matmul does not apply to them."""
    return _logged(MatmulChoice("row_linear", f"a GGUF's block formats multiply as stored (block_linear, {isa})"))


def _why_not_row_linear(dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"row_linear is a CPU kernel; the model is on {device.type}"
    if dtype not in row_linear.DTYPES:
        return f"row_linear takes fp32 and bf16, not {str(dtype).removeprefix('torch.')}"
    if row_linear.kernel() is None:
        return "the row_linear kernel is not built on this machine (no compiler, or KEV_ROW_LINEAR=0)"
    return None


def _measured(probes: list[torch.Tensor], quantized: bool = False) -> MatmulChoice:
    """Time row_linear and the library on `probes` at each of PROBE_ROWS rows, in turns; `quantized`:
    both as weight-only int8 (the library's is torch's int8 kernel)."""
    library = Int8Weight if quantized else PackedWeight
    kernels = {"row_linear": [RowWeight(m, int8=quantized) for m in probes], "library": [library(m) for m in probes]}
    generator = torch.Generator().manual_seed(0)
    ms: dict[str, float] = {}
    for rows in PROBE_ROWS:
        xs = [torch.randn(rows, m.shape[1], generator=generator).to(m.dtype) for m in probes]
        samples: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(REPEATS + 1):  # the first round warms caches and is dropped
            for name, weights in kernels.items():
                start = time.perf_counter()
                for x, weight in zip(xs, weights):
                    weight.linear(x)
                samples[name].append(time.perf_counter() - start)
        for name, times in samples.items():
            ms[f"{name}_{rows}_ms"] = round(min(times[1:]) * 1e3, 3)
    slower = [rows for rows in PROBE_ROWS if ms[f"row_linear_{rows}_ms"] > LIBRARY_MARGIN * ms[f"library_{rows}_ms"]]
    if slower:
        return MatmulChoice("library", f"the library is over {LIBRARY_MARGIN}x faster at {slower} rows", ms)
    return MatmulChoice("row_linear", "row_linear is as fast as the library, or faster, at decode and prompt rows", ms)


def _logged(choice: MatmulChoice) -> MatmulChoice:
    log.info("matmul.kernel", kernel=choice.kernel, batch_invariant=choice.batch_invariant,
             isa=_isa() if choice.kernel == "row_linear" else None, reason=choice.reason,
             threads=torch.get_num_threads(), **choice.ms)
    return choice


def _isa() -> str | None:
    module = row_linear.kernel()
    return module.row_linear_isa() if module is not None else None
