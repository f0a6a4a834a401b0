"""Clients that reset their connection (RST, SO_LINGER 0) at random points of their request's submission: on the
real model, streamed and not, one choice and two, on both routes. Afterwards no request is left decoding for no one
and no KV block is held, and no reset is counted or logged as the server's error.

The orphans this guards against decode until ``max_tokens``: the engine runs slowly (a step delay) and the
slow-client abort is out of reach, so one left behind would still hold its blocks long after the wait below."""

from __future__ import annotations

import json
import logging
import random
import socket
import struct
import threading
import time

import pytest
import requests

from engine.core.admission import AdmissionLimits
from engine.serving.connections import LIFECYCLE
from tests.engine.serving.conftest import make_engine, metric_value, running_server, wait_until

MODEL = "smollm2-135m"
NUM_BLOCKS = 256
NUM_CLIENTS, RESETS_PER_CLIENT = 8, 15
MAX_RESET_DELAY_S = 0.015
MAX_TOKENS = 1000  # an orphan would decode for at least 1000 steps of STEP_DELAY_S: 20 s
STEP_DELAY_S = 0.02


def raw_request(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def random_request(rng: random.Random) -> bytes:
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": rng.choice([1, 2]),
              "stream": rng.choice([False, True])}  # fmt: skip
    if rng.random() < 0.5:
        return raw_request("/v1/completions", {**common, "prompt": f"Story {rng.randrange(10**6)}: once upon a"})
    messages = [{"role": "user", "content": f"Tell me story number {rng.randrange(10**6)}."}]
    return raw_request("/v1/chat/completions", {**common, "messages": messages})


def reset_after_sending(port: int, rng: random.Random) -> None:
    """Send one request, wait 0-15 ms, then reset the connection (no FIN: an RST, as a crashed client's kernel)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.sendall(random_request(rng))
        time.sleep(rng.uniform(0.0, MAX_RESET_DELAY_S))


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    limits = AdmissionLimits(max_buffered_outputs=10 * MAX_TOKENS)  # no slow-client abort to clean up after a bug
    with running_server(make_engine(real_model, real_tokenizer, num_blocks=NUM_BLOCKS), limits=limits) as running:
        yield running


def test_resets_at_random_points_of_submission_leave_no_request_and_no_block_and_no_server_error(server, caplog):
    port = int(server.url.rsplit(":", 1)[1])
    faults = requests.post(f"{server.url}/admin/faults", json={"step_delay": STEP_DELAY_S},
                           headers=server.admin_headers, timeout=10)  # fmt: skip
    assert faults.status_code == 200, faults.text

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(RESETS_PER_CLIENT):
            reset_after_sending(port, rng)

    with caplog.at_level(logging.ERROR):
        clients = [threading.Thread(target=client, args=(seed,)) for seed in range(NUM_CLIENTS)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(120)
        lifecycle = server.runner.app[LIFECYCLE]
        wait_until(lambda: lifecycle.count_connections() == 0, "every reset connection to be gone", timeout_s=30)

        def nothing_left() -> str | None:
            exposition = requests.get(f"{server.url}/metrics", timeout=10).text
            running = metric_value(exposition, "vllm:num_requests_running")
            waiting = metric_value(exposition, "vllm:num_requests_waiting")
            free = metric_value(exposition, "kvstorm:free_blocks", pool="device")
            left = (running, waiting, free, server.async_engine.num_in_flight)
            return exposition if left == (0, 0, NUM_BLOCKS, 0) else None

        # Each abort lands in the engine's next iteration: a few of its 20 ms steps. An orphan would take 20 s.
        exposition = wait_until(nothing_left, "no request running or waiting and every block free", timeout_s=10)
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]
    assert metric_value(exposition, "kvstorm:rejected_requests_total", reason="internal_error") == 0
    assert metric_value(exposition, "kvstorm:aborted_requests_total", phase="decode", reason="client") > 0
    requests.delete(f"{server.url}/admin/faults", headers=server.admin_headers, timeout=10)
    answered = requests.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert answered.status_code == 200, answered.text
