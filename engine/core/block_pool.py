"""A pool of fixed-size KV blocks: which are free, and how many owners each used block has.

Pure bookkeeping (no tensors): the device pool and the host swap pool are two
instances. Each used block has one owner today; the ref counts are kept anyway, so
the invariant check catches a block that two block tables hold, and so sharing
(prefix reuse, copy-on-write) has its counts in place when it comes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """``num_blocks`` block ids ``0 .. num_blocks-1``.

    ``allocate`` hands out free blocks (ref count 1) or returns None when there
    are not enough; it never hands out a used block. Freed blocks go to the back
    of the free queue, so recently freed blocks are reused last.

    ``capacity`` is how many blocks may be in use at once: all of them, unless a
    cap (``set_capacity``, a VRAM cap fault) takes some away. Free blocks count
    against it: ``num_free_blocks`` is what may still be allocated, and
    ``num_over_capacity`` what the block tables hold beyond the cap (the scheduler
    preempts until it is 0).
    """

    def __init__(self, num_blocks: int, name: str = "device") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.capacity = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.capacity - self.num_used_blocks)

    @property
    def num_over_capacity(self) -> int:
        return max(0, self.num_used_blocks - self.capacity)

    def set_capacity(self, capacity: int) -> None:
        if not 0 <= capacity <= self.num_blocks:
            raise ValueError(f"{self.name} pool capacity must be in [0, {self.num_blocks}], got {capacity}")
        self.capacity = capacity

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int, beyond_capacity: bool = False) -> list[int] | None:
        """``num_blocks`` free blocks, or None; ``beyond_capacity``: any the pool really has, whatever a cap says
        (how a table held before the cap is restored)."""
        if num_blocks > (len(self._free) if beyond_capacity else self.num_free_blocks):
            return None
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner from each block; blocks with no owner left become free."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"{self.name} block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_invariants(self, owners: Iterable[Iterable[int]]) -> None:
        """Raise ``AssertionError`` unless every block is free xor owned exactly as ref-counted.

        ``owners`` is every block table that holds blocks of this pool.
        """
        counted = [0] * self.num_blocks
        for block_ids in owners:
            for block_id in block_ids:
                counted[block_id] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name} pool: a block is in the free queue twice")
        for block_id in range(self.num_blocks):
            if counted[block_id] != self._ref_counts[block_id]:
                raise AssertionError(
                    f"{self.name} block {block_id}: ref count {self._ref_counts[block_id]} "
                    f"but {counted[block_id]} owners"
                )
            if (block_id in free) != (counted[block_id] == 0):
                raise AssertionError(
                    f"{self.name} block {block_id}: free={block_id in free}, owners={counted[block_id]}"
                )
        num_referenced = sum(1 for count in self._ref_counts if count > 0)
        if len(free) + num_referenced != self.num_blocks:
            raise AssertionError(f"{self.name} pool: {len(free)} free + {num_referenced} used != {self.num_blocks}")
