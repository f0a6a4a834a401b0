"""The client-capacity benchmark measures what it says on a small level (its numbers go to docs/benchmarks.md)."""

from __future__ import annotations

from loadgen.capacity import measure_level
from tests.loadgen.conftest import child_env


def test_one_capacity_level_reports_streams_tokens_and_timing_error():
    row = measure_level(20, ttft_s=0.05, gap_s=0.02, num_tokens=20, steady_s=1.0, env=child_env())
    assert row.num_failed == 0
    # Poisson arrivals for 20 streams on average: the peak and the steady second's count vary around that.
    assert 15 <= row.peak_streams <= 40
    assert 500 <= row.tokens_per_s <= 1500  # about 20 streams x one token per 20 ms
    assert 0 < row.client_cpu < 1.5
    assert row.server_cpu < 1.5  # (/proc counts in 10 ms ticks: too coarse for a lower bound here)
    assert 0 <= row.error_p50_ms <= row.error_p99_ms <= row.error_max_ms
