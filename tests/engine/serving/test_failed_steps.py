"""Steps that run out of memory (faults injected through /admin/faults) break no stream: the engine backs off and
every stream completes; a request the engine gives up on ends with an error event and [DONE], and only that one."""

from __future__ import annotations

import json

import requests

from tests.engine.serving.conftest import make_tiny_engine, metric_value, running_server
from tests.engine.serving.test_liveness_and_admission import TINY, finish_reasons, stream_in_background

NUM_STREAMS, PROMPT_LEN, MAX_TOKENS = 6, 20, 12


def set_faults(server, faults: object) -> requests.Response:
    return requests.post(f"{server.url}/admin/faults", json=faults, headers=server.admin_headers, timeout=60)


NO_FAULTS = {
    "kv_cap": None,
    "swap_cap": None,
    "swap_delay_per_block": 0.0,
    "step_delay": 0.0,
    "oom_above_batched_tokens": None,
    "fail_next_steps": 0,
    "memory_hog": 0,
    "freeze": None,
    "active": [],
    "lease_s": None,
}


def token_chunks(lines: list[str]) -> int:
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    return sum(1 for c in chunks if c["choices"] and "text" in c["choices"][0])


def test_streams_survive_a_vram_cap_and_only_a_request_failing_alone_ends_in_error():
    with running_server(make_tiny_engine(max_num_batched_tokens=128), name=TINY) as server:
        # A cap of 16 tokens a step, where the streams' prompts alone need 120: most steps would run out of memory.
        assert set_faults(server, {"oom_above_batched_tokens": 16}).json() == {
            **NO_FAULTS,
            "oom_above_batched_tokens": 16,
            "active": ["oom_above_batched_tokens"],
        }
        streams = [
            stream_in_background(server.url, prompt=list(range(1 + i, 1 + i + PROMPT_LEN)), max_tokens=MAX_TOKENS)
            for i in range(NUM_STREAMS)
        ]
        for thread, _ in streams:
            thread.join(120)
        for _, lines in streams:
            assert lines[-1] == "data: [DONE]"
            assert finish_reasons(lines) == ["length"]
            assert token_chunks(lines) == MAX_TOKENS
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(metrics, "kvstorm:failed_steps_total", error="OutOfMemoryError") > 0
        assert metric_value(metrics, "kvstorm:active_faults", fault="oom_above_batched_tokens") == 1
        assert metric_value(metrics, "vllm:request_success_total", finished_reason="length") == NUM_STREAMS

        # Every step fails: one request, alone, is given up on after three tries; its stream says why.
        set_faults(server, {"oom_above_batched_tokens": None, "fail_next_steps": 10**6})
        thread, lines = stream_in_background(server.url, max_tokens=MAX_TOKENS)
        thread.join(120)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "gave up on this request after 3 failed steps in which it ran alone" in error["message"]
        response = requests.post(
            f"{server.url}/v1/completions", json={"model": TINY, "prompt": [1, 2, 3], "max_tokens": 4}, timeout=120
        )
        assert response.status_code == 500
        assert "OutOfMemoryError: injected" in response.json()["error"]["message"]

        # The fault lifted, the engine serves as before.
        assert set_faults(server, {"fail_next_steps": 0}).json()["fail_next_steps"] == 0
        thread, lines = stream_in_background(server.url, max_tokens=MAX_TOKENS)
        thread.join(120)
        assert finish_reasons(lines) == ["length"]
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(metrics, "vllm:request_success_total", finished_reason="error") == 2
        assert metric_value(metrics, "kvstorm:active_faults", fault="fail_next_steps") == 0
        assert metric_value(metrics, "kvstorm:free_blocks", pool="device") == metric_value(
            metrics, "kvstorm:total_blocks", pool="device"
        )


def test_bad_faults_are_refused_with_400_and_change_nothing():
    with running_server(make_tiny_engine(), name=TINY) as server:
        for body, fragment in (
            ({"fail_next_steps": -1}, "fail_next_steps must be an integer in [0, 1000000000], got -1"),
            ({"oom_above_batched_tokens": "8"}, "oom_above_batched_tokens must be an integer in [0, 1000000000]"),
            ({"slow_network": 1}, "unknown fault 'slow_network'"),
            ([1, 2], "the body must be a JSON object of faults"),
        ):
            response = set_faults(server, body)
            assert response.status_code == 400, body
            assert fragment in response.json()["error"]["message"]
        current = requests.get(f"{server.url}/admin/faults", headers=server.admin_headers, timeout=60)
        assert current.json() == NO_FAULTS
        assert requests.get(f"{server.url}/admin/faults", timeout=60).status_code == 401
        document = requests.get(f"{server.url}/openapi.json", timeout=60).json()
        assert set(document["paths"]["/admin/faults"]) == {"get", "post", "delete"}
