"""Block tables per request on top of the device and host block pools. No tensors here.

A request's block table covers its computed tokens plus the ones scheduled
this step; only its last block may be partly empty::

    tokens:  |0 ........ 15|16 ....... 31|32 .. 37 ....... |
    blocks:  [  block 7    ][  block 2   ][ block 9 (6/16) ]

Swapping moves a whole table between pools and returns the block-id pairs the
model runner copies; the manager never touches the data.
"""

from __future__ import annotations

from engine.core.block_pool import BlockPool


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Owns the device and host block tables of all requests.

    ``allocate_slots`` returns None when the device pool cannot satisfy the
    request (the only out-of-memory signal); the scheduler then preempts.
    """

    def __init__(self, device_pool: BlockPool, host_pool: BlockPool, block_size: int) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.block_size = block_size
        self.device_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}

    def block_ids(self, request_id: str) -> list[int]:
        return self.device_tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_total_tokens: int, num_reserved_blocks: int = 0) -> list[int] | None:
        """Grow the request's table to hold ``num_total_tokens`` tokens.

        Returns the newly added block ids (possibly none), or None, changing
        nothing, when that would leave fewer than ``num_reserved_blocks`` free.
        """
        table = self.device_tables.get(request_id)
        needed = num_blocks_for(num_total_tokens, self.block_size) - (len(table) if table is not None else 0)
        if needed <= 0:
            return []
        if self.device_pool.num_free_blocks - needed < num_reserved_blocks:
            return None
        new_block_ids = self.device_pool.allocate(needed)
        if new_block_ids is None:
            return None
        self.device_tables.setdefault(request_id, []).extend(new_block_ids)
        return new_block_ids

    def restore_table(self, request_id: str, num_blocks: int, on_device: bool) -> None:
        """Give a request ``num_blocks`` blocks of the device pool (or the host pool), whatever the capacity says: a
        table as a snapshot of another manager shows it (the forecast starts from one)."""
        pool, tables = (self.device_pool, self.device_tables) if on_device else (self.host_pool, self.host_tables)
        block_ids = pool.allocate(num_blocks, beyond_capacity=True)
        if block_ids is None:
            raise ValueError(f"{pool.name} pool of {pool.num_blocks} blocks cannot hold {num_blocks} more")
        tables.setdefault(request_id, []).extend(block_ids)

    def free(self, request_id: str) -> None:
        """Return every block the request holds, in either pool."""
        self.device_pool.free(self.device_tables.pop(request_id, []))
        self.host_pool.free(self.host_tables.pop(request_id, []))

    def can_swap_out(self, request_id: str) -> bool:
        return len(self.block_ids(request_id)) <= self.host_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table to the host pool; (device, host) block pairs, or None if the host is full."""
        return self._move_table(request_id, self.device_pool, self.device_tables, self.host_pool, self.host_tables)

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table back to the device pool; (host, device) pairs, or None if no room."""
        return self._move_table(request_id, self.host_pool, self.host_tables, self.device_pool, self.device_tables)

    @staticmethod
    def _move_table(
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
        src_pool.free(src_ids)
        dst_tables[request_id] = dst_ids
        return list(zip(src_ids, dst_ids, strict=True))

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self.host_tables.get(request_id, []))

    def check_invariants(self) -> None:
        """Both pools: every block free or owned exactly as ref-counted; free + used = total."""
        self.device_pool.check_invariants(self.device_tables.values())
        self.host_pool.check_invariants(self.host_tables.values())
        both = self.device_tables.keys() & self.host_tables.keys()
        if both:
            raise AssertionError(f"requests hold blocks in both pools: {sorted(both)}")
