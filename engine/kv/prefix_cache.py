"""The prefix cache: which full KV blocks hold which token prefix, and which idle ones go first.

A full block is named by a hash chain: block i's hash covers the salt (model, tenant scope, adapter
and its version), its own tokens and block i-1's hash, so one hash names one whole prefix. Two
questions reach the same block only with the same salt and the same tokens up to its end: a tenant
never finds another tenant's block, and a prefix computed under one adapter is never served to
another (vLLM's scheme, with the tenant in the salt because of CVE-2025-46570's timing channel).

SHA-256, not Python's `hash()`: the cache is an isolation boundary, and collisions of a 64-bit
non-cryptographic hash can be constructed (vLLM moved off `hash()` for that reason).

Pure Python, no torch: the pool keeps its blocks' reference counts; this module only maps hashes to
blocks and orders the idle ones (held by nobody, still valid) for eviction, least recently used first.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def prefix_salt(model: str, tenant: str | None, cache_salt: str | None, adapter: tuple | None) -> bytes:
    """What, besides tokens, decides a block's contents and who may read it; JSON so no two collide."""
    return json.dumps([model, tenant, cache_salt, list(adapter) if adapter else None]).encode()


def chain_hashes(salt: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash of every full block of `token_ids`, in order; a trailing partial block has none."""
    parent = hashlib.sha256(b"kev-prefix\0" + salt).digest()
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.sha256(parent + tokens).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """hash <-> block for every cached block, and the idle ones in least-recently-released order."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first: the next to evict

    def __len__(self) -> int:
        return len(self._hash_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def is_idle(self, block_id: int) -> bool:
        return block_id in self._idle

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached leading run of `hashes` (a chain breaks at its first miss)."""
        found = []
        for h in hashes:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def add(self, block_id: int, block_hash: bytes) -> bool:
        """Name a freshly filled block; False when the prefix is cached already (the block stays private)."""
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def park(self, block_id: int) -> None:
        """Its last holder let go: keep it, as the newest eviction candidate."""
        self._idle[block_id] = None
        self._idle.move_to_end(block_id)

    def unpark(self, block_id: int) -> None:
        """Held again: no longer evictable."""
        self._idle.pop(block_id, None)

    def evict_oldest(self) -> int:
        """Forget the least recently released idle block and return its id (now plain free)."""
        block_id, _ = self._idle.popitem(last=False)
        del self._block_of[self._hash_of.pop(block_id)]
        return block_id
