"""Live counts of a run, written by the runner and the client, read by the progress display."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.records import Outcome, RequestRecord


@dataclass
class RunCounters:
    total: int = 0
    num_sent: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_tokens: int = 0
    # Requests finished, by outcome.
    outcomes: Counter = field(default_factory=Counter)
    # Called with each request's record as it ends (on the run's event loop: it must not block), for a live
    # consumer such as the chaos controller's client-side metrics.
    on_record: Callable[[RequestRecord], None] | None = None

    def finished(self, record: RequestRecord) -> None:
        self.num_finished += 1
        self.num_failed += record.outcome is not Outcome.OK
        self.outcomes[record.outcome] += 1
        if self.on_record is not None:
            self.on_record(record)

    @property
    def num_in_flight(self) -> int:
        return self.num_sent - self.num_finished
