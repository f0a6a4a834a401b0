"""The prefix cache's hit rate before, during and after the faults, from the server's counters as scraped."""

from __future__ import annotations

from chaos.run.metrics import MetricsSample, prefix_cache_phases
from loadgen.results import FaultWindow


def sample(unix_s: float, queried: int, hits: int) -> MetricsSample:
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        f'vllm:prefix_cache_queries_total{{model_name="m"}} {queried}\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
    )
    return MetricsSample.parse(text, unix_s)


def test_each_phase_is_the_increase_of_hits_over_the_increase_of_queries_within_it():
    samples = [sample(0, 0, 0), sample(10, 1000, 800), sample(20, 2000, 1000), sample(30, 3000, 1700)]
    phases = prefix_cache_phases(samples, [FaultWindow(name="engine:kv_cap", start_unix=10, end_unix=20.5)])
    assert (phases.before, phases.during, phases.after) == (0.8, 0.2, 0.7)


def test_a_phase_without_lookups_has_no_rate_and_no_fault_or_no_counters_give_nothing():
    samples = [sample(0, 0, 0), sample(10, 1000, 800), sample(20, 1000, 800)]
    window = FaultWindow(name="engine:kv_cap", start_unix=10, end_unix=15)
    assert prefix_cache_phases(samples, [window]).after is None
    assert prefix_cache_phases(samples, []) is None
    assert prefix_cache_phases([MetricsSample.parse("", 0)], [window]) is None
