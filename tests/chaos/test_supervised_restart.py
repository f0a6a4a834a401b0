"""kill-and-restart against a server someone else runs, as in a container stack: a real ``kvstorm serve --admin-exit``
under a real supervisor (a shell loop that starts it again whenever it exits, 0.1 s later, as Docker's restart policy
does), asked to exit through its admin API and timed back to ready; the library's experiment through the controller
(``--supervised-target``, no ``--model``: it asks the target); NOT APPLICABLE against a server that would not exit."""

from __future__ import annotations

import http.server
import secrets
import shlex
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.injectors.processes import ManagedServer, free_port
from chaos.injectors.supervised import SupervisedServer
from tests.chaos.test_controller import AUTH, controller, events_until_end

TOKEN = secrets.token_hex(16)
# The experiment's load, about a request a second for its 60 s, the kill 10 s in: the requests sent while the server
# is down fail, so the success ratio it must keep (0.5) needs a load about twice as long as the restart (7 s on a calm
# 2-core machine, 24 s on a busy one).
QUICK = {
    "baseline_requests": 2,
    "input_len": "fixed:32",
    "output_len": "fixed:16",
    "rate_unit": "req/s",
    "arrival": "poisson:rate=1",
    "duration_s": 60,
    "kill_after_s": 10,
}


@contextmanager
def supervised_kvstorm(workdir: Path, *serve_args: str) -> Iterator[tuple[str, ManagedServer, Path]]:
    """A kvstorm serve under a shell loop that starts it again whenever it exits; yields its URL, the supervisor and
    the log both write (each start says "listening on")."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "kvstorm", "serve", "--port", str(port), "--admin-token", TOKEN, *serve_args]
    log = workdir / "supervised.log"
    supervisor = ManagedServer(["sh", "-c", f"while :; do {shlex.join(serve)}; sleep 0.1; done"], f"{url}/ready", log)
    supervisor.start()
    try:
        yield url, supervisor, log
    finally:
        supervisor.stop()


@pytest.fixture
def supervised(tmp_path, monkeypatch) -> Iterator[tuple[str, ManagedServer, Path]]:
    """The bundled model as compose runs it (--admin-exit, a KV pool a burst fills), its admin token in the
    environment for the harness."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    serve_args = ("--num-kv-blocks", "88", "--swap-space", "256MiB", "--ttft-slo", "off", "--admin-exit")
    with supervised_kvstorm(tmp_path, *serve_args) as running:
        yield running


def test_a_server_asked_to_exit_is_timed_back_to_ready_by_its_supervisor(supervised):
    url, supervisor, log = supervised
    server = SupervisedServer(url, f"{url}/ready", TOKEN)
    assert server.refusal() is None
    assert server.kill("SIGKILL") < 10
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=5)
    ready_s = server.start(timeout_s=180)
    assert 0 < ready_s < 180
    assert supervisor.is_running, "its supervisor started it again, not the harness"
    assert log.read_text().count("kvstorm serve: listening on") == 2
    server.stop()
    assert requests.get(f"{url}/ready", timeout=10).status_code == 200, "stop leaves it to its supervisor"


@contextmanager
def answering_404() -> Iterator[str]:
    """A server with no /admin/exit (every path 404), on loopback."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_that_would_not_exit_is_named_with_the_reason_and_nothing_is_sent(kvstorm_server, monkeypatch):
    url = kvstorm_server.url  # no --admin-exit
    assert "started without --admin-exit" in SupervisedServer(url, f"{url}/ready").refusal()
    assert "refused the admin token" in SupervisedServer(url, f"{url}/ready", "wrong").refusal()
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    assert "admin token is needed" in SupervisedServer(url, f"{url}/ready").refusal()
    with answering_404() as elsewhere:
        assert "has no" in SupervisedServer(elsewhere, f"{elsewhere}/health", TOKEN).refusal()
    assert requests.get(f"{url}/ready", timeout=10).status_code == 200


def run_kill_and_restart(url: str, auth: dict[str, str] = AUTH) -> tuple[dict, list[dict]]:
    """The library's kill-and-restart through the controller at ``url``, to its end: the run and its events."""
    started = requests.post(
        f"{url}/runs", json={"experiment": "kill-and-restart", "overrides": QUICK}, headers=auth, timeout=60
    )
    assert started.status_code == 201, started.text
    events = events_until_end(url, started.json()["id"], auth)
    return requests.get(f"{url}/runs/{started.json()['id']}", headers=auth, timeout=30).json(), events


def test_the_librarys_kill_and_restart_through_the_controller_against_a_supervised_server(supervised, tmp_path):
    url, supervisor, log = supervised
    with controller(SimpleNamespace(url=url), tmp_path, "--supervised-target") as (controller_url, _):
        run, events = run_kill_and_restart(controller_url)
    verdict = run["verdict"]
    assert run["status"] == "held", verdict["reason"]
    (ready_s,) = verdict["restarts_s"]
    assert 0 < ready_s < 180
    down = [(event["name"], event["active"]) for event in events if event["type"] == "fault"]
    assert down == [("server:down", True), ("server:down", False)]
    assert supervisor.is_running
    assert log.read_text().count("kvstorm serve: listening on") == 2
    # The restarted server is clean: no fault on, nothing in flight.
    admin = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(f"{url}/admin/faults", headers=admin, timeout=10).json()["active"] == []
    assert requests.get(f"{url}/ready", timeout=10).status_code == 200


def test_kill_and_restart_against_a_server_that_would_not_exit_is_not_applicable(kvstorm_server, tmp_path):
    with controller(kvstorm_server, tmp_path, "--supervised-target") as (controller_url, _):
        run, events = run_kill_and_restart(controller_url)
    assert run["status"] == "not_applicable", run
    assert "started without --admin-exit" in run["verdict"]["reason"]
    assert not [event for event in events if event["type"] in ("fault", "load")], "nothing was sent"
