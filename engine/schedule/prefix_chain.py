"""A question's prefix chain: which of its leading blocks it can read from the cache, which it fills.

The glue between a Sequence and the pool's prefix cache, kept out of the scheduler's step logic.
Pure Python, no torch.
"""

from __future__ import annotations

from engine.kv.block_pool import BlockPool
from engine.kv.prefix_cache import chain_hashes
from engine.sequence import Sequence


def cached_blocks(pool: BlockPool, seq: Sequence) -> list[int]:
    """The cached blocks of `seq`'s leading full prompt blocks; never all its tokens (the last draws)."""
    if seq.cache_salt is None:  # isolation.level: strict
        return []
    if seq.prefix_hashes is None:
        seq.prefix_hashes = chain_hashes(seq.cache_salt, seq.prompt_ids, pool.block_size)
    usable = min(len(seq.prefix_hashes), (seq.num_tokens - 1) // pool.block_size)
    return pool.lookup(seq.prefix_hashes[:usable])


def blocks_in_flight(running: list[Sequence]) -> set[bytes]:
    """Hashes of prompt blocks that running questions are computing and will name once filled."""
    return {h for seq in running if seq.prefix_hashes for h in seq.prefix_hashes[seq.num_registered:]}


def awaits_prefix(pool: BlockPool, seq: Sequence, cached: list[int], in_flight: set[bytes]) -> bool:
    """True when the next block `seq` would compute is being computed by a running question.

    Then `seq` waits a step or two and reads it, instead of computing the same prefix a second time
    (what happens when many questions on one system prompt arrive together).
    """
    if not seq.prefix_hashes:
        return False
    usable = min(len(seq.prefix_hashes), (seq.num_tokens - 1) // pool.block_size)
    return len(cached) < usable and seq.prefix_hashes[len(cached)] in in_flight


def name_filled_blocks(pool: BlockPool, seq: Sequence) -> None:
    """Cache the prompt blocks `seq` has filled so far (call after each forward).

    Only prompt blocks: deterministic mode computes a generated token's K/V along the decode path,
    which another question, reading the same tokens as its prompt, would not take; so serving them
    could change its bits.
    """
    hashes = seq.prefix_hashes
    if not hashes or seq.num_registered >= len(hashes):
        return
    filled = min(seq.num_computed_tokens // pool.block_size, len(hashes))
    for i in range(seq.num_registered, filled):
        if not pool.register(seq.block_ids[i], hashes[i]):
            # Computed twice at once (both missed the cache): the other copy is the cached one, and
            # the rest of this chain stays private, so a question's shared blocks are always a leading run.
            seq.num_registered = len(hashes)
            return
    seq.num_registered = filled


def shared_chain(pool: BlockPool, seq: Sequence) -> list[bytes]:
    """Hashes of `seq`'s leading blocks cached under its own chain: read-only, possibly shared."""
    chain = []
    for block_id, block_hash in zip(seq.block_ids, seq.prefix_hashes or ()):
        if pool.cache.hash_of(block_id) != block_hash:
            break
        chain.append(block_hash)
    return chain
