"""A pool of fixed-size KV blocks: which are free, which hold a cached prefix, and how many owners each used block has.

Pure bookkeeping (no tensors): the device pool and the host swap pool are two instances. A block is in exactly one
of three states:

- **used**: held by ``ref_count`` block tables (more than one when requests share a cached prefix);
- **evictable**: held by none, but its contents are registered under a block hash (``register``), so a request
  with the same prefix can take it back (``touch``) instead of computing it again;
- **empty**: held by none and holding nothing anyone will look up.

Evictable blocks count as free: ``allocate`` takes empty blocks first and evicts a cached block only when it must.
Eviction is segmented, as a scan-resistant cache's is: blocks that only the request which computed them ever held go
first, least recently freed first; blocks that a second request took (``touch``: a prefix reused) go only when no
other is left, least recently freed first. So a flood of prompts that share nothing evicts its own blocks before the
hot prefixes it would otherwise push out, where plain LRU drops a hot prefix whenever the last flood request
finished after the prefix's last use. Reused blocks no one holds may fill half the capacity; past that the least
recently freed of them joins the others, so a hot set that went cold cannot keep new prefixes out for good. A
request's table is freed tail first, so the end of a prefix chain goes before its beginning.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence

from engine.core.block_hash import BlockHash

# The share of the capacity that reused cached blocks no request holds may fill before the least recently freed of
# them is demoted to the queue evicted first.
REUSED_SHARE_OF_CAPACITY = 0.5


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
        # Evictable blocks, least recently freed first: those only their first owner held (evicted first), and those
        # a second owner took.
        self._evictable_once: OrderedDict[int, None] = OrderedDict()
        self._evictable_reused: OrderedDict[int, None] = OrderedDict()
        # Cached blocks (used or evictable) that a second owner took since they were registered.
        self._reused: set[int] = set()
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: dict[int, BlockHash] = {}
        self._block_of_hash: dict[BlockHash, int] = {}
        # Cached blocks dropped to make room (an allocation or a cap), since the pool was made.
        self.num_evictions = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._empty) - self.num_evictable_blocks

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.capacity - self.num_blocks + len(self._empty) + self.num_evictable_blocks)

    @property
    def num_over_capacity(self) -> int:
        return max(0, self.num_used_blocks - self.capacity)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, used or evictable."""
        return len(self._hash_of_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable_once) + len(self._evictable_reused)

    def evictable_hashes(self) -> tuple[BlockHash, ...]:
        """The hashes of the evictable blocks, the next to be evicted first."""
        hash_of_block = self._hash_of_block
        return tuple(hash_of_block[block_id] for block_id in (*self._evictable_once, *self._evictable_reused))

    def reused_hashes(self) -> frozenset[BlockHash]:
        """The hashes of the cached blocks, held or evictable, that a second owner took."""
        hash_of_block = self._hash_of_block
        return frozenset(hash_of_block[block_id] for block_id in self._reused)

    def restore_cache(self, evictable: Sequence[BlockHash], reused: Collection[BlockHash]) -> None:
        """Take over another pool's cache as its ``evictable_hashes`` and ``reused_hashes`` show it, once the block
        tables are restored: ``evictable`` cached in blocks no one holds, the next to be evicted first, and
        ``reused`` (held or evictable) as taken by a second owner (the forecast starts from a snapshot)."""
        if len(evictable) > len(self._empty):
            raise ValueError(f"{self.name} pool of {self.num_blocks} blocks cannot hold the cached blocks")
        for block_hash in evictable:
            block_id = self._empty.popleft()
            self._hash_of_block[block_id] = block_hash
            self._block_of_hash[block_hash] = block_id
            (self._evictable_reused if block_hash in reused else self._evictable_once)[block_id] = None
        self._reused.update(block_id for block_id in map(self._block_of_hash.get, reused) if block_id is not None)
        self._evict_to_capacity()

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
            available = len(empty) + self.num_evictable_blocks if beyond_capacity else self.num_free_blocks
            if num_blocks > available:
                return None
            # Empty blocks while the resident ones stay within the capacity; past it, a cached block is evicted for
            # each, so that the cache never holds more than the capacity allows.
            num_from_empty = min(num_blocks, len(empty) if beyond_capacity else max(0, self.capacity - resident))
            block_ids = [empty.popleft() for _ in range(num_from_empty)]
            block_ids.extend(self._evict_next() for _ in range(num_blocks - num_from_empty))
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more owner on each block: a cached prefix reused (an evictable block becomes used again)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                queue = self._evictable_reused if block_id in self._reused else self._evictable_once
                if block_id not in queue:
                    raise ValueError(f"{self.name} block {block_id} is empty: only cached blocks can be reused")
                del queue[block_id]
            self._reused.add(block_id)
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner from each block; a block with no owner left is evictable if it is registered, else
        empty. Pass a table tail first, so that its tail is evicted first."""
        # Every finished request's table comes through here, block by block: what it uses is looked up once.
        ref_counts, hashed, reused, to_empty = self._ref_counts, self._hash_of_block, self._reused, self._empty
        once, reused_queue = self._evictable_once, self._evictable_reused
        for block_id in block_ids:
            count = ref_counts[block_id]
            if count == 0:
                raise ValueError(f"{self.name} block {block_id} freed twice")
            ref_counts[block_id] = count - 1
            if count == 1:
                if block_id in reused:
                    reused_queue[block_id] = None
                elif block_id in hashed:
                    once[block_id] = None
                else:
                    to_empty.append(block_id)
        self._demote_reused_past_share()
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
        for evictable in (self._evictable_once, self._evictable_reused):
            self._empty.extend(evictable)
            evictable.clear()
        self._reused.clear()
        self._hash_of_block.clear()
        self._block_of_hash.clear()
        return num_cached

    def _evict_next(self) -> int:
        """Drop the cached block next in line (one only its first owner held, else a reused one); its id."""
        block_id, _ = (self._evictable_once or self._evictable_reused).popitem(last=False)
        self._reused.discard(block_id)
        del self._block_of_hash[self._hash_of_block.pop(block_id)]
        self.num_evictions += 1
        return block_id

    def _demote_reused_past_share(self) -> None:
        reused, once = self._evictable_reused, self._evictable_once
        while len(reused) > REUSED_SHARE_OF_CAPACITY * self.capacity:
            block_id, _ = reused.popitem(last=False)
            self._reused.discard(block_id)
            once[block_id] = None

    def _evict_to_capacity(self) -> None:
        while self.num_evictable_blocks and self.num_used_blocks + self.num_evictable_blocks > self.capacity:
            self._empty.append(self._evict_next())
        self._demote_reused_past_share()

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
        once, reused = self._evictable_once.keys(), self._evictable_reused.keys()
        evictable = once | reused
        if empty & evictable or once & reused:
            raise AssertionError(f"{self.name} pool: blocks in two of the empty and evictable queues")
        if reused - self._reused or once & self._reused or not self._reused <= self._hash_of_block.keys():
            raise AssertionError(f"{self.name} pool: the reused blocks and the evictable queues disagree")
        if len(reused) > REUSED_SHARE_OF_CAPACITY * self.capacity:
            raise AssertionError(f"{self.name} pool: {len(reused)} reused evictable blocks, past their share")
        for block_id in range(self.num_blocks):
            state = "empty" if block_id in empty else "evictable" if block_id in evictable else "used"
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
        if self.num_evictable_blocks and self.num_used_blocks + self.num_evictable_blocks > self.capacity:
            raise AssertionError(
                f"{self.name} pool: {self.num_evictable_blocks} evictable + {self.num_used_blocks} used blocks exceed "
                f"the capacity of {self.capacity}"
            )
