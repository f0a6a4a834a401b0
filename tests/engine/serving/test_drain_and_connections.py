"""The server's edges: a drain that lets the streams in flight finish while it refuses new work, connections that
cannot be held open for free, a cap on requests in progress that idle connections cannot fill, and a cap on one
address's connections."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import requests

from engine.serving.connections import LIFECYCLE
from engine.serving.server import drain
from tests.engine.serving.conftest import make_tiny_engine, metric_value, running_server, wait_until

TINY = "tiny"


def stream_one(url: str, results: list[dict]) -> None:
    body = {"model": TINY, "prompt": [1, 2, 3], "max_tokens": 30, "ignore_eos": True, "stream": True}
    events = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                events.append(line[6:].decode())
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if "choices" in json.loads(e)]
    errors = [event for event in events if "error" in event]
    results.append({"done": events[-1] == "[DONE]", "finish": finishes[-1] if finishes else None, "errors": errors})


def test_a_drain_lets_the_streams_in_flight_finish_and_refuses_new_ones():
    with running_server(make_tiny_engine(), name=TINY) as server:
        # Each step takes 50 ms: 30 tokens last 1.5 s, long enough to drain in the middle of them.
        requests.post(f"{server.url}/admin/faults", json={"step_delay": 0.05}, headers=server.admin_headers, timeout=10)
        results: list[dict] = []
        clients = [threading.Thread(target=stream_one, args=(server.url, results)) for _ in range(4)]
        for client in clients:
            client.start()
        wait_until(lambda: server.async_engine.num_in_flight == 4, "four streams in flight")
        drained = asyncio.run_coroutine_threadsafe(drain(server.runner.app, timeout_s=60), server.loop)
        wait_until(lambda: requests.get(f"{server.url}/ready", timeout=10).status_code == 503, "/ready to turn 503")
        refused = requests.post(f"{server.url}/v1/completions", json={"model": TINY, "prompt": [1]}, timeout=10)
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "5"
        assert "shutting down" in refused.json()["error"]["message"]
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
        assert drained.result(60) == 0  # none left for the shutdown to cut
        for client in clients:
            client.join(60)
    assert results == [{"done": True, "finish": "length", "errors": []}] * 4


def test_a_drain_that_runs_out_ends_the_rest_with_an_error_event():
    with running_server(make_tiny_engine(), name=TINY) as server:
        requests.post(f"{server.url}/admin/faults", json={"step_delay": 0.2}, headers=server.admin_headers, timeout=10)
        results: list[dict] = []
        client = threading.Thread(target=stream_one, args=(server.url, results))
        client.start()
        wait_until(lambda: server.async_engine.num_in_flight == 1, "a stream in flight")
        assert asyncio.run_coroutine_threadsafe(drain(server.runner.app, timeout_s=0.3), server.loop).result(10) == 1
        server.stop()  # what kvstorm serve does after the drain: the shutdown ends the stream
        client.join(60)
    (result,) = results
    assert result["done"]
    assert "shutting down" in result["errors"][0]


def test_a_connection_that_sends_no_whole_request_is_closed():
    with running_server(make_tiny_engine(), name=TINY, keepalive_timeout_s=1.0) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as half:
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            started = time.monotonic()
            assert half.recv(100) == b""  # closed by the server
            assert time.monotonic() - started < 20  # a hang guard: aiohttp's default keeps it for an hour


def open_idle(server, count: int) -> list[socket.socket]:
    """``count`` connections that send nothing, each accepted by the server before the next opens."""
    port = int(server.url.rsplit(":", 1)[1])
    lifecycle = server.runner.app[LIFECYCLE]
    before = lifecycle.count_connections()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
    wait_until(lambda: lifecycle.count_connections() >= before + count, f"{count} open connections")
    return idle


def test_idle_connections_lock_no_one_out_and_past_the_cap_on_requests_in_progress_a_request_gets_503():
    body = {"model": TINY, "prompt": [1], "max_tokens": 1}
    with running_server(make_tiny_engine(), name=TINY, max_connections=3) as server:
        idle = open_idle(server, 60)  # 20 times the cap, sending nothing
        try:
            assert requests.post(f"{server.url}/v1/completions", json=body, timeout=10).status_code == 200
            # Three streams in progress (each step 50 ms, 30 tokens): the cap is reached.
            requests.post(f"{server.url}/admin/faults", json={"step_delay": 0.05}, headers=server.admin_headers)
            results: list[dict] = []
            clients = [threading.Thread(target=stream_one, args=(server.url, results)) for _ in range(3)]
            for client in clients:
                client.start()
            wait_until(lambda: server.async_engine.num_in_flight == 3, "three streams in flight")
            refused = requests.post(f"{server.url}/v1/completions", json=body, timeout=10)
            assert refused.status_code == 503
            assert "4 requests are in progress, more than this server takes at once (3" in refused.text
            assert refused.headers["Connection"] == "close"
            assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
            for client in clients:
                client.join(60)
            assert results == [{"done": True, "finish": "length", "errors": []}] * 3
            assert requests.post(f"{server.url}/v1/completions", json=body, timeout=10).status_code == 200
        finally:
            for connection in idle:
                connection.close()
        exposition = requests.get(f"{server.url}/metrics", timeout=10).text
    assert metric_value(exposition, "kvstorm:rejected_requests_total", reason="connection_cap") == 1


def test_past_its_cap_a_peer_s_new_connection_gets_503_at_once_and_is_closed():
    body = {"model": TINY, "prompt": [1], "max_tokens": 1}
    with running_server(make_tiny_engine(), name=TINY, max_connections_per_peer=5) as server:
        idle = open_idle(server, 5)
        try:
            port = int(server.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sixth:
                answer = b""
                while chunk := sixth.recv(4096):  # answered before it sends a byte, then closed
                    answer += chunk
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ")
            assert b"Retry-After: 1" in head
            error = json.loads(payload)["error"]
            assert "5 connections from 127.0.0.1 are open" in error["message"]
            assert "--max-connections-per-peer" in error["message"]
        finally:
            for connection in idle:
                connection.close()
        wait_until(lambda: server.runner.app[LIFECYCLE].count_connections() == 0, "the idle connections to go")
        assert requests.post(f"{server.url}/v1/completions", json=body, timeout=10).status_code == 200
        exposition = requests.get(f"{server.url}/metrics", timeout=10).text
    assert metric_value(exposition, "kvstorm:rejected_requests_total", reason="peer_connection_cap") == 1
