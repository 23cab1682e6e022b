"""The KV block allocator: a fixed set of block ids, handed out and taken back, never grown.

Pure Python on purpose (no torch): the scheduler plans with it, the tensors live in `kv_cache`.
"""

from __future__ import annotations

FREE, USED = 1, 0


class BlockPool:
    """Owns which KV block belongs to whom. Blocks are ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One byte per block lets bytes.find() locate a free run in C, not in a Python loop.
        self._flags = bytearray([FREE]) * num_blocks
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self._owner)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def owner_of(self, block_id: int) -> str | None:
        return self._owner.get(block_id)

    def grow(self, owner: str, blocks: list[int], num_tokens: int) -> bool:
        """Extend `blocks` in place so they hold `num_tokens`; False (and no change) if the pool is short."""
        missing = self.blocks_for(num_tokens) - len(blocks)
        if missing <= 0:
            return True
        if missing > self.num_free:
            return False
        blocks.extend(self._take(owner, missing, after=blocks[-1] if blocks else None))
        return True

    def release(self, owner: str, blocks: list[int]) -> None:
        """Return every block in `blocks` to the pool and empty the list."""
        for block_id in blocks:  # check them all first: a refused release must change nothing
            if self._owner.get(block_id) != owner:
                raise RuntimeError(f"block {block_id} is owned by {self._owner.get(block_id)!r}, not {owner!r}")
        for block_id in blocks:
            del self._owner[block_id]
            self._flags[block_id] = FREE
        blocks.clear()

    def _take(self, owner: str, count: int, after: int | None) -> list[int]:
        start = self._contiguous_start(count, after)
        if start is not None:
            ids = list(range(start, start + count))
        else:  # fragmented: any free blocks, lowest ids first
            ids = [i for i, flag in enumerate(self._flags) if flag == FREE][:count]
        for block_id in ids:
            self._flags[block_id] = USED
            self._owner[block_id] = owner
        return ids

    def _contiguous_start(self, count: int, after: int | None) -> int | None:
        run = bytes([FREE]) * count
        # Continuing right behind the owner's last block keeps its cache contiguous.
        if after is not None and self._flags.find(run, after + 1, after + 1 + count) == after + 1:
            return after + 1
        start = self._flags.find(run)
        return None if start < 0 else start
