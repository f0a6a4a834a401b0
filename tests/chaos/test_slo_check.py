"""The dashboards' SLO spec judged from scrapes of /metrics (chaos.judgement.slo_check): the counts across a server
restart, a gauge guardrail that must stay crossed as long as its alert waits, and a server that lacks a metric."""

from __future__ import annotations

from chaos.judgement.slo_check import evaluate
from chaos.run.metrics import EngineActivity, MetricsSample
from chaos.run.state import LoadRun
from dashboards.slo import GUARDRAIL_FOR_S, load_spec

SLOS = {slo.name: slo for slo in load_spec("cpu")}  # ttft within 5 s at 99%


def scrape(unix_s: float, ttft_good: int, ttft_all: int, kv_usage: float = 0.0) -> MetricsSample:
    text = f"""# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="5.0",model_name="m"}} {ttft_good}
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {ttft_all}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {ttft_all}
vllm:time_to_first_token_seconds_sum{{model_name="m"}} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} {kv_usage}
"""
    return MetricsSample.parse(text, unix_s)


def load_of(*scrapes: MetricsSample) -> LoadRun:
    return LoadRun("main", metrics_before=scrapes[0], metrics_after=scrapes[-1], samples=list(scrapes[1:-1]))


def test_events_count_what_happened_during_the_load_across_a_restart():
    # 10 requests before the load; 8 (6 good) until the server restarts; 5 (3 good) after it.
    load = load_of(scrape(0, 10, 10), scrape(1, 16, 18), scrape(2, 1, 2), scrape(3, 3, 5))
    result = evaluate(SLOS["ttft"], load)
    assert (result.good, result.total) == (9, 13)
    assert result.value == 9 / 13
    assert result.met is False
    assert round(result.burn_rate, 1) == round((4 / 13) / 0.01, 1)


def test_a_load_without_events_neither_meets_nor_misses():
    result = evaluate(SLOS["ttft"], load_of(scrape(0, 4, 4), scrape(1, 4, 4)))
    assert (result.value, result.met, result.burn_rate) == (None, None, None)


def test_kv_usage_misses_only_when_above_its_threshold_as_long_as_its_alert_waits():
    full_briefly = [scrape(t, 0, 0, kv_usage=1.0 if 10 <= t < 40 else 0.5) for t in range(0, 200, 10)]
    result = evaluate(SLOS["kv_usage"], load_of(*full_briefly))
    assert (result.value, result.seconds_over, result.met) == (1.0, 30, True)
    full_long = [scrape(t, 0, 0, kv_usage=1.0) for t in range(0, GUARDRAIL_FOR_S + 20, 10)]
    assert evaluate(SLOS["kv_usage"], load_of(*full_long)).met is False


def test_a_metric_the_server_does_not_expose_is_said_so():
    result = evaluate(SLOS["swap_out"], load_of(scrape(0, 0, 0), scrape(1, 0, 0)))
    assert (result.exposed, result.value, result.met) == (False, None, None)


def test_a_threshold_between_the_servers_buckets_is_not_measured_rather_than_all_bad():
    """7.1 s is no bucket of this histogram (5.0 and +Inf): counted from a bucket that is not there, every request
    was bad (a calm vLLM baseline burnt its budget at 100x); now the SLO says it cannot be read, and why."""
    (ttft,) = load_spec("cpu", {"ttft": {"threshold": 7.1}})[:1]
    result = evaluate(ttft, load_of(scrape(0, 0, 0), scrape(1, 10, 10)))
    assert (result.exposed, result.value, result.met, result.burn_rate) == (False, None, None, None)
    assert result.why_unmeasured == "the server has no vllm:time_to_first_token_seconds bucket at 7.1 s"


def test_engine_counters_across_a_restart_count_from_zero_again_not_below_it():
    """kill-and-restart's verdict read -2 preemptions and -22 swapped blocks: the counters start again at zero in the
    restarted server, and two scrapes alone saw them drop."""

    def counters(unix_s: float, preemptions: int, swapped_out: int) -> MetricsSample:
        text = f"""# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{model_name="m"}} {preemptions}
# TYPE kvstorm:swap_blocks counter
kvstorm:swap_blocks_total{{direction="out"}} {swapped_out}
"""
        return MetricsSample.parse(text, unix_s)

    before, killed, restarted, after = counters(0, 5, 40), counters(1, 7, 58), counters(2, 0, 0), counters(3, 1, 6)
    activity = EngineActivity.between(before, after, [killed, restarted])
    assert (activity.preemptions, activity.swapped_out_blocks) == (3, 24)
    # Two scrapes alone see a drop: counted from zero, the restarted server's own count (the 2 before it are lost).
    assert EngineActivity.between(before, after).preemptions == 1
