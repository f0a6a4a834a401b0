"""A real kvstorm server (the bundled model, its own process on a loopback port) for the chaos tests, with the
admin token the experiments' engine faults need."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from chaos.engine_admin import ADMIN_TOKEN_ENV, EngineAdmin
from chaos.processes import ManagedServer, free_port

SERVER_ARGS = ("--kv-cache-memory", "64MiB", "--swap-space", "256MiB", "--preemption-mode", "auto")


@dataclass(frozen=True)
class KvstormServer:
    url: str
    admin: EngineAdmin


@pytest.fixture(scope="session")
def kvstorm_server(tmp_path_factory) -> Iterator[KvstormServer]:
    token = secrets.token_urlsafe(16)
    previous = os.environ.get(ADMIN_TOKEN_ENV)
    os.environ[ADMIN_TOKEN_ENV] = token
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ManagedServer(["kvstorm", "serve", "--port", str(port), *SERVER_ARGS], f"{url}/ready", log)
    server.start()
    try:
        yield KvstormServer(url, EngineAdmin(url, token))
    finally:
        server.stop()
        if previous is None:
            os.environ.pop(ADMIN_TOKEN_ENV, None)
        else:
            os.environ[ADMIN_TOKEN_ENV] = previous
