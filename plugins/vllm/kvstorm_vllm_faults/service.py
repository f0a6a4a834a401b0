"""kvstorm's fault contract as state that two threads share: the HTTP threads record the faults the harness wants,
and the engine core's own thread reads them at its step boundaries and acts (``engine_core``). Nothing here touches
vLLM, so the contract is testable beside kvstorm's own server without it.

The answer to every call is kvstorm's (``engine/serving/admin.py``): every fault's value, ``freeze`` (seconds left or
null), ``active`` (the names of those on) and ``lease_s`` (left, or null), plus two keys of the plugin's own:
``not_applicable`` (fault name -> why vLLM cannot have it) and ``engine`` (what the engine core last published: its
KV blocks, those the faults hold).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvstorm_vllm_faults.fault_limits import FaultLease, FaultValues, PoolCap, parse_seconds

NO_SWAP = (
    "vLLM v1 has no swap: it preempts by recompute, freeing the blocks, and keeps no host KV pool whose size or copy "
    "speed a fault could change"
)
NO_MEMORY_HOG = (
    "the plugin takes no device memory: vLLM sized its KV pool at start-up, so memory taken now would only squeeze "
    "activations (oom_above_batched_tokens raises that out-of-memory error) and kv_cap takes KV blocks away"
)


def not_applicable_faults(kv_connector: str | None) -> dict[str, str]:
    """Fault name -> why a vLLM v1 engine core cannot have it; ``kv_connector``: the KV connector vLLM runs, if any
    (KV offloading), which the plugin does not act on."""
    no_swap = NO_SWAP
    if kv_connector is not None:
        no_swap += f" (its KV connector {kv_connector} is on; the plugin does not act on it)"
    return {"swap_cap": no_swap, "swap_delay_per_block": no_swap, "memory_hog": NO_MEMORY_HOG}


class FaultNotApplicable(Exception):
    """A fault this server cannot have, or a plugin that refused to start: a 501 naming the fault (if one) and why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class FaultService:
    """The faults wanted now, the freeze, the lease and the engine's last published state.

    ``update``/``clear`` come from HTTP threads (validated whole before any applies: ``ValueError`` is a 400,
    ``FaultNotApplicable`` a 501, and then nothing changed); after each, ``wake`` asks the engine core to act even if
    it is idle. The ``wanted_*`` and ``take_step_failure`` calls come from the engine core's thread."""

    def __init__(self, not_applicable: dict[str, str], wake: Callable[[], None]) -> None:
        self.not_applicable = dict(not_applicable)
        self._wake = wake
        self._lock = threading.Lock()
        self._values = FaultValues()
        self._frozen_until_ts: float | None = None
        self._engine: dict[str, Any] = {}
        self.lease = FaultLease(self.clear)

    # ---- the HTTP side ----------------------------------------------------------------------

    def answer(self) -> dict[str, Any]:
        with self._lock:
            freeze_s = self._freeze_left_s()
            active = [name for name, on in self._values.active().items() if on] + ["freeze"] * (freeze_s is not None)
            return {
                **self._values.to_json(),
                "freeze": freeze_s,
                "active": sorted(active),
                "lease_s": self.lease.remaining_s,
                "not_applicable": dict(self.not_applicable),
                "engine": dict(self._engine),
            }

    def update(self, changes: dict[str, object]) -> dict[str, Any]:
        """Change some faults (names already checked: ``fault_limits.parse_fault_request``); kvstorm's order of
        checks: the freeze, then the engine's faults, then (the plugin's own) whether vLLM can have them."""
        changes = dict(changes)
        freeze = {"freeze": changes.pop("freeze")} if "freeze" in changes else {}
        freeze_s = parse_seconds("freeze", 0 if freeze.get("freeze") is None else freeze["freeze"])
        with self._lock:
            parsed = self._values.validated(changes)
            self._refuse_not_applicable(parsed)
            self._values.apply(parsed)
            if freeze:
                self._frozen_until_ts = time.monotonic() + freeze_s if freeze_s > 0 else None
        self._wake()
        return self.answer()

    def clear(self) -> dict[str, Any]:
        """Every fault off, the freeze ended (a sleep in progress ends within a slice)."""
        with self._lock:
            self._values = FaultValues()
            self._frozen_until_ts = None
        self._wake()
        return self.answer()

    def _refuse_not_applicable(self, parsed: dict[str, object]) -> None:
        for name, value in parsed.items():
            if name in self.not_applicable and value not in (None, 0):  # turning one off is always possible
                raise FaultNotApplicable(f"{name} is NOT APPLICABLE to this server: {self.not_applicable[name]}", name)

    def _freeze_left_s(self) -> float | None:
        until = self._frozen_until_ts
        left_s = None if until is None else until - time.monotonic()
        return left_s if left_s is not None and left_s > 0 else None

    # ---- the engine core's side -------------------------------------------------------------

    def wanted_kv_cap(self) -> PoolCap | None:
        return self._values.kv_cap

    def wanted_step_delay_s(self) -> float:
        return self._values.step_delay

    def freeze_left_s(self) -> float | None:
        with self._lock:
            return self._freeze_left_s()

    def take_step_failure(self, num_batched_tokens: int) -> str | None:
        """kvstorm's rule (``FaultValues.take_step_failure``), which counts ``fail_next_steps`` down."""
        with self._lock:
            return self._values.take_step_failure(num_batched_tokens)

    def publish_engine(self, **state: Any) -> None:
        """What the engine core reports of itself (plain values), shown under ``engine`` in every answer."""
        with self._lock:
            self._engine = state


class Refusal:
    """The service of a plugin that refused to act (another vLLM version): every call is a 501 with the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.lease = FaultLease(lambda: None)

    def answer(self) -> dict[str, Any]:
        raise FaultNotApplicable(self.reason)

    def update(self, changes: dict[str, object]) -> dict[str, Any]:
        raise FaultNotApplicable(self.reason)

    def clear(self) -> dict[str, Any]:
        raise FaultNotApplicable(self.reason)
