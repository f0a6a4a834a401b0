"""The stack is closed by default: a token committed in kvstorm.env never guards a port reachable beyond the machine
(kvstorm/exposure.py), checked by ``kvstorm serve`` and ``kvstorm chaos serve`` before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstorm import chaos_commands, engine_commands
from kvstorm.cli import build_parser
from kvstorm.exposure import (
    COMMITTED_DEFAULTS,
    PUBLISHED_ON_ENV,
    committed_token_refusal,
    is_committed_default,
    is_exposed,
    is_loopback,
)
from loadgen import web_login

REPO = Path(__file__).resolve().parents[2]
ADMIN_DEFAULT = COMMITTED_DEFAULTS["KVSTORM_ADMIN_TOKEN"]
CHAOS_DEFAULT = COMMITTED_DEFAULTS["KVSTORM_CHAOS_TOKEN"]


def committed_env_file() -> dict[str, str]:
    lines = (REPO / "kvstorm.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_the_committed_defaults_are_kvstorm_envs_values():
    committed = {key: value for key, value in committed_env_file().items() if value}
    assert committed == COMMITTED_DEFAULTS
    assert committed_env_file()["KVSTORM_LOCUST_PASSWORD"] == "", "Locust's password has no committed value"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.5", "example.com", "localhost.example.com"])
def test_addresses_beyond_loopback(host):
    assert not is_loopback(host)


def test_a_server_is_exposed_beyond_loopback_unless_the_deployment_publishes_on_loopback():
    assert not is_exposed("127.0.0.1", {})
    assert not is_exposed("::1", {PUBLISHED_ON_ENV: "0.0.0.0"})
    assert is_exposed("0.0.0.0", {})
    assert is_exposed("0.0.0.0", {PUBLISHED_ON_ENV: ""})
    assert not is_exposed("0.0.0.0", {PUBLISHED_ON_ENV: "127.0.0.1"})  # compose's default
    assert is_exposed("0.0.0.0", {PUBLISHED_ON_ENV: "0.0.0.0"})
    assert is_exposed("0.0.0.0", {PUBLISHED_ON_ENV: "10.0.0.7"})


def test_every_committed_value_counts_as_a_default_whatever_it_was_meant_for():
    assert all(is_committed_default(value) for value in COMMITTED_DEFAULTS.values())
    assert not is_committed_default(None)
    assert not is_committed_default("")
    assert not is_committed_default(ADMIN_DEFAULT + "x")
    assert not is_committed_default("3f9c2d7e8a1b4c6d9e0f1a2b3c4d5e6f")


def test_the_refusal_says_why_and_how_and_never_the_token():
    message = committed_token_refusal(
        "kvstorm serve", "0.0.0.0", ADMIN_DEFAULT, "--admin-token", "KVSTORM_ADMIN_TOKEN", {}
    )
    assert message is not None
    assert "refusing to start" in message
    assert "0.0.0.0" in message
    assert "$KVSTORM_ADMIN_TOKEN" in message
    assert "openssl rand -hex 16" in message
    assert "kvstorm.env" in message
    assert ADMIN_DEFAULT not in message
    published = {PUBLISHED_ON_ENV: "0.0.0.0"}
    assert "published on 0.0.0.0" in committed_token_refusal("p", "0.0.0.0", CHAOS_DEFAULT, "--token", "X", published)


@pytest.mark.parametrize(
    ("host", "token", "environ"),
    [
        ("127.0.0.1", ADMIN_DEFAULT, {}),
        ("localhost", ADMIN_DEFAULT, {}),
        ("0.0.0.0", ADMIN_DEFAULT, {PUBLISHED_ON_ENV: "127.0.0.1"}),
        ("0.0.0.0", "3f9c2d7e8a1b4c6d9e0f1a2b3c4d5e6f", {}),
        ("0.0.0.0", None, {}),  # no admin API at all
    ],
)
def test_what_is_not_refused(host, token, environ):
    assert (
        committed_token_refusal("kvstorm serve", host, token, "--admin-token", "KVSTORM_ADMIN_TOKEN", environ) is None
    )


def run_kvstorm(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORM_")} | env
    return subprocess.run(
        [sys.executable, "-m", "kvstorm", *args], capture_output=True, text=True, timeout=120, check=False, env=environ
    )


def test_kvstorm_serve_beyond_loopback_with_the_committed_admin_token_exits_before_loading_the_model():
    result = run_kvstorm("serve", "--host", "0.0.0.0", "--port", "0", KVSTORM_ADMIN_TOKEN=ADMIN_DEFAULT)
    assert result.returncode == 2, result.stderr
    assert "kvstorm serve: refusing to start" in result.stderr
    assert "KVSTORM_ADMIN_TOKEN" in result.stderr
    assert ADMIN_DEFAULT not in result.stderr + result.stdout


def test_kvstorm_chaos_serve_beyond_loopback_with_the_committed_token_exits():
    args = ("chaos", "serve", "--host", "0.0.0.0", "--target", "http://127.0.0.1:9")
    result = run_kvstorm(*args, "--token", CHAOS_DEFAULT, KVSTORM_PUBLISHED_ON="0.0.0.0")
    assert result.returncode == 2, result.stderr
    assert "kvstorm chaos serve: refusing to start" in result.stderr
    assert "KVSTORM_CHAOS_TOKEN" in result.stderr
    assert CHAOS_DEFAULT not in result.stderr + result.stdout


class Started(Exception):
    """Raised where the server would start: the check let it through."""


def test_kvstorm_serve_starts_on_loopback_or_with_a_token_of_ones_own(monkeypatch):
    monkeypatch.delenv(PUBLISHED_ON_ENV, raising=False)

    def load(_config):
        raise Started

    monkeypatch.setattr(engine_commands, "_load_off_the_main_thread", load)
    parser = build_parser()
    for argv in (
        ["serve", "--admin-token", ADMIN_DEFAULT],
        ["serve", "--host", "0.0.0.0", "--admin-token", "3f9c2d7e8a1b4c6d9e0f1a2b3c4d5e6f"],
    ):
        args = parser.parse_args(argv)
        with pytest.raises(Started):
            args.handler(args)
    refused = parser.parse_args(["serve", "--host", "0.0.0.0", "--admin-token", ADMIN_DEFAULT])
    assert refused.handler(refused) == 2


def test_kvstorm_chaos_serve_starts_on_loopback_or_with_a_token_of_ones_own(monkeypatch, tmp_path):
    monkeypatch.delenv(PUBLISHED_ON_ENV, raising=False)
    started = []
    monkeypatch.setattr(chaos_commands.uvicorn, "run", lambda app, host, port, **_: started.append(host))
    parser = build_parser()
    common = ["chaos", "serve", "--target", "http://127.0.0.1:9", "--admin-token", "a", "--results-dir", str(tmp_path)]
    for extra in (["--token", CHAOS_DEFAULT], ["--host", "0.0.0.0", "--token", "3f9c2d7e8a1b4c6d9e0f1a2b3c4d5e6f"]):
        args = parser.parse_args(common + extra)
        assert args.handler(args) == 0
    assert started == ["127.0.0.1", "0.0.0.0"]
    refused = parser.parse_args([*common, "--host", "0.0.0.0", "--token", CHAOS_DEFAULT])
    assert refused.handler(refused) == 2
    assert len(started) == 2


@pytest.mark.parametrize(
    ("web_host", "environ", "exposed"),
    [
        ("127.0.0.1", {}, False),  # the locustfile's default
        ("0.0.0.0", {}, True),
        ("", {}, True),  # Locust binds every interface
        ("192.168.1.5", {}, True),
        ("0.0.0.0", {PUBLISHED_ON_ENV: "127.0.0.1"}, False),  # compose, published on loopback
        ("0.0.0.0", {PUBLISHED_ON_ENV: "0.0.0.0"}, True),
    ],
)
def test_locusts_web_ui_asks_for_a_login_wherever_it_may_be_reached(web_host, environ, exposed):
    assert web_login.is_web_ui_exposed(web_host, environ) is exposed


def test_locust_bound_beyond_loopback_without_a_password_refuses_to_start(tmp_path):
    locustfile = REPO / "loadgen" / "locustfile.py"
    command = [sys.executable, "-m", "locust", "-f", str(locustfile), "--web-host", "0.0.0.0", "--web-port", "0",
               "--host", "http://127.0.0.1:9", "--model", "m"]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k not in (web_login.PASSWORD_ENV, PUBLISHED_ON_ENV)}
    result = subprocess.run(command, cwd=tmp_path, env={**environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode != 0
    assert "refusing to start: the web UI's login is on" in result.stdout + result.stderr
