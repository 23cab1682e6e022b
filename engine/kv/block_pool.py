"""The KV block allocator: a fixed set of block ids, handed out and taken back, never grown.

Pure Python on purpose (no torch): the scheduler plans with it, the tensors live in `kv_cache`.

With a prefix cache, a full block of prompt tokens can be held by several questions at once (they
only read it: each writes only slots past its cached prefix, and a partly filled block is never
named). A block's holders are its reference count; when the last one lets go, a named block stays
cached (idle, free-able) and is evicted least recently used first, only when the pool needs it.
"""

from __future__ import annotations

from engine.kv.prefix_cache import PrefixCache

# Flags, one byte per block, so bytes.find() locates a free run in C, not in a Python loop.
FREE, USED, IDLE = 1, 0, 2  # IDLE: held by nobody, still cached


class BlockPool:
    """Owns which KV block belongs to whom. Blocks are ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._flags = bytearray([FREE]) * num_blocks
        self._holders: dict[int, list[str]] = {}  # held block -> questions holding it, first computer first
        self.cache = PrefixCache()
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks a question may take now: plain free ones plus idle cached ones (evicted on demand)."""
        return self.num_blocks - len(self._holders)

    @property
    def num_used(self) -> int:
        return len(self._holders)

    @property
    def num_cached(self) -> int:
        """Blocks named in the prefix cache, held or idle."""
        return len(self.cache)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def owner_of(self, block_id: int) -> str | None:
        holders = self._holders.get(block_id)
        return holders[0] if holders else None

    def holders_of(self, block_id: int) -> tuple[str, ...]:
        return tuple(self._holders.get(block_id, ()))

    def is_free(self, block_id: int) -> bool:
        return self._flags[block_id] != USED

    def grow(self, owner: str, blocks: list[int], num_tokens: int) -> bool:
        """Extend `blocks` in place so they hold `num_tokens`; False (and no change) if the pool is short."""
        missing = self.blocks_for(num_tokens) - len(blocks)
        if missing <= 0:
            return True
        if missing > self.num_free:
            return False
        for _ in range(missing - (self.num_free - self.cache.num_idle)):  # plain free ones first
            block_id = self.cache.evict_oldest()
            self._flags[block_id] = FREE
            self.num_evicted += 1
        blocks.extend(self._take(owner, missing, after=blocks[-1] if blocks else None))
        return True

    def shrink(self, owner: str, blocks: list[int], num_tokens: int) -> None:
        """Give back the trailing blocks of `blocks` that `num_tokens` tokens do not reach (in place)."""
        keep = self.blocks_for(num_tokens)
        if keep < len(blocks):
            tail = blocks[keep:]
            self.release(owner, tail)
            del blocks[keep:]

    # -- the prefix cache ------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Cached blocks for the leading run of `hashes`; sharing them costs `idle_among` free blocks."""
        return self.cache.lookup(hashes)

    def idle_among(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self.cache.is_idle(b))

    def share(self, owner: str, blocks: list[int], cached: list[int]) -> None:
        """Hold the cached prefix blocks `cached` too (read-only), appending them to `blocks`."""
        if blocks:
            raise RuntimeError(f"{owner!r} already holds blocks; a cached prefix comes first")
        for block_id in cached:
            if self.cache.hash_of(block_id) is None or owner in self._holders.get(block_id, ()):
                raise RuntimeError(f"block {block_id} is not a cached prefix block {owner!r} may share")
        for block_id in cached:
            self.cache.unpark(block_id)
            self._holders.setdefault(block_id, []).append(owner)
            self._flags[block_id] = USED
        blocks.extend(cached)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Name a block its holder has just filled; False if that prefix is cached elsewhere already."""
        if self._flags[block_id] != USED:
            raise RuntimeError(f"block {block_id} is not held; only a filled, held block can be cached")
        return self.cache.add(block_id, block_hash)

    # -- giving back -------------------------------------------------------------------------------------
    def release(self, owner: str, blocks: list[int]) -> None:
        """Let go of every block in `blocks` and empty the list; unshared, uncached ones become free."""
        for block_id in blocks:  # check them all first: a refused release must change nothing
            if owner not in self._holders.get(block_id, ()):
                raise RuntimeError(f"block {block_id} is owned by {self.owner_of(block_id)!r}, not {owner!r}")
        # The tail first: it becomes the older eviction candidate, so a chain is evicted from its end
        # and its head (what most questions share) stays reachable longest.
        for block_id in reversed(blocks):
            holders = self._holders[block_id]
            holders.remove(owner)
            if holders:
                continue
            del self._holders[block_id]
            if self.cache.hash_of(block_id) is None:
                self._flags[block_id] = FREE
            else:
                self._flags[block_id] = IDLE
                self.cache.park(block_id)
        blocks.clear()

    def _take(self, owner: str, count: int, after: int | None) -> list[int]:
        start = self._contiguous_start(count, after)
        if start is not None:
            ids = list(range(start, start + count))
        else:  # fragmented: any free blocks, lowest ids first
            ids = [i for i, flag in enumerate(self._flags) if flag == FREE][:count]
        for block_id in ids:
            self._flags[block_id] = USED
            self._holders[block_id] = [owner]
        return ids

    def _contiguous_start(self, count: int, after: int | None) -> int | None:
        run = bytes([FREE]) * count
        # Continuing right behind the owner's last block keeps its cache contiguous.
        if after is not None and self._flags.find(run, after + 1, after + 1 + count) == after + 1:
            return after + 1
        start = self._flags.find(run)
        return None if start < 0 else start
