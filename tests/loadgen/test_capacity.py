"""The client-capacity benchmark measures what it says on a small level (its numbers go to docs/benchmarks.md)."""

from __future__ import annotations

from loadgen.capacity import measure_level
from tests.loadgen.conftest import child_env


def test_one_capacity_level_reports_streams_tokens_and_timing_error():
    row = measure_level(20, ttft_s=0.05, gap_s=0.02, num_tokens=20, steady_s=1.0, env=child_env())
    assert row.num_failed == 0
    assert 18 <= row.peak_streams <= 22
    # 20 streams x one token per 20 ms, counted over the steady second (a token more or less at its edges).
    assert 900 <= row.tokens_per_s <= 1100
    assert 0 < row.client_cpu < 1.5
    assert row.server_cpu < 1.5  # (/proc counts in 10 ms ticks: too coarse for a lower bound here)
    assert 0 <= row.error_p50_ms <= row.error_p99_ms <= row.error_max_ms
