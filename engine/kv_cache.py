"""The KV cache tensors: allocated once at start from a budget, never resized."""

from __future__ import annotations

import torch

MIB = 1 << 20


class KVCache:
    """Per layer, keys and values for every slot: [layers, num_blocks * block_size, kv_heads, head_dim].

    Slot s of block b is row b * block_size + s, so a block is `block_size` consecutive rows and a
    flash-attn paged view ([num_blocks, block_size, kv_heads, head_dim]) is a free reshape.
    """

    def __init__(self, spec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (spec.num_layers, num_blocks * block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group = spec.num_heads // spec.num_kv_heads  # query heads per KV head

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def plan_num_blocks(spec, dtype: torch.dtype, device: torch.device, block_size: int, *,
                    num_blocks: int | None = None, budget_bytes: int | None = None,
                    memory_fraction: float = 0.5, cpu_default_bytes: int = 512 * MIB) -> int:
    """How many blocks the pool gets: as configured, from a byte budget, or from free device memory."""
    if num_blocks:
        return num_blocks
    per_block = spec.kv_bytes_per_token(dtype) * block_size
    if budget_bytes is None:
        # On a CPU host memory is shared with everything else: a fixed default beats a fraction of "free".
        budget_bytes = _free_cuda_bytes(device) * memory_fraction if device.type == "cuda" else cpu_default_bytes
    blocks = int(budget_bytes // per_block)
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget_bytes / MIB:.1f} MiB is below one block ({per_block} bytes)")
    return blocks


def _free_cuda_bytes(device: torch.device) -> int:
    free, _total = torch.cuda.mem_get_info(device)
    return free
