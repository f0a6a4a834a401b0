"""``kvstorm serve --admin-exit``: ``POST /admin/exit`` ends the real process, as SIGKILL would (at once, exit 137, the
streams in flight cut) or as SIGTERM would (a drain, exit 0), for a supervisor to start it again; without the flag,
or without the token, nothing ends."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading

import requests

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.injectors.processes import kvstorm_server
from engine.serving.admin_exit import EXIT_KILLED
from tests.engine.serving.conftest import metric_value, wait_until

MODEL = "tiny"
TOKEN = secrets.token_hex(16)
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SERVE_ARGS = ["--model", "random:tiny", "--served-model-name", MODEL, "--admin-token", TOKEN, "--ttft-slo", "off"]


def exit_now(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/admin/exit", json=body or None, headers=ADMIN, timeout=10)


def stream(url: str, ended: list[bool]) -> None:
    """One stream of 40 tokens; ``ended`` gets whether it ended with ``[DONE]`` (False when it was cut)."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "stream": True}
    lines = []
    try:
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line.startswith(b"data: ")]
    except requests.RequestException:
        pass
    ended.append(bool(lines) and lines[-1] == b"data: [DONE]")


def streams_in_flight(url: str, num_streams: int) -> tuple[list[threading.Thread], list[bool]]:
    """``num_streams`` streams of 40 tokens at 50 ms a step, running: two seconds to end the server in."""
    requests.post(f"{url}/admin/faults", json={"step_delay": 0.05}, headers=ADMIN, timeout=10).raise_for_status()
    ended: list[bool] = []
    clients = [threading.Thread(target=stream, args=(url, ended), daemon=True) for _ in range(num_streams)]
    for client in clients:
        client.start()

    def num_running() -> float:
        return metric_value(requests.get(f"{url}/metrics", timeout=10).text, "vllm:num_requests_running")

    wait_until(lambda: num_running() == num_streams, f"{num_streams} streams running")
    return clients, ended


def test_without_the_flag_or_the_token_nothing_ends(tmp_path):
    with kvstorm_server(SERVE_ARGS, tmp_path / "server.log") as kvstorm:
        url, server = kvstorm.url, kvstorm.server
        assert requests.get(f"{url}/admin/exit", headers=ADMIN, timeout=10).json() == {"enabled": False, "signals": []}
        refused = exit_now(url)
        assert refused.status_code == 403
        assert "--admin-exit" in refused.json()["error"]["message"]
        assert requests.post(f"{url}/admin/exit", timeout=10).status_code == 401
        assert server.is_running
        assert requests.get(f"{url}/ready", timeout=10).status_code == 200


def test_the_flag_needs_an_admin_token():
    env = {key: value for key, value in os.environ.items() if key != ADMIN_TOKEN_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "kvstorm", "serve", "--model", "random:tiny", "--admin-exit"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--admin-exit needs an admin token" in result.stderr


def test_exit_as_sigkill_ends_the_process_at_once_and_cuts_the_streams(tmp_path):
    with kvstorm_server([*SERVE_ARGS, "--admin-exit"], tmp_path / "server.log") as kvstorm:
        url, server = kvstorm.url, kvstorm.server
        assert requests.get(f"{url}/admin/exit", headers=ADMIN, timeout=10).json()["enabled"] is True
        for body in ({"signal": "SIGSEGV"}, {"signal": "SIGKILL", "command": "ls"}, {"signal": ["SIGKILL"]}):
            refused = exit_now(url, **body)
            assert refused.status_code == 400, body
        assert requests.post(f"{url}/admin/exit", timeout=10).status_code == 401
        assert server.is_running
        clients, ended = streams_in_flight(url, 2)
        taken = exit_now(url)  # no body: SIGKILL
        assert (taken.status_code, taken.json()) == (202, {"exiting": True, "signal": "SIGKILL"})
        assert server.process.wait(10) == EXIT_KILLED
        for client in clients:
            client.join(30)
    assert ended == [False, False], "the streams of a killed server are cut: none ends with [DONE]"
    assert "draining" not in (tmp_path / "server.log").read_text()


def test_exit_as_sigterm_drains_the_streams_and_exits_0(tmp_path):
    with kvstorm_server([*SERVE_ARGS, "--admin-exit", "--drain-timeout", "60"], tmp_path / "server.log") as kvstorm:
        url, server = kvstorm.url, kvstorm.server
        clients, ended = streams_in_flight(url, 3)
        assert exit_now(url, signal="SIGTERM").status_code == 202
        assert server.process.wait(60) == 0
        for client in clients:
            client.join(30)
    assert ended == [True, True, True], "the streams in flight finish"
    assert "draining (up to 60 s)" in (tmp_path / "server.log").read_text()
