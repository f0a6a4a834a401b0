"""The chaos controller over real HTTP, as its own process, against the real engine: routes and their refusals, a run
followed to its verdict through Server-Sent Events, a run stopped midway, and no fault left behind when the
controller stops (SIGTERM) or dies (SIGKILL: the engine's lease)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.injectors.processes import ManagedServer, free_port
from tests.chaos.test_experiments import SHORT

TOKEN = "controller-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEASE_S = 3.0


@contextmanager
def controller(kvstorm_server, tmp_path, *options: str) -> Iterator[tuple[str, ManagedServer]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = ["kvstorm", "chaos", "serve", "--target", kvstorm_server.url, "--port", str(port),
               "--results-dir", str(tmp_path / "results"), "--lease-s", str(LEASE_S), "--max-run-s", "300",
               *options]  # fmt: skip
    os.environ["KVSTORM_CHAOS_TOKEN"] = TOKEN
    process = ManagedServer(command, f"{url}/health", tmp_path / "controller.log")
    process.start()
    try:
        yield url, process
    finally:
        process.stop()


def start_run(url: str, **overrides) -> requests.Response:
    body = {"experiment": "burst-with-vram-cap", "overrides": {**SHORT, **overrides}}
    return requests.post(f"{url}/runs", json=body, headers=AUTH, timeout=60)


def events_until_end(url: str, run_id: str, headers: dict[str, str] = AUTH) -> list[dict]:
    events = []
    with requests.get(f"{url}/runs/{run_id}/events", headers=headers, stream=True, timeout=600) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return events


def wait_for(condition, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def engine_cap(kvstorm_server):
    return kvstorm_server.admin.faults()["kv_cap"]


@pytest.fixture(scope="module")
def running_controller(kvstorm_server, tmp_path_factory):
    with controller(kvstorm_server, tmp_path_factory.mktemp("controller")) as (url, _):
        yield url


def test_routes_need_the_token_and_refuse_bad_input_with_a_clear_message(running_controller, kvstorm_server):
    url = running_controller
    for path in ("/experiments", "/runs", "/faults"):
        assert requests.get(f"{url}{path}", timeout=30).status_code == 401
        assert requests.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    for path in ("/health", "/metrics", "/openapi.json", "/docs"):
        assert requests.get(f"{url}{path}", timeout=30).status_code == 200
    library = requests.get(f"{url}/experiments", headers=AUTH, timeout=30).json()
    vram = next(e for e in library if e["name"] == "burst-with-vram-cap")
    assert vram["parameters"]["cap_fraction"] == 0.3
    assert "co-tenant" in vram["description"]

    unknown = requests.post(f"{url}/runs", json={"experiment": "nope"}, headers=AUTH, timeout=30)
    assert unknown.status_code == 404
    assert "GET /experiments" in unknown.json()["detail"]
    bad_parameter = start_run(url, bogus=1)
    assert bad_parameter.status_code == 400
    assert "unknown parameters ['bogus']" in bad_parameter.json()["detail"]
    reserved = start_run(url, target_url="http://elsewhere")
    assert reserved.status_code == 400
    assert requests.post(f"{url}/runs", json={"overrides": {}}, headers=AUTH, timeout=30).status_code == 422
    extra = requests.post(f"{url}/runs", json={"experiment": "oom-storm", "x": 1}, headers=AUTH, timeout=30)
    assert extra.status_code == 422
    assert requests.get(f"{url}/runs", headers=AUTH, timeout=30).json() == [], "nothing started half-configured"

    bad_fault = requests.put(f"{url}/faults", json={"kv_cap": 3, "step_delay": 0.1}, headers=AUTH, timeout=30)
    assert bad_fault.status_code == 400
    assert "kv_cap must be" in bad_fault.json()["detail"]
    assert kvstorm_server.admin.faults()["step_delay"] == 0
    assert requests.put(f"{url}/faults", json={"lease_s": 5}, headers=AUTH, timeout=30).status_code == 400


def test_a_run_followed_to_its_verdict_with_its_report_and_its_fault_windows_in_the_metrics(
    running_controller, kvstorm_server
):
    url = running_controller
    started = start_run(url)
    assert started.status_code == 201, started.text
    run_id = started.json()["id"]
    assert start_run(url).status_code == 409
    events = events_until_end(url, run_id)
    kinds = [event["type"] for event in events]
    assert kinds[-2:] == ["verdict", "end"]
    assert {"phase", "activity", "fault", "load", "request"} <= set(kinds)
    assert [e["active"] for e in events if e["type"] == "fault"] == [True, False]
    run = requests.get(f"{url}/runs/{run_id}", headers=AUTH, timeout=30).json()
    assert (run["status"], run["verdict"]["exit_code"]) == ("held", 0)
    report = requests.get(f"{url}/runs/{run_id}/report", headers=AUTH, timeout=30)
    assert report.status_code == 200
    assert "engine:kv_cap" in report.text
    assert engine_cap(kvstorm_server) is None

    families = {f.name: f for f in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text)}
    windows = {s.labels["edge"]: s.value for s in families["kvstorm_chaos_fault_window_seconds"].samples
               if s.labels["run"] == run_id and s.labels["fault"] == "engine:kv_cap"}  # fmt: skip
    assert windows["start"] < windows["end"]
    assert windows["end"] - windows["start"] == pytest.approx(SHORT["cap_for_s"], abs=1.0)
    runs_total = {(s.labels["experiment"], s.labels["result"]): s.value for s in families["kvstorm_chaos_runs"].samples
                  if s.name.endswith("_total")}  # fmt: skip
    assert runs_total[("burst-with-vram-cap", "held")] == 1
    requests_ok = [s for s in families["kvstorm_chaos_client_requests"].samples if s.labels.get("outcome") == "ok"]
    assert requests_ok[0].value == sum(1 for e in events if e["type"] == "request" and e["outcome"] == "ok") > 0
    engine = requests.get(f"{kvstorm_server.url}/metrics", timeout=30).text
    engine_bounds = {line.split('le="')[1].split('"')[0] for line in engine.splitlines()
                     if line.startswith("vllm:time_to_first_token_seconds_bucket")}  # fmt: skip
    client_bounds = {s.labels["le"] for s in families["kvstorm_chaos_client_time_to_first_token_seconds"].samples
                     if s.name.endswith("_bucket")}  # fmt: skip
    assert {float(b) for b in client_bounds} == {float(b) for b in engine_bounds}


def test_a_run_stopped_midway_runs_its_rollbacks_and_leaves_the_engine_healthy(running_controller, kvstorm_server):
    url = running_controller
    run_id = start_run(url, cap_for_s=30, duration_s=40).json()["id"]
    wait_for(lambda: engine_cap(kvstorm_server), "the cap to be set")
    asked = time.monotonic()
    stopped = requests.delete(f"{url}/runs/{run_id}", headers=AUTH, timeout=120).json()
    assert stopped["status"] == "stopped"
    # The load is cut short, not waited out: its schedule had more than 30 s to go.
    assert time.monotonic() - asked < 20
    assert engine_cap(kvstorm_server) is None
    assert kvstorm_server.admin.faults()["lease_s"] is None
    assert requests.get(f"{kvstorm_server.url}/health", timeout=30).status_code == 200


def test_stopping_the_controller_clears_its_faults_and_a_dead_one_leaves_none_beyond_the_lease(
    kvstorm_server, tmp_path
):
    with controller(kvstorm_server, tmp_path / "term") as (url, process):
        assert requests.put(f"{url}/faults", json={"kv_cap": {"fraction": 0.5}}, headers=AUTH, timeout=30).ok
        time.sleep(LEASE_S * 1.5)
        assert engine_cap(kvstorm_server) == {"fraction": 0.5}, "the controller renews the lease while it lives"
        process.kill("SIGTERM")
        assert engine_cap(kvstorm_server) is None, "a controller that stops clears what it set"

    with controller(kvstorm_server, tmp_path / "kill") as (url, process):
        assert requests.put(f"{url}/faults", json={"kv_cap": {"fraction": 0.5}}, headers=AUTH, timeout=30).ok
        killed = time.monotonic()
        os.kill(process.process.pid, signal.SIGKILL)
        wait_for(lambda: engine_cap(kvstorm_server) is None, "the lease to run out", timeout_s=LEASE_S + 5)
        assert time.monotonic() - killed <= LEASE_S + 1.5


def test_an_engine_refusing_the_controllers_token_is_a_bad_gateway_not_the_callers_fault(
    kvstorm_server, tmp_path, monkeypatch
):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "not-the-engines-token")
    with controller(kvstorm_server, tmp_path) as (url, _):
        response = requests.put(f"{url}/faults", json={"step_delay": 0.1}, headers=AUTH, timeout=30)
    assert response.status_code == 502, response.text
    assert re.search(r"the engine refused: .*HTTP 40[13]", response.json()["detail"]), response.text
    assert kvstorm_server.admin.faults()["step_delay"] == 0
