"""Faults the chaos harness turns on at run time (``/admin/faults``), each raised where the real one happens.

=========================  ===============================  ==========================================================
fault                      value                            what a real system would see
=========================  ===============================  ==========================================================
``kv_cap``                 ``{"blocks": N}`` or             VRAM taken by a co-tenant or a fragmented allocator: the
                           ``{"fraction": F}``              usable device KV pool shrinks; blocks in use above the cap
                                                            are reclaimed by preemption in the next steps
``swap_cap``               the same                         less pinned host memory: the usable swap pool shrinks, and
                                                            a swap that no longer fits falls back to recompute
``swap_delay_per_block``   seconds, [0, 60]                 a congested host link: each block moved takes longer (one
                                                            move waits 60 s at most, however many blocks it moves)
``step_delay``             seconds, [0, 60]                 a slow or throttled device: each step takes longer
``oom_above_batched_tokens``  tokens, [0, 10**9]            activations that no longer fit: a larger step raises
                                                            ``torch.OutOfMemoryError`` before its forward pass
``fail_next_steps``        count, [0, 10**9]                the next N steps raise ``torch.OutOfMemoryError``
``memory_hog``             bytes, [0, 2**40]                device memory held outside the engine (CUDA only)
=========================  ===============================  ==========================================================

Out-of-memory errors are raised from the model runner just before a step's forward pass, where a device that ran
out of memory raises them, so the engine's recovery (``engine.core.step_back_off``) is the code a real one meets.
``null`` (or 0) turns a fault off. An update is validated whole before any of it applies; every value is finite and
bounded, so none can overflow a sleep or a timer. The delays sleep in slices of ``DELAY_SLICE_S`` and re-read their
fault between slices: ``cut_delays`` (from any thread, without the engine's lock) ends one within a slice, so a
clear or a lease expiry is not stuck behind a long sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from engine.core.fault_limits import DELAY_SLICE_S, MAX_COUNT, MAX_DELAY_S, MAX_MEMORY_HOG_BYTES, parse_seconds
from engine.core.outputs import SchedulerOutput


@dataclass(frozen=True)
class PoolCap:
    """A cap on a block pool: a number of its blocks or a fraction of them."""

    blocks: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, name: str, value: object) -> PoolCap:
        if not isinstance(value, dict) or len(value) != 1 or not value.keys() <= {"blocks", "fraction"}:
            raise ValueError(f'{name} must be {{"blocks": N}} or {{"fraction": F}} or null, got {value!r}')
        blocks, fraction = value.get("blocks"), value.get("fraction")
        if "blocks" in value and (type(blocks) is not int or blocks < 0):
            raise ValueError(f"{name}.blocks must be an integer >= 0, got {blocks!r}")
        if "fraction" in value and (type(fraction) not in (int, float) or not 0 <= fraction <= 1):
            raise ValueError(f"{name}.fraction must be a number in [0, 1], got {fraction!r}")
        return cls(blocks=blocks, fraction=None if fraction is None else float(fraction))

    def num_blocks(self, pool_size: int) -> int:
        """How many of a pool of ``pool_size`` blocks stay usable."""
        if self.blocks is not None:
            return min(self.blocks, pool_size)
        return min(pool_size, math.floor(self.fraction * pool_size))

    def to_json(self) -> dict[str, float]:
        return {"blocks": self.blocks} if self.blocks is not None else {"fraction": self.fraction}


@dataclass
class EngineFaults:
    kv_cap: PoolCap | None = None
    swap_cap: PoolCap | None = None
    swap_delay_per_block: float = 0.0
    step_delay: float = 0.0
    oom_above_batched_tokens: int | None = None
    fail_next_steps: int = 0
    memory_hog: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def validated(self, changes: dict[str, object]) -> dict[str, object]:
        """``changes`` checked and converted; ``ValueError`` names the first bad fault and why."""
        parsed = {}
        for name, value in changes.items():
            if name not in self.names():
                raise ValueError(f"unknown fault {name!r}; faults: {', '.join(self.names())}")
            parsed[name] = _parse(name, value)
        return parsed

    def apply(self, parsed: dict[str, object]) -> None:
        """Set values that ``validated`` returned."""
        for name, value in parsed.items():
            setattr(self, name, value)

    def to_json(self) -> dict[str, object]:
        return {
            name: value.to_json() if isinstance(value, PoolCap) else value
            for name in self.names()
            for value in [getattr(self, name)]
        }

    def active(self) -> dict[str, bool]:
        return {name: getattr(self, name) not in (None, 0) for name in self.names()}

    # ---- where the runner raises them ----------------------------------------------------------

    def cut_delays(self) -> None:
        """End the delays now, a sleep in progress included (within a slice). Safe from any thread: two float
        stores, which the sleeping thread re-reads."""
        self.step_delay = 0.0
        self.swap_delay_per_block = 0.0

    def before_forward(self, output: SchedulerOutput) -> None:
        """The step's slowness, then its out-of-memory faults."""
        if self.step_delay:
            _sleep_while_wanted(lambda: self.step_delay)
        if self.fail_next_steps > 0:
            self.fail_next_steps -= 1
            raise torch.OutOfMemoryError(f"injected: out of memory in a step of {output.num_batched_tokens} tokens")
        cap = self.oom_above_batched_tokens
        if cap is not None and output.num_batched_tokens > cap:
            raise torch.OutOfMemoryError(
                f"injected VRAM cap: a step of {output.num_batched_tokens} tokens, room for {cap}"
            )

    def delay_block_moves(self, num_blocks: int) -> None:
        if self.swap_delay_per_block and num_blocks:
            _sleep_while_wanted(lambda: min(MAX_DELAY_S, self.swap_delay_per_block * num_blocks))


def _sleep_while_wanted(wanted_s: Callable[[], float]) -> None:
    """Sleep until ``wanted_s()`` seconds have passed since the call, asking again every slice."""
    start = time.monotonic()
    while (left_s := wanted_s() - (time.monotonic() - start)) > 0:
        time.sleep(min(left_s, DELAY_SLICE_S))


def _parse(name: str, value: object) -> object:
    if name in ("kv_cap", "swap_cap"):
        return None if value is None else PoolCap.parse(name, value)
    if name in ("swap_delay_per_block", "step_delay"):
        return parse_seconds(name, value)
    if name == "oom_above_batched_tokens" and value is None:
        return None
    maximum = MAX_MEMORY_HOG_BYTES if name == "memory_hog" else MAX_COUNT
    if type(value) is not int or not 0 <= value <= maximum:
        or_null = " or null" if name == "oom_above_batched_tokens" else ""
        raise ValueError(f"{name} must be an integer in [0, {maximum}]{or_null}, got {value!r}")
    return value
