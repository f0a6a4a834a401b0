"""Admission control: refuse a request before it starts (429 with Retry-After) when the queue is past a limit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.outputs import EngineSnapshot
from engine.core.request import Request


class AdmissionRefused(Exception):
    """Admission control refused a request before it started; retry after ``retry_after_s``."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionLimits:
    """None disables a limit."""

    # Refuse when this many requests are already waiting.
    max_waiting: int | None = None
    # Refuse when the estimated wait before the first scheduled step exceeds this.
    max_queue_delay_s: float | None = None
    # Outputs a stream may hold undelivered before its request is aborted as a slow client.
    max_buffered_outputs: int = 256

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_queue_delay_s is not None and self.max_queue_delay_s <= 0:
            raise ValueError(f"max_queue_delay_s must be > 0, got {self.max_queue_delay_s}")
        if self.max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs must be >= 1, got {self.max_buffered_outputs}")


def find_overloads(
    limits: AdmissionLimits, snapshot: EngineSnapshot, pending: Sequence[Request]
) -> tuple[list[tuple[str, str]], float]:
    """(reason, message) for each limit the queue is at, and the estimated queue delay: the time to prefill what
    waits ahead (the engine's queue as of ``snapshot`` plus ``pending`` requests not in it yet) at the prefill
    throughput the engine measures as it runs."""
    num_waiting = snapshot.stats.num_waiting + len(pending)
    waiting_tokens = snapshot.num_waiting_tokens + sum(r.num_prompt_tokens for r in pending)
    delay_s = waiting_tokens / snapshot.prefill_tokens_per_s
    overloads = []
    if limits.max_waiting is not None and num_waiting >= limits.max_waiting:
        overloads.append(("max_waiting", f"{num_waiting} requests are waiting (limit {limits.max_waiting})"))
    if limits.max_queue_delay_s is not None and delay_s > limits.max_queue_delay_s:
        message = f"estimated queue time {delay_s:.1f} s exceeds the limit of {limits.max_queue_delay_s:g} s"
        overloads.append(("max_queue_delay", message))
    return overloads, delay_s
