"""A wedged engine fails /health; overload is refused with 429 before any stream starts; slow readers are cut."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import requests

from engine.core.admission import AdmissionLimits
from engine.core.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.serving.metrics import EngineMetrics
from tests.engine.serving.conftest import make_tiny_engine, metric_value, running_server, wait_until

TINY = "tiny"


def stream_in_background(url: str, **fields: object) -> tuple[threading.Thread, list[str]]:
    """A streaming completion read to the end in a thread; its SSE data lines land in the returned list."""
    lines: list[str] = []
    body = {"model": TINY, "prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "stream": True, **fields}

    def read() -> None:
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as response:
            lines.extend(line.decode() for line in response.iter_lines() if line)

    thread = threading.Thread(target=read)
    thread.start()
    return thread, lines


def finish_reasons(lines: list[str]) -> list[str]:
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


def stats(server) -> dict:
    return requests.get(f"{server.url}/admin/stats", headers=server.admin_headers).json()


def test_health_is_503_while_the_loop_is_frozen_with_requests_in_flight_and_recovers():
    with running_server(make_tiny_engine(), name=TINY, stall_timeout_s=0.5) as server:
        assert requests.get(f"{server.url}/health").status_code == 200
        requests.post(f"{server.url}/admin/pause", headers=server.admin_headers)
        assert requests.get(f"{server.url}/health").status_code == 200, "idle and paused is not a stall"
        reader, lines = stream_in_background(server.url)
        wait_until(lambda: stats(server)["pending_adds"], "the request to arrive")
        requests.post(f"{server.url}/admin/step?num_steps=3", headers=server.admin_headers)
        assert stats(server)["requests"], "the request is in flight, tokens already sent"

        health = f"{server.url}/health"
        stalled = wait_until(lambda: (r := requests.get(health)).status_code == 503 and r.json(), "a 503")
        assert stalled["status"] == "stalled"
        assert stalled["num_in_flight"] == 1
        refused = requests.post(f"{server.url}/v1/completions", json={"model": TINY, "prompt": [1], "max_tokens": 2})
        assert refused.status_code == 503
        assert "no engine step for" in refused.json()["error"]["message"]
        ready = requests.get(f"{server.url}/ready")
        assert ready.status_code == 503
        assert any("paused" in reason for reason in ready.json()["reasons"])

        requests.post(f"{server.url}/admin/resume", headers=server.admin_headers)
        wait_until(lambda: requests.get(f"{server.url}/health").status_code == 200, "recovery")
        reader.join(60)
        assert finish_reasons(lines) == ["length"]
        assert lines[-1] == "data: [DONE]"
        assert requests.get(f"{server.url}/ready").status_code == 200


def test_a_stream_cut_by_shutdown_ends_with_an_error_event_and_done():
    with running_server(make_tiny_engine(), name=TINY) as server:
        requests.post(f"{server.url}/admin/pause", headers=server.admin_headers)
        reader, lines = stream_in_background(server.url)
        wait_until(lambda: stats(server)["pending_adds"], "the request to arrive")
        requests.post(f"{server.url}/admin/step?num_steps=3", headers=server.admin_headers)
        server.stop()  # the engine loop ends with the request in flight
        reader.join(60)
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(e["choices"]) for e in events[:-1]] == [1, 1, 1]  # three tokens went out
    assert events[-1]["error"]["message"] == "the server is shutting down"
    assert lines[-1] == "data: [DONE]"


def test_a_json_client_that_hangs_up_while_queued_is_aborted_and_counted():
    with running_server(make_tiny_engine(), name=TINY) as server:
        requests.post(f"{server.url}/admin/pause", headers=server.admin_headers)
        body = {"model": TINY, "prompt": [1, 2, 3], "max_tokens": 5}
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{server.url}/v1/completions", json=body, timeout=0.5)  # gives up, closes the connection
        wait_until(lambda: stats(server)["pending_aborts"], "the server to notice the hang-up")
        requests.post(f"{server.url}/admin/resume", headers=server.admin_headers)
        wait_until(lambda: stats(server)["num_in_flight"] == 0, "the abort")
        assert stats(server)["stats"]["num_free_device_blocks"] == stats(server)["stats"]["num_device_blocks"]
        metrics = requests.get(f"{server.url}/metrics").text
        assert metric_value(metrics, "kvstorm:aborted_requests_total", phase="queued", reason="client") == 1
        assert metric_value(metrics, "vllm:request_success_total", finished_reason="abort") == 1


def test_a_full_queue_is_refused_with_429_and_retry_after_before_any_stream_starts():
    with running_server(make_tiny_engine(), name=TINY, limits=AdmissionLimits(max_waiting=2)) as server:
        requests.post(f"{server.url}/admin/pause", headers=server.admin_headers)
        readers = [stream_in_background(server.url) for _ in range(2)]
        wait_until(lambda: len(stats(server)["pending_adds"]) == 2, "two queued requests")

        refused = requests.post(f"{server.url}/v1/completions", json={"model": TINY, "prompt": [1], "stream": True})
        assert refused.status_code == 429
        assert refused.headers["Content-Type"].startswith("application/json")
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "2 requests are waiting (limit 2)" in refused.json()["error"]["message"]
        ready = requests.get(f"{server.url}/ready")
        assert ready.status_code == 503
        assert any("waiting" in reason for reason in ready.json()["reasons"])

        requests.post(f"{server.url}/admin/resume", headers=server.admin_headers)
        for reader, lines in readers:
            reader.join(60)
            assert finish_reasons(lines) == ["length"]
        accepted = requests.post(f"{server.url}/v1/completions", json={"model": TINY, "prompt": [1], "max_tokens": 2})
        assert accepted.status_code == 200
        metrics = requests.get(f"{server.url}/metrics").text
        assert metric_value(metrics, "kvstorm:rejected_requests_total", reason="max_waiting") == 1


def test_each_of_n_choices_waits_as_a_request_and_a_request_that_does_not_fit_leaves_none_queued():
    with running_server(make_tiny_engine(), name=TINY, limits=AdmissionLimits(max_waiting=16)) as server:
        requests.post(f"{server.url}/admin/pause", headers=server.admin_headers)
        readers = [stream_in_background(server.url) for _ in range(4)]
        wait_until(lambda: len(stats(server)["pending_adds"]) == 4, "four queued requests")
        body = {"model": TINY, "prompt": [1], "max_tokens": 2, "stream": True}

        refused = requests.post(f"{server.url}/v1/completions", json={**body, "n": 16}, timeout=30)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        message = refused.json()["error"]["message"]
        assert "19 requests are waiting, 15 of them this request's other sequences (limit 16)" in message
        assert len(stats(server)["pending_adds"]) == 4  # none of the sixteen was queued, not even for a moment
        assert server.async_engine.num_in_flight == 4

        never = requests.post(f"{server.url}/v1/completions", json={**body, "n": 17}, timeout=30)
        assert never.status_code == 400, never.text
        assert "17 sequences in one request, but at most 16 may wait at once" in never.json()["error"]["message"]

        fits = stream_in_background(server.url, n=12, max_tokens=2)  # 4 waiting + 12: at the limit, admitted
        wait_until(lambda: len(stats(server)["pending_adds"]) == 16, "the twelve choices queued")
        one_more = requests.post(f"{server.url}/v1/completions", json={**body, "n": 1}, timeout=30)
        assert one_more.status_code == 429, one_more.text

        requests.post(f"{server.url}/admin/resume", headers=server.admin_headers)
        for reader, _ in [*readers, fits]:
            reader.join(60)
        assert sorted(finish_reasons(fits[1])) == ["length"] * 12
        wait_until(lambda: server.async_engine.num_in_flight == 0, "every stream to end")
        metrics = requests.get(f"{server.url}/metrics").text
    assert metric_value(metrics, "kvstorm:rejected_requests_total", reason="max_waiting") == 2
    assert metric_value(metrics, "kvstorm:rejected_requests_total", reason="invalid_request") == 1


def test_a_predicted_queue_time_over_the_limit_is_refused_with_429():
    limits = AdmissionLimits(max_queue_delay_s=1e-6)
    # A 64-token budget: the long prompt takes 8 steps, and a request behind it waits for them.
    with running_server(make_tiny_engine(max_num_batched_tokens=64), name=TINY, limits=limits) as server:
        requests.post(f"{server.url}/admin/pause", headers=server.admin_headers)
        reader, lines = stream_in_background(server.url, prompt=list(range(1, 500)), max_tokens=2)
        wait_until(lambda: stats(server)["pending_adds"], "the long prompt to queue")
        refused = requests.post(f"{server.url}/v1/completions", json={"model": TINY, "prompt": [1], "max_tokens": 2})
        assert refused.status_code == 429
        assert "predicted queue time" in refused.json()["error"]["message"]
        requests.post(f"{server.url}/admin/resume", headers=server.admin_headers)
        reader.join(60)
        assert finish_reasons(lines) == ["length"]


def test_admin_routes_need_the_token_and_do_not_exist_without_one():
    with running_server(make_tiny_engine(), name=TINY) as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = requests.post(f"{server.url}/admin/pause", headers=headers)
            assert response.status_code == 401
            assert "admin token" in response.json()["error"]["message"]
        assert not stats(server)["paused"]
    with running_server(make_tiny_engine(), name=TINY, admin_token=None) as server:
        assert requests.post(f"{server.url}/admin/pause", headers=server.admin_headers).status_code == 404
        assert "/admin/pause" not in requests.get(f"{server.url}/openapi.json").json()["paths"]


def test_a_client_that_stops_reading_is_aborted_and_its_blocks_return():
    engine = make_tiny_engine()
    metrics = EngineMetrics(TINY)
    async_engine = AsyncEngine(engine, metrics, AdmissionLimits(max_buffered_outputs=4))

    async def never_read() -> list:
        async_engine.start(asyncio.get_running_loop())
        try:
            stream = async_engine.submit([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), "slow")
            while async_engine.num_in_flight:
                await asyncio.sleep(0.01)
            return [output async for output in stream]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    outputs = asyncio.run(never_read())
    assert outputs[-1].finish_reason == "abort"
    assert len(outputs) == 4 + 2  # the buffer, the output that overflowed it, the abort
    assert engine.kv_cache_manager.device_pool.num_free_blocks == engine.kv_cache_manager.device_pool.num_blocks
    exposition = metrics.exposition().decode()
    assert metric_value(exposition, "kvstorm:aborted_requests_total", phase="decode", reason="slow_client") == 1
