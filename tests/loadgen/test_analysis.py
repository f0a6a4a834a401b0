"""Aggregates from hand-made records: percentiles, goodput under SLOs, outcome counts, time series, advisories."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.analysis import advisories, describe_rates, parse_slos, peak_in_flight, summarize, time_series
from loadgen.records import Outcome, RequestRecord


def record(index: int, *, sent_s: float, ttft_s: float = 0.1, gap_s: float = 0.01, tokens: int = 5, **fields):
    defaults = {
        "outcome": Outcome.OK,
        "ttft_s": ttft_s,
        "itl_s": [gap_s] * (tokens - 1),
        "e2e_s": None if ttft_s is None else ttft_s + gap_s * (tokens - 1),
        "output_tokens": tokens,
        "delivered_tokens": tokens,
        "requested_output_tokens": tokens,
    }
    return RequestRecord(
        index=index, request_id=str(index), scheduled_s=sent_s, sent_s=sent_s, **{**defaults, **fields}
    )


def test_summary_of_a_mixed_run():
    records = [record(i, sent_s=i * 0.5, ttft_s=0.1 * (i + 1)) for i in range(10)]
    records.append(record(10, sent_s=5.0, outcome=Outcome.REJECTED, ttft_s=None, e2e_s=None, itl_s=[], tokens=0))
    records.append(record(11, sent_s=5.0, outcome=Outcome.BROKEN_STREAM, ttft_s=9.0))
    summary = summarize(records, duration_s=10.0, slos=parse_slos("ttft_p90=0.75s,tpot_p99=20ms"))
    assert summary.outcomes == {
        Outcome.OK: 10,
        Outcome.REJECTED: 1,
        Outcome.BROKEN_STREAM: 1,
        Outcome.CLIENT_TIMEOUT: 0,
    }
    ttfts = [0.1 * (i + 1) for i in range(10)]  # the broken stream's 9 s TTFT is not a success's TTFT
    assert summary.ttft.p50 == pytest.approx(np.percentile(ttfts, 50))
    assert summary.ttft.max == pytest.approx(1.0)
    assert summary.tpot.p99 == pytest.approx(0.01)
    assert summary.itl.count == 40
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_token_throughput == pytest.approx(5.0)
    ttft_slo, tpot_slo = summary.slos
    assert ttft_slo.met is False
    assert ttft_slo.observed_s == pytest.approx(np.percentile(ttfts, 90))
    assert tpot_slo.met is True
    assert summary.goodput == pytest.approx(7 / 10.0)  # TTFT 0.1 .. 0.7 s meet 0.75 s


def test_peak_in_flight_counts_overlaps():
    records = [record(0, sent_s=0.0, ttft_s=1.0), record(1, sent_s=0.5, ttft_s=1.0), record(2, sent_s=2.0)]
    assert peak_in_flight(records) == 2


@pytest.mark.parametrize("text", ["ttft=2s", "ttft_p42=1s", "latency_p99=1s", "ttft_p99"])
def test_bad_slos_are_refused(text):
    with pytest.raises(ValueError, match="METRIC_STAT=DURATION"):
        parse_slos(text)


def test_time_series_buckets_by_send_time():
    records = [record(i, sent_s=i * 0.25) for i in range(8)] + [
        record(8, sent_s=1.5, outcome=Outcome.CLIENT_TIMEOUT, ttft_s=None, itl_s=[], e2e_s=3.0)
    ]
    series = time_series(records, duration_s=2.0, bucket_s=1.0)
    assert series.start_s == [0.0, 1.0]
    assert series.sent_rate == [4.0, 5.0]
    assert series.outcomes[Outcome.CLIENT_TIMEOUT] == [0, 1]
    assert series.ttft["p50"] == [pytest.approx(0.1), pytest.approx(0.1)]


def test_a_client_that_falls_behind_its_schedule_says_the_load_was_lighter_than_configured():
    on_time = [record(i, sent_s=i * 0.1) for i in range(11)]
    summary = summarize(on_time, 2.0)
    assert summary.scheduled_rate == pytest.approx(10.0)
    assert summary.delivered_rate == pytest.approx(10.0)
    assert not any(
        "fell behind" in note for note in advisories(summary, on_time, exact_output=True, max_concurrency=None)
    )
    behind = [record(i, sent_s=i * 0.12) for i in range(11)]
    for r in behind:
        r.scheduled_s = r.index * 0.1
    notes = advisories(summarize(behind, 2.0), behind, exact_output=True, max_concurrency=None)
    assert any("sent 8.33 requests/s where the schedule asked for 10.00 (17% short)" in note for note in notes), notes
    assert describe_rates(summarize(behind, 2.0)) == "Arrivals: 8.33 requests/s sent of 10.00 scheduled (83%)."


def test_advisories_tell_when_numbers_need_care():
    short = record(0, sent_s=0.0, tokens=3, requested_output_tokens=8)
    rejected = record(1, sent_s=0.0, outcome=Outcome.REJECTED, http_status=400, error="HTTP 400: unknown ignore_eos")
    late = record(2, sent_s=0.05)
    late.scheduled_s = 0.0
    records = [short, rejected, late]
    notes = advisories(summarize(records, 1.0), records, exact_output=True, max_concurrency=None)
    assert any("1 ok requests returned fewer tokens" in note for note in notes)
    assert any("rejected with HTTP 400" in note and "--no-exact-output" in note for note in notes)
    assert any("left late" in note for note in notes)
    assert any("no usage" in note for note in notes)
