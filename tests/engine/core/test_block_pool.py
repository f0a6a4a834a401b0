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
