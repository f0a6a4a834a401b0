"""The server's side of a load without a Prometheus server: ``/metrics`` scraped every second while the load runs,
as the same series the load report draws from Prometheus (KV usage, running / waiting / swapped, preemptions/s, the
prefix cache's hit rate)."""

from __future__ import annotations

import contextlib
import threading

from chaos.run.metrics import KVOccupancy, MetricsSample, scrape
from loadgen.results import PromSeries

SOURCE = "scraped from /metrics"


class MetricsMonitor:
    """``with MetricsMonitor(url) as monitor:`` samples until the block ends; ``series()`` after."""

    def __init__(self, base_url: str, interval_s: float = 1.0) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: list[MetricsSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-monitor", daemon=True)

    def __enter__(self) -> MetricsMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            # A server that is down (killed, restarting) leaves a gap in the series.
            with contextlib.suppress(Exception):
                self.samples.append(scrape(self.base_url, timeout_s=self.interval_s * 5))
            self._stop.wait(self.interval_s)

    def series(self) -> list[PromSeries]:
        if not self.samples:
            return []
        occupancies = [(s.unix_s, KVOccupancy.of(s)) for s in self.samples]
        pairs = list(zip(self.samples, self.samples[1:], strict=False))
        preemption_rates = [
            (
                after.unix_s,
                _increase(before, after, "vllm:num_preemptions_total") / max(after.unix_s - before.unix_s, 1e-9),
            )
            for before, after in pairs
        ]
        # A point for each interval in which prompts were looked up (none while no prompt arrives).
        hit_rates = [
            (after.unix_s, _increase(before, after, "vllm:prefix_cache_hits_total") / queried)
            for before, after in pairs
            if (queried := _increase(before, after, "vllm:prefix_cache_queries_total")) > 0
        ]
        return [
            PromSeries(name="KV cache usage", query=SOURCE, points=[(t, o.device_usage) for t, o in occupancies]),
            PromSeries(name="running", query=SOURCE, points=[(t, o.running) for t, o in occupancies]),
            PromSeries(name="waiting", query=SOURCE, points=[(t, o.waiting) for t, o in occupancies]),
            PromSeries(name="swapped", query=SOURCE, points=[(t, o.swapped) for t, o in occupancies]),
            PromSeries(name="preemptions/s", query=SOURCE, points=preemption_rates),
            PromSeries(name="prefix cache hit rate", query=SOURCE, points=hit_rates),
        ]


def _increase(before: MetricsSample, after: MetricsSample, counter: str) -> float:
    return after.total(counter) - before.total(counter)
