from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool


def test_allocate_never_hands_out_a_used_block_and_refuses_when_short():
    pool = BlockPool(5)
    first = pool.allocate(3)
    second = pool.allocate(2)
    assert sorted(first + second) == [0, 1, 2, 3, 4]
    assert pool.allocate(1) is None
    pool.check_invariants([first, second])


def test_a_double_free_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([block])


def test_invariant_check_catches_a_leak_and_a_wrong_ref_count():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    with pytest.raises(AssertionError, match="ref count 1 but 0 owners"):
        pool.check_invariants([blocks[:1]])  # block blocks[1] is used but nobody owns it
    with pytest.raises(AssertionError, match="ref count 1 but 2 owners"):
        pool.check_invariants([blocks, blocks[:1]])


def cached_blocks(pool: BlockPool, names: str, reused: bool) -> list[int]:
    """Blocks cached under ``names`` (one character each), freed in that order; ``reused``: a second owner took
    each before it was freed, as a request that found the prefix cached does."""
    blocks = pool.allocate(len(names))
    for block, name in zip(blocks, names, strict=True):
        pool.register(block, name)
    if reused:
        pool.touch(blocks)
        pool.free(blocks)
    pool.free(blocks)
    return blocks


def test_blocks_a_second_owner_took_are_evicted_after_those_only_their_first_owner_held():
    pool = BlockPool(8)
    cached_blocks(pool, "ab", reused=True)  # a hot prefix, freed first
    cached_blocks(pool, "wxyz", reused=False)  # a one-off prompt, freed after it
    assert pool.evictable_hashes() == ("w", "x", "y", "z", "a", "b")  # next evicted first
    taken = pool.allocate(6)  # 2 empty blocks, then 4 evicted: the one-off's, though the hot ones are older
    assert [pool.cached_block(name) is not None for name in "abwxyz"] == [True, True, False, False, False, False]
    pool.check_invariants([taken])
    pool.free(taken)
    assert pool.allocate(8) is not None  # and the hot ones go when nothing else is left
    assert pool.num_cached_blocks == 0


def test_reused_blocks_past_half_the_capacity_are_evicted_as_one_off_ones_least_recently_freed_first():
    pool = BlockPool(8)
    cached_blocks(pool, "abcdef", reused=True)  # 6 reused blocks no one holds, where 4 may be
    cached_blocks(pool, "z", reused=False)
    assert pool.evictable_hashes() == ("a", "b", "z", "c", "d", "e", "f")
    pool.check_invariants([])
    assert pool.reused_hashes() == frozenset("cdef")
    held = pool.allocate(4)  # the empty block, then a, b and z
    assert {name for name in "abcdefz" if pool.cached_block(name) is None} == {"a", "b", "z"}
    pool.check_invariants([held])


def test_a_pool_restored_from_another_evicts_in_the_same_order():
    pool = BlockPool(8)
    cached_blocks(pool, "ab", reused=True)
    cached_blocks(pool, "xy", reused=False)
    (held,) = pool.allocate(1)
    pool.register(held, "h")
    pool.touch([held])
    copy = BlockPool(8)
    (copy_held,) = copy.allocate(1)
    copy.register(copy_held, "h")
    copy.restore_cache(pool.evictable_hashes(), pool.reused_hashes())
    assert (copy.evictable_hashes(), copy.reused_hashes()) == (("x", "y", "a", "b"), frozenset("abh"))
    copy.check_invariants([[copy_held]])
