"""The KV block pool: exact ids handed out, taken back, never more than it was built with."""

import random

import pytest

from engine.kv.block_pool import BlockPool


def take(pool: BlockPool, owner: str, num_tokens: int) -> list[int]:
    blocks: list[int] = []
    assert pool.grow(owner, blocks, num_tokens)
    return blocks


def owners(pool: BlockPool) -> list[str | None]:
    return [pool.owner_of(i) for i in range(pool.num_blocks)]


def test_a_fresh_pool_hands_out_the_lowest_ids_in_order():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert take(pool, "a", 5) == [0, 1]
    assert take(pool, "b", 4) == [2]
    assert take(pool, "c", 1) == [3]
    assert owners(pool) == ["a", "a", "b", "c", None, None, None, None]
    assert (pool.num_free, pool.num_used) == (4, 4)


def test_a_question_continues_right_after_its_last_block_when_that_block_is_free():
    pool = BlockPool(num_blocks=8, block_size=4)
    a, b, c = take(pool, "a", 4), take(pool, "b", 4), take(pool, "c", 4)
    pool.release("a", a)  # block 0 is free and lower, but c's neighbour 3 keeps c's cache contiguous
    assert pool.grow("c", c, 8)
    assert c == [2, 3]
    assert pool.grow("c", c, 16)  # two more at once, still right behind
    assert c == [2, 3, 4, 5]
    assert b == [1]
    assert owners(pool) == [None, "b", "c", "c", "c", "c", None, None]


def test_when_the_neighbour_is_taken_the_growth_goes_to_the_first_contiguous_run():
    pool = BlockPool(num_blocks=10, block_size=2)
    a, b, c, d = (take(pool, name, 2) for name in "abcd")  # a=[0] b=[1] c=[2] d=[3]
    pool.release("b", b)
    pool.release("d", d)  # free: 1, 3..9
    assert pool.grow("a", a, 8)  # three more: 1,2,3 is not free, the first free run of three is 3,4,5
    assert a == [0, 3, 4, 5]
    assert c == [2]


def test_a_contiguous_run_beats_lower_scattered_ids():
    pool = BlockPool(num_blocks=6, block_size=4)
    held = {name: take(pool, name, 4) for name in "abcd"}  # a=[0] b=[1] c=[2] d=[3]
    for name in "acd":
        pool.release(name, held[name])  # free: 0, 2, 3, 4, 5
    assert take(pool, "e", 8) == [2, 3]
    assert take(pool, "f", 4) == [0]  # a single block: the first free one


def test_without_a_contiguous_run_the_lowest_free_ids_are_used():
    pool = BlockPool(num_blocks=5, block_size=4)
    held = {name: take(pool, name, 4) for name in "abcde"}  # a..e = [0]..[4]
    for name in "ace":
        pool.release(name, held[name])  # free: 0, 2, 4 — no two adjacent
    assert take(pool, "f", 8) == [0, 2]
    pool.release("f", [0, 2])
    assert take(pool, "g", 12) == [0, 2, 4]
    assert pool.num_free == 0


def test_fragmented_growth_of_an_existing_question_takes_the_lowest_free_ids():
    pool = BlockPool(num_blocks=6, block_size=1)
    held = {name: take(pool, name, 1) for name in "abcdef"}  # one block each, in order
    for name in "bdf":
        pool.release(name, held[name])  # free: 1, 3, 5
    a = held["a"]
    assert pool.grow("a", a, 3)  # 1 right behind a is free but 2 is not, no run of two: lowest ids
    assert a == [0, 1, 3]


def test_grow_when_short_returns_false_and_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    a = take(pool, "a", 12)  # [0, 1, 2]
    b: list[int] = []
    assert not pool.grow("b", b, 5)  # needs 2, one is free
    assert b == []
    assert pool.num_free == 1
    assert owners(pool) == ["a", "a", "a", None]
    assert not pool.grow("a", a, 20)  # needs 2 more, one is free
    assert a == [0, 1, 2]
    assert owners(pool) == ["a", "a", "a", None]


def test_grow_that_already_fits_takes_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    a = take(pool, "a", 5)
    for num_tokens in (0, 1, 5, 8):
        assert pool.grow("a", a, num_tokens)
        assert a == [0, 1]
    assert pool.num_free == 2


def test_grow_to_exactly_the_whole_pool_succeeds():
    pool = BlockPool(num_blocks=3, block_size=4)
    assert take(pool, "a", 12) == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (0, 3)
    assert not pool.grow("b", [], 1)


def test_release_returns_every_block_and_empties_the_list():
    pool = BlockPool(num_blocks=6, block_size=4)
    a = take(pool, "a", 9)
    b = take(pool, "b", 4)
    pool.release("a", a)
    assert a == []
    assert pool.num_free == 5
    assert owners(pool) == [None, None, None, "b", None, None]
    assert take(pool, "c", 12) == [0, 1, 2]  # the freed blocks are handed out again
    assert b == [3]


def test_release_of_an_empty_list_is_a_no_op():
    pool = BlockPool(num_blocks=2, block_size=4)
    blocks: list[int] = []
    pool.release("a", blocks)
    assert pool.num_free == 2


def test_releasing_someone_elses_block_raises_and_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    a = take(pool, "a", 8)  # [0, 1]
    b = take(pool, "b", 4)  # [2]
    stolen = [0, 1, 2]
    with pytest.raises(RuntimeError, match="owned by 'b'"):
        pool.release("a", stolen)
    assert stolen == [0, 1, 2]
    assert owners(pool) == ["a", "a", "b", None]
    assert pool.num_free == 1
    with pytest.raises(RuntimeError, match="owned by None"):
        pool.release("a", [3])  # a free block belongs to nobody
    assert pool.num_free == 1
    assert a == [0, 1] and b == [2]


def test_releasing_the_same_block_twice_raises():
    pool = BlockPool(num_blocks=2, block_size=4)
    a = take(pool, "a", 4)
    again = list(a)
    pool.release("a", a)
    with pytest.raises(RuntimeError):
        pool.release("a", again)
    assert pool.num_free == 2


def test_the_pool_never_grows_or_shrinks_under_random_use():
    rng = random.Random(1234)
    pool = BlockPool(num_blocks=16, block_size=4)
    held: dict[str, list[int]] = {f"q{i}": [] for i in range(6)}
    for _ in range(3000):
        owner = rng.choice(sorted(held))
        blocks = held[owner]
        if rng.random() < 0.3:
            pool.release(owner, blocks)
        else:
            before = list(blocks)
            grew = pool.grow(owner, blocks, rng.randint(0, 40))
            assert blocks[: len(before)] == before  # growth only appends
            if not grew:
                assert blocks == before
        assert pool.num_free + pool.num_used == pool.num_blocks == 16
        ids = [i for blocks in held.values() for i in blocks]
        assert len(ids) == len(set(ids)) == pool.num_used
        assert all(0 <= i < 16 for i in ids)
        for name, blocks in held.items():
            assert all(pool.owner_of(i) == name for i in blocks)


@pytest.mark.parametrize(("num_tokens", "blocks"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_for_rounds_up_to_whole_blocks(num_tokens, blocks):
    assert BlockPool(num_blocks=4, block_size=4).blocks_for(num_tokens) == blocks


def test_blocks_for_with_block_size_one_is_the_token_count():
    assert BlockPool(num_blocks=4, block_size=1).blocks_for(7) == 7


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_an_empty_pool_is_refused(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)
