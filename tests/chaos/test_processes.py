"""The one way chaos, benchmarks, scripts and tests start a kvstorm (``chaos.injectors.processes.kvstorm_server``)."""

from __future__ import annotations

import pytest
import requests

from chaos.injectors.processes import kvstorm_server


def test_a_started_kvstorm_serves_on_loopback_and_is_stopped_after_the_block():
    with kvstorm_server(["--model", "random:tiny", "--kv-cache-memory", "8MiB"]) as kvstorm:
        assert kvstorm.url.startswith("http://127.0.0.1:")
        assert requests.get(f"{kvstorm.url}/ready", timeout=10).status_code == 200
    assert not kvstorm.server.is_running
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{kvstorm.url}/ready", timeout=5)


def test_a_kvstorm_that_cannot_start_fails_with_the_end_of_its_log():
    refused = pytest.raises(RuntimeError, match=r"(?s)exited with \d+ before ready; the end of .*no-such-model")
    with refused, kvstorm_server(["--model", "no-such-model"]):
        pytest.fail("a server without a model cannot be ready")
