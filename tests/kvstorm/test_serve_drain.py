"""``kvstorm serve`` on SIGTERM, as an orchestrator stops it: ``/ready`` turns 503, new requests get 503 with
Retry-After, the streams in flight finish, and the process exits 0."""

from __future__ import annotations

import json
import secrets
import signal
import threading

import requests

from chaos.injectors.processes import kvstorm_server
from tests.engine.serving.conftest import metric_value, wait_until

MODEL = "tiny"


def stream(url: str, results: list[tuple[bool, str | None]]) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "stream": True}
    events = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as response:
        events = [line[6:].decode() for line in response.iter_lines() if line.startswith(b"data: ")]
    chunks = [json.loads(event) for event in events[:-1]]
    results.append((events[-1] == "[DONE]", chunks[-1]["choices"][0]["finish_reason"] if chunks else None))


def test_sigterm_lets_the_streams_in_flight_finish_and_exits_0(tmp_path):
    token = secrets.token_hex(16)
    serve_args = ["--model", "random:tiny", "--served-model-name", MODEL, "--admin-token", token,
                  "--drain-timeout", "60", "--ttft-slo", "off"]  # fmt: skip
    with kvstorm_server(serve_args, tmp_path / "server.log") as kvstorm:
        url, server = kvstorm.url, kvstorm.server
        # 40 tokens at 50 ms a step: two seconds of streaming to stop the server in.
        admin = {"Authorization": f"Bearer {token}"}
        requests.post(f"{url}/admin/faults", json={"step_delay": 0.05}, headers=admin, timeout=10).raise_for_status()
        results: list[tuple[bool, str | None]] = []
        clients = [threading.Thread(target=stream, args=(url, results)) for _ in range(4)]
        for client in clients:
            client.start()

        def num_running() -> float:
            return metric_value(requests.get(f"{url}/metrics", timeout=10).text, "vllm:num_requests_running")

        wait_until(lambda: num_running() == 4, "four streams running")
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: requests.get(f"{url}/ready", timeout=10).status_code == 503, "/ready to turn 503")
        refused = requests.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1]}, timeout=10)
        assert (refused.status_code, refused.headers.get("Retry-After")) == (503, "5")
        for client in clients:
            client.join(60)
        assert server.process.wait(60) == 0
    assert results == [(True, "length")] * 4
    log = (tmp_path / "server.log").read_text()
    assert "draining (up to 60 s)" in log
    assert "0 streams still in flight end now" in log
