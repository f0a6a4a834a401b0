"""Open loop: against a server that answers slower and slower, requests still leave on schedule.

The scripted server adds 50 ms of TTFT per request it has seen, so request 59 waits 3 s for its first token while
new requests keep being due every 25 ms. A closed-loop client would fall behind; ours must not. The server's own
arrival stamps (same clock) confirm the client's recorded send times.
"""

from __future__ import annotations

import uuid

import numpy as np

from loadgen.results import RunResult
from tests.loadgen.conftest import run_bench_serve, scripted_server

NUM_REQUESTS, RATE = 60, 40.0
SERVER_ARGS = ("--ttft-ms", "100", "--gap-ms", "20", "--slowdown-ms", "50")
CLIENT_ARGS = ("--arrival", f"constant:rate={RATE:g}", "--num-requests", str(NUM_REQUESTS), "--output-len", "fixed:4")


def test_send_times_follow_the_schedule_while_the_server_slows_down(tmp_path):
    with scripted_server(*SERVER_ARGS) as server:
        result = RunResult.read(run_bench_serve(server.base_url, tmp_path, *CLIENT_ARGS))
        log = server.script_log()
    records = sorted(result.records, key=lambda r: r.index)
    # Request ids go out as X-Request-Id: UUIDs, which every server takes (llama-cpp-python's refuses others).
    assert len({uuid.UUID(r.request_id) for r in records}) == NUM_REQUESTS
    scheduled = np.asarray([r.scheduled_s for r in records])
    sent = np.asarray([r.sent_s for r in records])
    np.testing.assert_allclose(scheduled, np.arange(NUM_REQUESTS) / RATE)
    # A client that waited for answers would be seconds late by the end; ours is late by a wakeup. The bounds on the
    # tail leave room for a hiccup of the shared machine, far below what coordinated omission would cost.
    lag_ms = (sent - scheduled) * 1e3
    assert lag_ms.min() >= 0
    assert np.median(lag_ms) < 2.0
    assert np.percentile(lag_ms, 90) < 10.0
    assert lag_ms.max() < 100.0
    assert abs(np.mean(lag_ms[-10:]) - np.mean(lag_ms[:10])) < 10.0  # no drift as the server slows down
    # The server saw them arrive on the same schedule (its clock, its stamps).
    arrival_error_ms = (
        np.abs(np.asarray([log[r.request_id]["received_ts"] - result.start_ts for r in records]) - scheduled) * 1e3
    )
    assert np.median(arrival_error_ms) < 5.0
    assert arrival_error_ms.max() < 100.0
    # ... while answering ever later: the last request's TTFT is ~3 s, so dozens were in flight at once.
    ttft = np.asarray([r.ttft_s for r in records])
    assert ttft[-1] > ttft[0] + 2.5
    assert result.summary.peak_in_flight > 40
    assert not any("late" in note or "capped" in note for note in result.advisories)


def test_a_concurrency_cap_delays_sends_and_says_so(tmp_path):
    with scripted_server(*SERVER_ARGS) as server:
        result = RunResult.read(
            run_bench_serve(server.base_url, tmp_path, *CLIENT_ARGS[:2], "--num-requests", "12", "--output-len",
                            "fixed:4", "--max-concurrency", "3")
        )  # fmt: skip
    lag_s = [r.sent_s - r.scheduled_s for r in sorted(result.records, key=lambda r: r.index)]
    assert max(lag_s) > 0.5  # the 12th request waited for a slot behind ever slower answers
    assert result.summary.peak_in_flight <= 3
    assert any("capped at 3" in note for note in result.advisories)
