"""compose's scrape-target (dashboards/scrape_target.py): the file_sd target Prometheus' engine job reads, derived
from the stack's one target URL, written only once the server answers /health; a URL it cannot be refused. That a
real Prometheus scrapes through the file: tests/test_compose.py's stack and `make compose-check`."""

from __future__ import annotations

import json

import pytest

from dashboards.scrape_target import main, scrape_targets
from tests.loadgen.test_served_model import answering


@pytest.mark.parametrize(
    ("url", "address", "scheme", "metrics_path"),
    [
        ("http://engine:8000", "engine:8000", "http", "/metrics"),
        ("http://host.docker.internal:8000/", "host.docker.internal:8000", "http", "/metrics"),
        ("https://gateway.example/llm", "gateway.example:443", "https", "/llm/metrics"),
        ("http://10.0.0.7", "10.0.0.7:80", "http", "/metrics"),
        ("http://[::1]:9000", "[::1]:9000", "http", "/metrics"),
    ],
)
def test_the_target_is_where_the_url_says_with_its_metrics_under_its_path(url, address, scheme, metrics_path):
    (group,) = scrape_targets(url)
    assert group == {"targets": [address], "labels": {"__scheme__": scheme, "__metrics_path__": metrics_path}}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("engine:8000", "expected http://"),
        ("file:///etc/passwd", "expected http://"),
        ("http://user:secret@engine:8000", "credentials"),
        ("http://engine:8000/?x=1", "no query"),
        ("http://engine:99999", "port"),
    ],
)
def test_a_url_no_server_has_is_refused(url, says):
    with pytest.raises(ValueError, match=says):
        scrape_targets(url)
    assert "secret" not in says


def test_the_file_is_written_once_the_server_answers(tmp_path):
    targets_file = tmp_path / "engine.json"
    with answering(200, b"{}") as url:
        assert main([url, str(targets_file), "--timeout-s", "30"]) == 0
    port = url.rsplit(":", 1)[1]
    assert json.loads(targets_file.read_text()) == scrape_targets(f"http://127.0.0.1:{port}")
    assert [path.name for path in tmp_path.iterdir()] == ["engine.json"], "no partial file left"


def test_nothing_is_written_for_a_server_that_never_answers_or_a_bad_url(tmp_path, capsys):
    targets_file = tmp_path / "engine.json"
    with answering(503, b"starting") as url:
        assert main([url, str(targets_file), "--timeout-s", "1"]) == 1
    assert "did not answer 200 within 1 s" in capsys.readouterr().err
    assert main(["http://user:secret@engine:8000", str(targets_file)]) == 1
    assert "secret" not in capsys.readouterr().err
    assert not targets_file.exists()
