"""The run-time faults' values (``FaultValues``: checked whole, bounded) and the bounds they stay within, so that none
can overflow a sleep or a timer or wedge the engine loop: the engine's faults (``engine.faults``), the serving loop's
freeze (``engine.serving.async_engine``) and the simulator (``engine.core.simulator``) share them.

It is also the fault contract's one source beyond kvstorm: the vLLM plugin (``plugins/vllm``) ships this very file,
so ``/admin/faults`` bodies (``parse_fault_request``), bounds and lease (``FaultLease``) are the same in both. It
imports nothing of kvstorm at run time for that reason.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.block_pool import BlockPool

MAX_DELAY_S = 60.0  # each delay fault, one block move's whole delay, and the freeze of the loop
DELAY_SLICE_S = 0.05  # a delay re-reads its fault this often, so a clear ends it within one slice
MAX_COUNT = 10**9  # oom_above_batched_tokens, fail_next_steps
MAX_MEMORY_HOG_BYTES = 2**40
MAX_LEASE_S = 24 * 3600
logger = logging.getLogger(__name__)


def sleep_while_wanted(wanted_s: Callable[[], float]) -> None:
    """Sleep until ``wanted_s()`` seconds have passed since the call, asking again every slice (a fault cleared from
    another thread ends the sleep within ``DELAY_SLICE_S``)."""
    start = time.monotonic()
    while (left_s := wanted_s() - (time.monotonic() - start)) > 0:
        time.sleep(min(left_s, DELAY_SLICE_S))


def parse_seconds(name: str, value: object) -> float:
    """A delay's value: a finite number of seconds in [0, ``MAX_DELAY_S``]; ``ValueError`` naming it otherwise."""
    if type(value) not in (int, float) or not 0 <= value <= MAX_DELAY_S:  # NaN and the infinities fail the range
        raise ValueError(f"{name} must be a number of seconds in [0, {MAX_DELAY_S:g}], got {value!r}")
    return float(value)


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
class FaultValues:
    """Every run-time fault's value (``engine.faults`` raises them in the engine; ``engine.core.simulator`` in virtual
    time). ``None`` or 0: off."""

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

    def take_step_failure(self, num_batched_tokens: int) -> str | None:
        """Whether a step of ``num_batched_tokens`` runs out of memory, and why (``fail_next_steps`` counts it)."""
        if self.fail_next_steps > 0:
            self.fail_next_steps -= 1
            return f"injected: out of memory in a step of {num_batched_tokens} tokens"
        cap = self.oom_above_batched_tokens
        if cap is not None and num_batched_tokens > cap:
            return f"injected VRAM cap: a step of {num_batched_tokens} tokens, room for {cap}"
        return None

    def cap_pools(self, device_pool: BlockPool, host_pool: BlockPool) -> None:
        """Each pool's usable blocks as its cap says (all of them without one); blocks in use above a cap are the
        scheduler's to reclaim."""
        for pool, cap in ((device_pool, self.kv_cap), (host_pool, self.swap_cap)):
            pool.set_capacity(pool.num_blocks if cap is None else cap.num_blocks(pool.num_blocks))

    def block_moves_delay_s(self, num_blocks: int) -> float:
        """How much longer a move of ``num_blocks`` blocks takes (one move waits ``MAX_DELAY_S`` at most)."""
        return min(MAX_DELAY_S, self.swap_delay_per_block * num_blocks)


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


FAULT_NAMES = (*FaultValues.names(), "freeze")  # the engine's faults and the serving loop's own


class FaultRequestError(ValueError):
    """A ``POST /admin/faults`` body that is refused whole (a 400); ``param``: the name at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_fault_request(body: object) -> tuple[dict[str, object], float | None]:
    """A decoded ``POST /admin/faults`` body: the faults it asks to change (names checked, values not yet) and its
    lease (None: no lease). Names are checked before anything uses them as keyword arguments, where "self" or
    "function" would bind another one."""
    if not isinstance(body, dict):
        raise FaultRequestError("the body must be a JSON object of faults")
    changes = dict(body)
    lease_s = changes.pop("lease_s", None)
    unknown = [name for name in changes if name not in FAULT_NAMES]
    if unknown:
        raise FaultRequestError(f"unknown fault {unknown[0]!r}; faults: {', '.join(FAULT_NAMES)}, lease_s", unknown[0])
    if lease_s is not None and (type(lease_s) not in (int, float) or not 0 < lease_s <= MAX_LEASE_S):
        raise FaultRequestError(f"lease_s must be a number of seconds in (0, {MAX_LEASE_S}], got {lease_s!r}")
    return changes, lease_s


class FaultLease:
    """Clears every fault when the lease runs out; ``renew`` restarts it, ``cancel`` ends it. A harness that dies in
    the middle of an experiment so leaves no fault behind."""

    def __init__(self, clear_faults: Callable[[], object]) -> None:
        self._clear_faults = clear_faults
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._expires_ts: float | None = None

    def renew(self, lease_s: float) -> None:
        with self._lock:
            self._cancel_timer()
            self._timer = threading.Timer(lease_s, self._expire)
            self._timer.daemon = True
            self._expires_ts = time.monotonic() + lease_s
            self._timer.start()

    def cancel(self) -> None:
        with self._lock:
            self._cancel_timer()

    @property
    def remaining_s(self) -> float | None:
        expires = self._expires_ts
        return None if expires is None else max(0.0, expires - time.monotonic())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._expires_ts = None

    def _expire(self) -> None:
        with self._lock:
            self._timer = self._expires_ts = None
        logger.warning("the fault lease ran out without renewal: clearing every fault")
        self._clear_faults()
