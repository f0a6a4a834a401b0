"""The bounds every fault value stays within, so that none can overflow a sleep or a timer or wedge the engine loop:
the engine's faults (``engine.faults``) and the serving loop's freeze (``engine.serving.async_engine``) share them."""

from __future__ import annotations

MAX_DELAY_S = 60.0  # each delay fault, one block move's whole delay, and the freeze of the loop
DELAY_SLICE_S = 0.05  # a delay re-reads its fault this often, so a clear ends it within one slice
MAX_COUNT = 10**9  # oom_above_batched_tokens, fail_next_steps
MAX_MEMORY_HOG_BYTES = 2**40


def parse_seconds(name: str, value: object) -> float:
    """A delay's value: a finite number of seconds in [0, ``MAX_DELAY_S``]; ``ValueError`` naming it otherwise."""
    if type(value) not in (int, float) or not 0 <= value <= MAX_DELAY_S:  # NaN and the infinities fail the range
        raise ValueError(f"{name} must be a number of seconds in [0, {MAX_DELAY_S:g}], got {value!r}")
    return float(value)
