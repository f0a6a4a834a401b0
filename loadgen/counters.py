"""Live counts of a run, written by the runner and the client, read by the progress display."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunCounters:
    total: int = 0
    num_sent: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_tokens: int = 0

    @property
    def num_in_flight(self) -> int:
        return self.num_sent - self.num_finished
