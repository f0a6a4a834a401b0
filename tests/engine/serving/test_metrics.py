"""Histogram buckets: milliseconds to minutes, every default SLO threshold a boundary, extra ones configurable."""

from __future__ import annotations

from engine.core.outputs import FinishReason, RequestTimings
from engine.serving.metrics import DEFAULT_SLO_THRESHOLDS_S, EngineMetrics, latency_buckets
from tests.engine.serving.conftest import metric_value


def test_every_default_slo_threshold_is_a_bucket_boundary_from_a_millisecond_to_ten_minutes():
    buckets = latency_buckets()
    for thresholds in DEFAULT_SLO_THRESHOLDS_S.values():
        assert set(thresholds) <= set(buckets)
    assert (buckets[0], buckets[-1]) == (0.001, 600.0)
    assert list(buckets) == sorted(set(buckets))


def test_extra_boundaries_show_up_as_le_labels_of_the_latency_histograms():
    metrics = EngineMetrics("m", extra_buckets_s=[0.123, 42.0])
    timings = RequestTimings(arrival_ts=100.0, first_scheduled_ts=100.05, first_token_ts=100.1, finished_ts=140.0)
    metrics.observe_tokens(timings, 1, gap_s=None)
    metrics.observe_finished(timings, FinishReason.STOP)
    exposition = metrics.exposition().decode()
    ttft = "vllm:time_to_first_token_seconds_bucket"
    assert metric_value(exposition, ttft, le="0.075") == 0
    assert metric_value(exposition, ttft, le="0.123") == 1
    assert metric_value(exposition, "vllm:e2e_request_latency_seconds_bucket", le="30.0") == 0
    assert metric_value(exposition, "vllm:e2e_request_latency_seconds_bucket", le="42.0") == 1
    assert metric_value(exposition, "vllm:request_queue_time_seconds_bucket", le="0.123") == 1
    assert metric_value(exposition, "vllm:request_success_total", finished_reason="stop") == 1
    assert "_created" not in exposition
