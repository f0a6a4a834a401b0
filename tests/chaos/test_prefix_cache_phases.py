"""The prefix cache before, during and after the faults, from the server's counters as scraped: its hit rate, the
prompt tokens it computed per second, and how long the hit rate took to come back."""

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
    assert (phases.before.hit_rate, phases.during.hit_rate, phases.after.hit_rate) == (0.8, 0.2, 0.7)
    # Queried but missed, per second of the phase: 200 in 10 s, 800 in 10 s, 300 in 10 s.
    assert [p.computed_tokens_per_s for p in (phases.before, phases.during, phases.after)] == [20, 80, 30]


def test_a_phase_without_lookups_has_no_rate_and_no_fault_or_no_counters_give_nothing():
    samples = [sample(0, 0, 0), sample(10, 1000, 800), sample(20, 1000, 800)]
    window = FaultWindow(name="engine:kv_cap", start_unix=10, end_unix=15)
    phases = prefix_cache_phases(samples, [window])
    assert phases.after.hit_rate is None
    assert phases.hit_rate_recovery_s is None
    assert prefix_cache_phases(samples, []) is None
    assert prefix_cache_phases([MetricsSample.parse("", 0)], [window]) is None


def test_the_hit_rate_recovers_once_it_is_back_to_90_percent_of_before_over_the_trailing_window():
    """80% before; after the fault ends at 20 s: 10% over 20-21 s, 60% over 20-22 s, then 75% over 20-23 s (75 >=
    0.9 x 80 = 72), so recovered 3 s after."""
    samples = [sample(0, 0, 0), sample(10, 1000, 800), sample(20, 2000, 800)]
    samples += [sample(21, 2100, 810), sample(22, 2200, 920), sample(23, 2400, 1100), sample(24, 2500, 1180)]
    phases = prefix_cache_phases(samples, [FaultWindow(name="traffic:flood", start_unix=10, end_unix=20)])
    assert phases.hit_rate_recovery_s == 3


def test_a_hit_rate_that_stays_low_never_recovers():
    samples = [sample(0, 0, 0), sample(10, 1000, 800), sample(20, 2000, 800), sample(30, 3000, 1500)]
    phases = prefix_cache_phases(samples, [FaultWindow(name="traffic:flood", start_unix=10, end_unix=20)])
    assert phases.after.hit_rate == 0.7
    assert phases.hit_rate_recovery_s is None
