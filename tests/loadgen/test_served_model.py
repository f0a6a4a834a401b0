"""The model a server serves, asked of a real HTTP server on loopback: OpenAI's list read as input, typed and
bounded, and every way of not naming a model refused with what was wrong."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from loadgen.served_model import MAX_BODY_BYTES, NoServedModel, served_model


@contextmanager
def answering(status: int, body: bytes) -> Iterator[str]:
    """A server on loopback that answers every GET with ``status`` and ``body``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def models(*ids: object) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": model, "object": "model"} for model in ids]}).encode()


def test_the_first_listed_model_is_taken():
    with answering(200, models("Qwen/Qwen3-0.6B", "other")) as url:
        assert served_model(url) == "Qwen/Qwen3-0.6B"
        assert served_model(url + "/") == "Qwen/Qwen3-0.6B"


def test_ids_that_are_no_model_name_are_passed_over():
    with answering(200, models(7, "", "x" * 257, "a\nb", "kept")) as url:
        assert served_model(url) == "kept"


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (404, b"not here", "HTTP 404"),
        (200, b"<html>", "not OpenAI's model list"),
        (200, b'{"data": {"id": "m"}}', "no model listed"),
        (200, b"[1, 2]", "not OpenAI's model list"),
        (200, models(), "no model listed"),
        (200, b" " * (MAX_BODY_BYTES + 1), "more than"),
    ],
    ids=["404", "html", "data-not-a-list", "a-list", "empty", "too-long"],
)
def test_an_answer_that_names_no_model_is_refused_with_why(status, body, says):
    with answering(status, body) as url, pytest.raises(NoServedModel, match=says):
        served_model(url)


def test_a_server_that_does_not_answer_is_refused():
    with answering(200, models("m")) as url:
        pass  # closed: nothing listens there any more
    with pytest.raises(NoServedModel, match="ConnectionError"):
        served_model(url, timeout_s=5)
