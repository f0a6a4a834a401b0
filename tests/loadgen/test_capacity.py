"""The client-capacity benchmark measures what it says on a small level (its numbers go to docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from loadgen.capacity import Placement, measure_level
from tests.loadgen.conftest import child_env


@pytest.mark.parametrize("workers", [1, 2])
def test_one_capacity_level_reports_streams_tokens_and_timing_error(workers):
    row = measure_level(20, ttft_s=0.05, gap_s=0.02, num_tokens=20, steady_s=1.0, workers=workers, env=child_env())
    assert row.num_failed == 0
    # Poisson arrivals for 20 streams on average: the peak and the steady second's count vary around that.
    assert 15 <= row.peak_streams <= 40
    assert 500 <= row.tokens_per_s <= 1500  # about 20 streams x one token per 20 ms
    assert 0 < row.client_cpu < 1.5 * workers  # every worker's CPU time counts
    assert row.server_cpu < 1.5  # (/proc counts in 10 ms ticks: too coarse for a lower bound here)
    assert 0 <= row.error_p50_ms <= row.error_p99_ms <= row.error_max_ms
    assert row.client_cores == Placement.for_workers(workers).client_cores


def test_workers_get_a_cpu_each_only_where_one_is_left_for_the_server():
    placement = Placement.for_workers(2)
    if placement.client_cores == 2:
        assert placement.server_cpu not in {cpu for (cpu,) in placement.worker_cpus}
        assert "on CPUs" in placement.describe()
    else:  # two CPUs: both workers share the first, the server has the second
        assert placement.worker_cpus == [placement.worker_cpus[0]] * 2
        assert placement.server_cpu != placement.worker_cpus[0][0]
        assert "sharing CPU" in placement.describe()
