"""Which attention backend an engine runs, decided once when it starts.

`choose_attention` is pure: it reads only the facts it is given (device type, compute dtype, KV
dtype, deterministic mode, `core.attention`, whether flash-attn imports, whether fp32 matmuls may use
TF32), so every decision is checked by CPU tests without a GPU. It returns a `BackendChoice` (the
backend, why, and each slow path the setup falls into) or raises `BackendRefused` with what is missing,
when the request cannot run or cannot keep the promise the engine makes:

- flash-attn: CUDA, fp16 or bf16, a cache in the model's dtype (it reads pages raw; int8 it cannot),
  flash_attn importable, not deterministic (its kernels split work by the batch's shape).
- sdpa: engine/kernels/attention.py's TorchAttention, torch SDPA per question. On CPU its decodes read
  the block pool with the C++ paged kernel; on CUDA (that kernel is CPU-only) they take the gathered,
  padded SDPA route. Any dtype, int8 KV too.
- fixed-tiles: deterministic mode's FixedTileAttention. CPU only: its start-up proof that a tile's bits
  do not depend on its neighbours is made for the CPU's BLAS; nothing proves it for cuBLAS, so
  deterministic mode on any other device is refused rather than promised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import structlog
import torch

from schemas import AttentionBackend

log = structlog.get_logger("kev.engine")

FLASH, SDPA, FIXED_TILES = "flash-attn", "sdpa", "fixed-tiles"
REQUESTS = get_args(AttentionBackend)  # auto | flash-attn | sdpa
FLASH_DTYPES = (torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class BackendRefused(ValueError):
    """The configured attention cannot run here, or cannot keep the engine's promise; says what is missing."""


@dataclass(frozen=True)
class SlowPath:
    name: str  # short and stable, for logs and tests
    detail: str  # what is slow, why, and what would avoid it


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # flash-attn | sdpa | fixed-tiles
    reason: str
    slow_paths: tuple[SlowPath, ...] = ()


def choose_attention(*, device: str, dtype: torch.dtype, kv_dtype: str, deterministic: bool,
                     requested: str = "auto", flash_installed: bool = False, tf32: bool = False) -> BackendChoice:
    """The backend for an engine on `device` (a device type: "cpu", "cuda") computing in `dtype`."""
    if requested not in REQUESTS:
        raise BackendRefused(f"core.attention {requested!r} is not one of {', '.join(REQUESTS)}")
    if deterministic:
        return _deterministic(device, requested)
    missing = flash_missing(device, dtype, kv_dtype, flash_installed)
    if requested == FLASH:
        if missing:
            raise BackendRefused(f"core.attention: flash-attn cannot run here: {'; '.join(missing)}")
        return BackendChoice(FLASH, "core.attention: flash-attn", _cuda_slow_paths(dtype, kv_dtype, tf32))
    if device != "cuda":
        return BackendChoice(SDPA, f"{device}: every row as a decode by the paged kernel where built, else torch "
                                   "SDPA per question")
    if requested == "auto" and not missing:
        return BackendChoice(FLASH, f"cuda, {dtype_name(dtype)}, flash-attn installed")
    slow = _cuda_slow_paths(dtype, kv_dtype, tf32)
    if requested == SDPA:
        return BackendChoice(SDPA, "core.attention: sdpa", slow)
    if missing == [NOT_INSTALLED]:  # flash-attn would have run: only the package is missing
        slow = (SlowPath("flash_attn_missing", f"{NOT_INSTALLED}: attention runs torch SDPA per question, "
                                               "decodes gathered and padded"),) + slow
    return BackendChoice(SDPA, f"flash-attn cannot run: {'; '.join(missing)}", slow)


NOT_INSTALLED = "flash-attn is not installed (KEV_FLASH_ATTN=1 make setup, where a wheel matches torch)"


def flash_missing(device: str, dtype: torch.dtype, kv_dtype: str, flash_installed: bool) -> list[str]:
    """What flash-attn lacks here, each with the setting that would change it; empty when it can run."""
    missing = []
    if device != "cuda":
        missing.append(f"it needs a CUDA device, this engine runs on {device} (core.device)")
    if dtype not in FLASH_DTYPES:
        missing.append(f"it computes in fp16 or bf16 only, the model is {dtype_name(dtype)} "
                       "(core.precision: bf16, or auto on CUDA)")
    if kv_dtype == "int8":
        missing.append("it reads its cache raw and cannot read an int8 cache (kv_cache.dtype: int8)")
    if kv_dtype == "fp16" and dtype != torch.float16:
        missing.append(f"it reads its cache raw, so an fp16 cache needs an fp16 model, not {dtype_name(dtype)} "
                       "(kv_cache.dtype: auto)")
    if not flash_installed:
        missing.append(NOT_INSTALLED)
    return missing


def check_deterministic_device(device: str) -> None:
    """Deterministic mode runs on the CPU only: raise BackendRefused anywhere else."""
    if device != "cpu":
        raise BackendRefused(
            f"isolation.deterministic is CPU-only: its start-up check proves batch invariance for the CPU's "
            f"kernels, and nothing proves it on {device}; set isolation.deterministic: false, or core.device: cpu")


def _deterministic(device: str, requested: str) -> BackendChoice:
    check_deterministic_device(device)
    if requested != "auto":
        raise BackendRefused(
            f"core.attention: {requested} cannot keep isolation.deterministic's bitwise promise (its kernels "
            "pick their blocking by the batch's shape); deterministic mode uses its fixed-tile attention: "
            "set core.attention: auto")
    return BackendChoice(FIXED_TILES, "isolation.deterministic: fixed-tile attention, batch-invariant")


def _cuda_slow_paths(dtype: torch.dtype, kv_dtype: str, tf32: bool) -> tuple[SlowPath, ...]:
    slow = []
    if kv_dtype == "int8":
        slow.append(SlowPath("int8_kv_on_cuda", "kv_cache.dtype: int8 on CUDA: every read dequantises a gathered "
                                                "copy of the keys and values (no fused int8 kernel on CUDA)"))
    if dtype == torch.float32 and not tf32:
        slow.append(SlowPath("fp32_without_tf32", "fp32 on CUDA with TF32 matmuls off: full fp32 matmuls, many "
                                                  "times slower than bf16 (core.precision: auto or bf16)"))
    return tuple(slow)


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def tf32_matmul() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32. torch has two APIs for this, and reading the old one
    raises once the new one was used, so the new one is read first."""
    try:
        own = torch.backends.cuda.matmul.fp32_precision
        return (torch.backends.fp32_precision if own == "none" else own) == "tf32"
    except (AttributeError, RuntimeError):
        try:
            return torch.get_float32_matmul_precision() != "highest"
        except RuntimeError:
            return False


def log_choice(choice: BackendChoice, device: torch.device, dtype: torch.dtype, kv_dtype: str,
               deterministic: bool, kv_stored: torch.dtype | None = None) -> None:
    """One `attention.backend` line (with `kv_stored`: what the cache holds, when the engine knows it), then
    one `slow_path` warning per slow path."""
    mode = "deterministic" if deterministic else "fast"
    stored = {} if kv_stored is None else {"kv_stored": dtype_name(kv_stored)}
    log.info("attention.backend", backend=choice.backend, device=str(device), dtype=dtype_name(dtype),
             kv_dtype=kv_dtype, **stored, mode=mode, reason=choice.reason)
    for slow in choice.slow_paths:
        log.warning("slow_path", name=slow.name, detail=slow.detail, backend=choice.backend, device=str(device))
