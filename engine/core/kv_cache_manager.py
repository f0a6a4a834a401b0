"""Block tables per request on top of the device and host block pools. No tensors here.

A request's block table covers its computed tokens plus the ones scheduled
this step; only its last block may be partly empty::

    tokens:  |0 ........ 15|16 ....... 31|32 .. 37 ....... |
    blocks:  [  block 7    ][  block 2   ][ block 9 (6/16) ]

With prefix caching on, a table may begin with blocks other requests hold too: the longest prefix of the
request's full blocks that is cached (``cached_prefix``) is shared at admission instead of computed, and each
full block a request computes is registered for others (``register_computed_blocks``). Only full blocks are
shared, and a request never writes into a full block, so sharing needs no copy-on-write.

Swapping copies a whole table between pools and returns the block-id pairs the
model runner copies; the manager never touches the data. A shared block stays on the device for its other
owners while the swapped-out request keeps its own copy on the host.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.core.block_hash import BlockHash
from engine.core.block_pool import BlockPool


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class HashedRequest(Protocol):
    """What prefix caching reads of a request."""

    request_id: str
    num_computed_tokens: int
    # The hash of each full block of the tokens known so far (``engine.core.block_hash``).
    block_hashes: Sequence[BlockHash]

    @property
    def num_tokens(self) -> int: ...


@dataclass
class PrefixCacheCounts:
    """Since the manager was made: prompt tokens looked up at admission and how many of them were found cached."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class KVCacheManager:
    """Owns the device and host block tables of all requests.

    ``allocate_slots`` returns None when the device pool cannot satisfy the
    request (the only out-of-memory signal); the scheduler then preempts.
    """

    def __init__(
        self, device_pool: BlockPool, host_pool: BlockPool, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.device_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}
        # Per request, how many leading blocks of its device table have been offered to the cache already.
        self._num_offered: dict[str, int] = {}
        self.prefix_cache_counts = PrefixCacheCounts()

    def block_ids(self, request_id: str) -> list[int]:
        return self.device_tables.get(request_id, [])

    def cached_prefix(self, request: HashedRequest) -> list[int]:
        """The device blocks that hold the longest cached prefix of the request's tokens: full blocks only, and
        never its last token (it is computed again, so that there are logits to sample from). Empty with prefix
        caching off."""
        if not self.enable_prefix_caching:
            return []
        block_ids = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            block_id = self.device_pool.cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        num_reserved_blocks: int = 0,
        cached_block_ids: Sequence[int] = (),
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_total_tokens`` tokens, starting it with ``cached_block_ids`` (a
        ``cached_prefix`` of a request that holds no blocks yet).

        Returns the newly added block ids (possibly none), or None, changing
        nothing, when that would leave fewer than ``num_reserved_blocks`` free.
        """
        table = self.device_tables.get(request_id)
        num_held = len(table) if table is not None else 0
        needed = -(-num_total_tokens // self.block_size) - num_held - len(cached_block_ids)
        if not cached_block_ids:
            if needed <= 0:  # most calls: a decode within its last block
                return []
            if self.device_pool.num_free_blocks - needed < num_reserved_blocks:
                return None
            new_block_ids = self._allocate(needed)
            if table is None:
                self.device_tables[request_id] = new_block_ids[:]
            else:
                table.extend(new_block_ids)
            return new_block_ids
        if num_held:
            raise ValueError(f"request {request_id!r} holds blocks already: a cached prefix starts a table")
        needed = max(0, needed)
        # Taking back an evictable cached block costs a free block as much as a new one does.
        num_reused_free = sum(1 for block_id in cached_block_ids if self.device_pool.ref_count(block_id) == 0)
        if self.device_pool.num_free_blocks - needed - num_reused_free < num_reserved_blocks:
            return None
        self.device_pool.touch(cached_block_ids)
        new_block_ids = self._allocate(needed)
        self._num_offered[request_id] = len(cached_block_ids)
        self.device_tables[request_id] = [*cached_block_ids, *new_block_ids]
        return new_block_ids

    def append_blocks(self, request_ids: Sequence[str]) -> bool:
        """One more device block at the end of each request's table, in one allocation (decodes that each crossed
        into a new block); False, changing nothing, when the pool lacks them."""
        block_ids = self.device_pool.allocate(len(request_ids))
        if block_ids is None:
            return False
        tables = self.device_tables
        for request_id, block_id in zip(request_ids, block_ids, strict=True):
            tables[request_id].append(block_id)
        return True

    def _allocate(self, num_blocks: int) -> list[int]:
        block_ids = self.device_pool.allocate(num_blocks)
        if block_ids is None:
            raise AssertionError("the free count said the blocks were there")
        return block_ids

    def register_computed_blocks(self, request: HashedRequest) -> None:
        """Offer the cache every full block the request has computed since the last call (a no-op with prefix
        caching off); one whose prefix is cached already stays the request's own."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        table = self.device_tables.get(request_id)
        if not table:
            return
        start = self._num_offered.get(request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(table))
        if end <= start:  # most calls: no block filled since the last
            return
        register, block_hashes = self.device_pool.register, request.block_hashes
        for index in range(start, end):
            register(table[index], block_hashes[index])
        self._num_offered[request_id] = end

    def count_admission(self, num_tokens: int, num_hit_tokens: int) -> None:
        """A request admitted with ``num_hit_tokens`` of its ``num_tokens`` found cached (nothing with caching off)."""
        if self.enable_prefix_caching:
            self.prefix_cache_counts.queried_tokens += num_tokens
            self.prefix_cache_counts.hit_tokens += num_hit_tokens

    def table_hashes(self, request_id: str) -> tuple[BlockHash | None, ...]:
        """The hash each block of the request's device table is cached under (None: not cached)."""
        return self.device_pool.block_hashes(self.block_ids(request_id))

    def restore_table(
        self, request: HashedRequest, num_blocks: int, on_device: bool, table_hashes: Sequence[BlockHash | None] = ()
    ) -> None:
        """Give a request ``num_blocks`` blocks of the device pool (or the host pool), whatever the capacity says: a
        table as a snapshot of another manager shows it (the forecast starts from one). ``table_hashes`` (device
        only): the hash each block is cached under, or None; blocks under the same hash are one shared block."""
        pool, tables = (self.device_pool, self.device_tables) if on_device else (self.host_pool, self.host_tables)
        hashes = [*table_hashes[:num_blocks], *[None] * (num_blocks - len(table_hashes))]
        cached_block = pool.cached_block
        shared = [None if block_hash is None else cached_block(block_hash) for block_hash in hashes]
        # The blocks it does not share, in one allocation (a forecast restores tables before any cached block no one
        # holds, so none is evicted for them).
        fresh = pool.allocate(shared.count(None), beyond_capacity=True)
        if fresh is None:
            raise ValueError(f"{pool.name} pool of {pool.num_blocks} blocks cannot hold {num_blocks} blocks more")
        pool.touch(block_id for block_id in shared if block_id is not None)
        fresh_ids = iter(fresh)
        table = tables.setdefault(request.request_id, [])
        for block_hash, block_id in zip(hashes, shared, strict=True):
            if block_id is None:
                block_id = next(fresh_ids)
                if block_hash is not None:
                    pool.register(block_id, block_hash)
            table.append(block_id)
        if on_device:
            self._num_offered[request.request_id] = min(
                request.num_computed_tokens // self.block_size, len(request.block_hashes), num_blocks
            )

    def restore_cache(self, evictable: Sequence[BlockHash], reused: Collection[BlockHash]) -> None:
        """Once the tables are restored, the device pool's cache as another's ``BlockPool.evictable_hashes`` and
        ``reused_hashes`` show it."""
        self.device_pool.restore_cache(evictable, reused)

    def free(self, request_id: str) -> None:
        """Return every block the request holds, in either pool (a device table tail first: its tail is evicted
        first)."""
        self.device_pool.free(reversed(self.device_tables.pop(request_id, [])))
        self.host_pool.free(self.host_tables.pop(request_id, []))
        self._num_offered.pop(request_id, None)

    def can_swap_out(self, request_id: str) -> bool:
        return len(self.block_ids(request_id)) <= self.host_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Copy the request's table to the host pool and drop its device blocks (a shared one stays for its other
        owners); (device, host) block pairs, or None if the host is full."""
        return self._move_table(request_id, self.device_pool, self.device_tables, self.host_pool, self.host_tables)

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table back into new device blocks (offered to the cache again as the request's next
        step completes); (host, device) pairs, or None if no room."""
        return self._move_table(request_id, self.host_pool, self.host_tables, self.device_pool, self.device_tables)

    def _move_table(
        self,
        request_id: str,
        src_pool: BlockPool,
        src_tables: dict[str, list[int]],
        dst_pool: BlockPool,
        dst_tables: dict[str, list[int]],
    ) -> list[tuple[int, int]] | None:
        src_ids = src_tables.get(request_id, [])
        dst_ids = dst_pool.allocate(len(src_ids))
        if dst_ids is None:
            return None
        src_tables.pop(request_id, None)
        src_pool.free(reversed(src_ids))
        dst_tables[request_id] = dst_ids
        # The blocks are new ones: none of them has been offered to the cache yet.
        self._num_offered.pop(request_id, None)
        return list(zip(src_ids, dst_ids, strict=True))

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self.host_tables.get(request_id, []))

    def check_invariants(self) -> None:
        """Both pools: every block empty, evictable or owned exactly as ref-counted; the hash index consistent."""
        self.device_pool.check_invariants(self.device_tables.values())
        self.host_pool.check_invariants(self.host_tables.values())
        both = self.device_tables.keys() & self.host_tables.keys()
        if both:
            raise AssertionError(f"requests hold blocks in both pools: {sorted(both)}")
