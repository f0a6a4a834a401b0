"""One request cannot hurt its neighbours: what would make its per-token work or its submission large is capped with a
clear 400 naming the field, unknown field names cannot grow the server's memory, and a client that stops reading is
aborted whatever its ``n``. (What the caps buy in latency is measured by ``scripts/bench_neighbours.py``.)"""

from __future__ import annotations

import asyncio
import json

import pytest
import requests

from engine.core.admission import AdmissionLimits
from engine.core.sampling_params import SamplingParams
from engine.serving import request_body
from engine.serving.async_engine import AsyncEngine
from engine.serving.metrics import EngineMetrics
from engine.serving.protocol import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS
from engine.serving.request_body import IGNORED_FIELDS_HEADER, MAX_UNKNOWN_FIELDS
from engine.serving.server import _merge, retry_key_of
from tests.engine.serving.conftest import make_engine, make_tiny_engine, metric_value, running_server

MODEL = "smollm2-135m"
OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    with running_server(make_engine(real_model, real_tokenizer), max_body_bytes=4 << 20) as running:
        yield running


def post(server, **fields) -> requests.Response:
    return requests.post(f"{server.url}/v1/completions", json={**OK, **fields}, timeout=60)


CAPPED = [
    ("logit_bias", {"logit_bias": {str(t): 1.0 for t in range(49152)}}, f"at most {MAX_LOGIT_BIAS}"),
    ("stop", {"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, f"at most {MAX_STOP_STRING_CHARS} characters"),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}, "at most 4 items"),
    ("stop_token_ids", {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, f"at most {MAX_STOP_TOKEN_IDS}"),
    ("n", {"prompt": ["Hi"] * 2, "n": 65}, "2 prompts x n=65 = 130 sequences; at most 128 per request"),
    ("prompt", {"prompt": [-1], "echo": True}, "token ids must be integers in [0, 49152)"),
]


@pytest.mark.parametrize(("param", "fields", "fragment"), CAPPED)
def test_a_field_past_its_cap_gets_a_400_naming_it(server, param, fields, fragment):
    response = post(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert fragment in error["message"]


def test_n_as_openai_clients_send_it_is_served_and_a_lowered_sequence_cap_holds_on_the_chat_route_too(
    server, real_model, real_tokenizer
):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 3}
    served = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert served.status_code == 200, served.text
    assert [choice["index"] for choice in served.json()["choices"]] == [0, 1, 2]
    with running_server(make_engine(real_model, real_tokenizer), max_sequences=2) as capped:
        response = requests.post(f"{capped.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"
    assert "1 prompts x n=3 = 3 sequences; at most 2" in response.json()["error"]["message"]


def test_at_their_caps_the_fields_are_served(server):
    fields = {"logit_bias": {str(t): 1.0 for t in range(MAX_LOGIT_BIAS)}, "stop": ["y" * MAX_STOP_STRING_CHARS] * 4,
              "stop_token_ids": list(range(1, MAX_STOP_TOKEN_IDS + 1)), "prompt": [[1, 2], [3, 4]],
              "n": 64}  # fmt: skip
    response = post(server, **fields)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 128  # the default --max-sequences-per-request
    echoed = post(server, prompt=[0, 1], echo=True)
    assert echoed.status_code == 200, echoed.text


def test_unknown_field_names_cannot_grow_the_server(server):
    logged_before = set(request_body._ignored_fields_logged)
    for index in range(50):
        body = {**OK, f"{index}{'x' * (1 << 20)}": 1}  # 1 MB names, each new
        response = requests.post(f"{server.url}/v1/completions", data=json.dumps(body), timeout=60)
        assert response.status_code == 400
        assert "name over 64 characters" in response.json()["error"]["message"]
    many = {**OK, **{f"unknown_{i}": 1 for i in range(MAX_UNKNOWN_FIELDS + 1)}}
    assert requests.post(f"{server.url}/v1/completions", json=many, timeout=60).status_code == 400
    assert request_body._ignored_fields_logged == logged_before
    assert post(server, some_unknown_field=1).headers[IGNORED_FIELDS_HEADER] == "some_unknown_field"


@pytest.mark.parametrize("name", ["bad\r\nX-Injected: 1", "new\nline", "a b", "comma,name", "caf\u00e9", "", "x\x00"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_field_whose_name_is_no_header_token_is_refused_and_never_echoed(server, name, stream):
    body = json.dumps({**OK, "stream": stream, name: 1})
    response = requests.post(f"{server.url}/v1/completions", data=body, timeout=30)
    assert response.status_code == 400, response.text
    assert "only a name of letters, digits and" in response.json()["error"]["message"]
    assert IGNORED_FIELDS_HEADER not in response.headers
    assert "X-Injected" not in response.headers
    # A name of token characters only is still ignored and named.
    fine = requests.post(f"{server.url}/v1/completions", json={**OK, "stream": stream, "x-tra_1.~": 1}, timeout=30)
    assert fine.status_code == 200, fine.text
    assert fine.headers[IGNORED_FIELDS_HEADER] == "x-tra_1.~"


def test_a_client_that_reads_none_of_its_n_choices_is_aborted_like_one_with_one():
    engine = make_tiny_engine()
    metrics = EngineMetrics("tiny")
    async_engine = AsyncEngine(engine, metrics, AdmissionLimits(max_buffered_outputs=4))

    async def read_one_then_stop() -> None:
        async_engine.start(asyncio.get_running_loop())
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            streams = [async_engine.submit([1, 2, 3], params, f"slow-{i}") for i in range(2)]
            merged = _merge(streams)
            await anext(merged)  # the writer took one output, then its client stopped reading
            while async_engine.num_in_flight:
                await asyncio.sleep(0.01)
            await merged.aclose()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    asyncio.run(read_one_then_stop())
    assert engine.kv_cache_manager.device_pool.num_free_blocks == engine.kv_cache_manager.device_pool.num_blocks
    exposition = metrics.exposition().decode()
    assert metric_value(exposition, "kvstorm:aborted_requests_total", phase="decode", reason="slow_client") == 2


def test_a_retry_ticket_belongs_to_the_client_that_was_refused():
    body = json.dumps(OK)
    key = retry_key_of("127.0.0.1", "Bearer a", body)
    assert retry_key_of("127.0.0.1", "Bearer a", body) == key  # the same request sent again
    assert retry_key_of("127.0.0.2", "Bearer a", body) != key  # from elsewhere
    assert retry_key_of("127.0.0.1", "Bearer b", body) != key  # with other credentials
    assert retry_key_of("127.0.0.1", None, body) != key
    assert retry_key_of("127.0.0.1", "Bearer a", json.dumps({**OK, "max_tokens": 3})) != key
