"""The fault proxy between the load generator and the scripted server: each network fault is seen by the client as
what it is (latency in TTFT, a reset mid-stream and a long stall as broken streams), and clearing it restores the
clean run."""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlsplit

import pytest

from chaos.injectors.proxy import DirectionFaults, FaultProxy
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.results import RunConfig, RunResult
from tests.loadgen.conftest import scripted_server

NUM_STREAMS = 5
TTFT_S, GAP_S, TOKENS = 0.1, 0.02, 40  # about 0.9 s per stream


@pytest.fixture(scope="module")
def proxy():
    with scripted_server("--ttft-ms", str(TTFT_S * 1e3), "--gap-ms", str(GAP_S * 1e3)) as server:
        upstream = urlsplit(server.base_url)
        fault_proxy = FaultProxy(upstream.hostname, upstream.port)
        fault_proxy.start()
        try:
            yield fault_proxy
        finally:
            fault_proxy.stop()


def run_through(proxy: FaultProxy, stall_timeout_s: float = 5.0) -> RunResult:
    config = RunConfig(
        base_url=f"http://127.0.0.1:{proxy.port}",
        model="m",
        arrival="constant:rate=50",
        workload="random",
        input_len="fixed:16",
        output_len=f"fixed:{TOKENS}",
        num_requests=NUM_STREAMS,
        duration_s=None,
        max_concurrency=None,
        request_timeout_s=30.0,
        stall_timeout_s=stall_timeout_s,
        exact_output=True,
        seed=0,
        slo=None,
    )
    return asyncio.run(run_benchmark(config, show_progress=False))


def outcomes(result: RunResult) -> dict[Outcome, int]:
    return {outcome: count for outcome, count in result.summary.outcomes.items() if count}


def later(delay_s: float, action) -> threading.Timer:
    timer = threading.Timer(delay_s, action)
    timer.start()
    return timer


def test_without_faults_every_stream_is_clean(proxy):
    proxy.clear_faults()
    assert outcomes(run_through(proxy)) == {Outcome.OK: NUM_STREAMS}


def test_latency_delays_the_first_token_without_throttling_the_stream(proxy):
    proxy.set_faults("downstream", latency_s=0.3)
    try:
        result = run_through(proxy)
    finally:
        proxy.clear_faults()
    assert outcomes(result) == {Outcome.OK: NUM_STREAMS}
    assert result.summary.ttft.p50 >= TTFT_S + 0.3
    assert result.summary.itl.p50 < 3 * GAP_S  # a delay line: every chunk late by the same amount, not slower


def test_a_reset_mid_stream_is_a_broken_stream(proxy):
    streaming: list[int] = []

    def reset() -> None:  # first tokens out, last ones not yet
        streaming.append(proxy.num_streaming())
        proxy.reset_connections()

    timer = later(0.4, reset)
    result = run_through(proxy)
    timer.join()
    assert streaming == [NUM_STREAMS]
    assert outcomes(result) == {Outcome.BROKEN_STREAM: NUM_STREAMS}
    assert all(0 < r.delivered_tokens < TOKENS for r in result.records)


def test_a_reset_after_n_bytes_breaks_each_stream_there(proxy):
    proxy.set_faults("downstream", reset_after_bytes=3000)
    try:
        result = run_through(proxy)
    finally:
        proxy.clear_faults()
    assert outcomes(result) == {Outcome.BROKEN_STREAM: NUM_STREAMS}


def test_a_stall_longer_than_the_clients_stall_timeout_is_a_broken_stream_and_a_short_one_is_not(proxy):
    def stall_for(seconds: float) -> None:
        proxy.set_faults("downstream", stall=True)
        later(seconds, proxy.clear_faults)

    timer = later(0.4, lambda: stall_for(0.3))
    short = run_through(proxy, stall_timeout_s=1.0)
    timer.join()
    assert outcomes(short) == {Outcome.OK: NUM_STREAMS}
    assert short.summary.itl.max >= 0.25

    timer = later(0.4, lambda: stall_for(2.0))
    long = run_through(proxy, stall_timeout_s=1.0)
    timer.join()
    assert outcomes(long) == {Outcome.BROKEN_STREAM: NUM_STREAMS}
    assert all("stall" in r.error for r in long.records)


def test_faults_are_checked_and_named():
    proxy = FaultProxy("127.0.0.1", 9)
    with pytest.raises(ValueError, match="unknown proxy faults"):
        proxy.set_faults("downstream", delay=1)
    with pytest.raises(ValueError, match="direction must be one of"):
        proxy.set_faults("sideways", latency_s=1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0"):
        DirectionFaults(bandwidth_bytes_per_s=0)
