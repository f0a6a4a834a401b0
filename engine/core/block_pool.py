"""A pool of fixed-size KV blocks: which are free, which hold a cached prefix, and how many owners each used block has.

Pure bookkeeping (no tensors): the device pool and the host swap pool are two instances. A block is in exactly one
of three states:

- **used**: held by ``ref_count`` block tables (more than one when requests share a cached prefix);
- **evictable**: held by none, but its contents are registered under a block hash (``register``), so a request
  with the same prefix can take it back (``touch``) instead of computing it again;
- **empty**: held by none and holding nothing anyone will look up.

Evictable blocks count as free: ``allocate`` takes empty blocks first and evicts the least recently freed
evictable block only when it must (a request's table is freed tail first, so the end of a prefix chain goes
before its beginning).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from engine.core.block_hash import BlockHash


class BlockPool:
    """``num_blocks`` block ids ``0 .. num_blocks-1``.

    ``allocate`` hands out free blocks (ref count 1) or returns None when there are not enough; it never hands out
    a used block.

    ``capacity`` is how many blocks may be resident at once: all of them, unless a cap (``set_capacity``, a VRAM
    cap fault) takes some away. Used and evictable blocks are resident: a cap evicts cached blocks before anything
    else, and ``num_over_capacity`` is what the block tables hold beyond it (the scheduler preempts until it is 0).
    ``num_free_blocks`` is what may still be allocated: empty blocks under the cap and every evictable one.
    """

    def __init__(self, num_blocks: int, name: str = "device") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.capacity = num_blocks
        self._empty: deque[int] = deque(range(num_blocks))
        # Least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: dict[int, BlockHash] = {}
        self._block_of_hash: dict[BlockHash, int] = {}
        # Cached blocks dropped to make room (an allocation or a cap), since the pool was made.
        self.num_evictions = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._empty) - len(self._evictable)

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.capacity - self.num_blocks + len(self._empty) + len(self._evictable))

    @property
    def num_over_capacity(self) -> int:
        return max(0, self.num_used_blocks - self.capacity)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, used or evictable."""
        return len(self._hash_of_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def evictable_hashes(self) -> tuple[BlockHash, ...]:
        """The hashes of the evictable blocks, the next to be evicted first."""
        return tuple(self._hash_of_block[block_id] for block_id in self._evictable)

    def set_capacity(self, capacity: int) -> None:
        if not 0 <= capacity <= self.num_blocks:
            raise ValueError(f"{self.name} pool capacity must be in [0, {self.num_blocks}], got {capacity}")
        self.capacity = capacity
        self._evict_to_capacity()

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of_block.get(block_id)

    def block_hashes(self, block_ids: Iterable[int]) -> tuple[BlockHash | None, ...]:
        """``block_hash`` of each (a snapshot asks it of every block of every running request)."""
        return tuple(map(self._hash_of_block.get, block_ids))

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block registered under ``block_hash``, used or evictable, if any."""
        return self._block_of_hash.get(block_hash)

    def allocate(self, num_blocks: int, beyond_capacity: bool = False) -> list[int] | None:
        """``num_blocks`` free blocks, or None; ``beyond_capacity``: any the pool really has, whatever a cap says
        (how a table held before the cap is restored)."""
        empty = self._empty
        resident = self.num_blocks - len(empty)  # used or evictable
        if resident + num_blocks <= self.capacity:  # most calls: empty blocks, within the capacity
            block_ids = [empty.popleft() for _ in range(num_blocks)]
        else:
            available = len(empty) + len(self._evictable) if beyond_capacity else self.num_free_blocks
            if num_blocks > available:
                return None
            # Empty blocks while the resident ones stay within the capacity; past it, a cached block is evicted for
            # each, so that the cache never holds more than the capacity allows.
            num_from_empty = min(num_blocks, len(empty) if beyond_capacity else max(0, self.capacity - resident))
            block_ids = [empty.popleft() for _ in range(num_from_empty)]
            block_ids.extend(self._evict_least_recent() for _ in range(num_blocks - num_from_empty))
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more owner on each block: a cached prefix reused (an evictable block becomes used again)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise ValueError(f"{self.name} block {block_id} is empty: only cached blocks can be reused")
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner from each block; a block with no owner left is evictable if it is registered, else
        empty. Pass a table tail first, so that its tail is evicted first."""
        # Every finished request's table comes through here, block by block: what it uses is looked up once.
        ref_counts, hashed, evictable, to_empty = self._ref_counts, self._hash_of_block, self._evictable, self._empty
        for block_id in block_ids:
            count = ref_counts[block_id]
            if count == 0:
                raise ValueError(f"{self.name} block {block_id} freed twice")
            ref_counts[block_id] = count - 1
            if count == 1:
                if block_id in hashed:
                    evictable[block_id] = None
                else:
                    to_empty.append(block_id)
        self._evict_to_capacity()

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Cache a used, full block's contents under ``block_hash``; False (nothing changes) if the block is
        registered already or another block holds that hash (the same prefix computed twice: the first stays)."""
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"{self.name} block {block_id} is not in use: only a block being filled can be cached")
        if block_id in self._hash_of_block or block_hash in self._block_of_hash:
            return False
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        return True

    def forget_cache(self) -> int:
        """Unregister every cached block (used ones stay with their owners; evictable ones become empty); returns
        how many were cached."""
        num_cached = len(self._hash_of_block)
        self._empty.extend(self._evictable)
        self._evictable.clear()
        self._hash_of_block.clear()
        self._block_of_hash.clear()
        return num_cached

    def _evict_least_recent(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of_hash[self._hash_of_block.pop(block_id)]
        self.num_evictions += 1
        return block_id

    def _evict_to_capacity(self) -> None:
        while self._evictable and self.num_used_blocks + len(self._evictable) > self.capacity:
            self._empty.append(self._evict_least_recent())

    def check_invariants(self, owners: Iterable[Iterable[int]]) -> None:
        """Raise ``AssertionError`` unless every block is empty, evictable or used exactly as ref-counted, the hash
        index matches, and cached blocks fit the capacity.

        ``owners`` is every block table that holds blocks of this pool.
        """
        counted = [0] * self.num_blocks
        for block_ids in owners:
            for block_id in block_ids:
                counted[block_id] += 1
        empty = set(self._empty)
        if len(empty) != len(self._empty):
            raise AssertionError(f"{self.name} pool: a block is in the empty queue twice")
        if empty & self._evictable.keys():
            raise AssertionError(
                f"{self.name} pool: blocks both empty and evictable: {sorted(empty & self._evictable.keys())}"
            )
        for block_id in range(self.num_blocks):
            state = "empty" if block_id in empty else "evictable" if block_id in self._evictable else "used"
            if counted[block_id] != self._ref_counts[block_id]:
                raise AssertionError(
                    f"{self.name} block {block_id}: ref count {self._ref_counts[block_id]} "
                    f"but {counted[block_id]} owners"
                )
            if (state == "used") != (counted[block_id] > 0):
                raise AssertionError(f"{self.name} block {block_id}: {state}, owners={counted[block_id]}")
            if (state == "empty") == (block_id in self._hash_of_block) and state != "used":
                raise AssertionError(
                    f"{self.name} block {block_id}: {state} but registered={block_id in self._hash_of_block}"
                )
        if {h: b for b, h in self._hash_of_block.items()} != self._block_of_hash:
            raise AssertionError(f"{self.name} pool: the hash index and the blocks' hashes disagree")
        if self._evictable and self.num_used_blocks + len(self._evictable) > self.capacity:
            raise AssertionError(
                f"{self.name} pool: {len(self._evictable)} evictable + {self.num_used_blocks} used blocks exceed "
                f"the capacity of {self.capacity}"
            )
