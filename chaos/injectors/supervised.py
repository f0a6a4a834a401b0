"""A server someone else runs and a supervisor restarts: how kill-and-restart kills a server it did not start.

In a container stack the harness can signal no process of another container, and it never runs a command a request
could name. It asks the server to exit through its admin API instead (``POST /admin/exit``, which ``kvstorm serve
--admin-exit`` obeys as SIGKILL or SIGTERM would), and the server's supervisor (compose's restart policy, systemd,
Kubernetes) starts it again. Time to ready runs from the moment the server stopped answering to its first 200 from
its readiness URL again: the supervisor's delay and the server's start, what a user of the stack waits through.

It stands where ``chaos.injectors.processes.ManagedServer`` does (``kill``, ``start``, ``stop``), so the experiment's
actions (``chaos.actions.kill_server`` / ``restart_server``) drive either.
"""

from __future__ import annotations

import os
import time

import requests

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV

POLL_S = 0.1


class SupervisedServer:
    """``target_url``: the server's base URL (its ``/admin/exit``); ``ready_url``: where it says it is ready. The admin
    token comes from the caller or ``$KVSTORM_ADMIN_TOKEN``; it travels in a header and is never logged."""

    def __init__(self, target_url: str, ready_url: str, admin_token: str | None = None) -> None:
        self.exit_url = f"{target_url.rstrip('/')}/admin/exit"
        self.ready_url = ready_url
        token = admin_token or os.environ.get(ADMIN_TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._down_ts: float | None = None

    def refusal(self) -> str | None:
        """Why this server cannot be killed this way (None: it obeys ``POST /admin/exit``); asks, changes nothing."""
        if not self._headers:
            return f"the server's admin token is needed to ask it to exit: set ${ADMIN_TOKEN_ENV}"
        try:
            response = requests.get(self.exit_url, headers=self._headers, timeout=10)
            state = response.json() if response.status_code == 200 else {}
        except (requests.RequestException, ValueError) as error:
            return f"{self.exit_url} did not answer: {type(error).__name__}"
        if response.status_code in (401, 403):
            return f"{self.exit_url} refused the admin token (HTTP {response.status_code})"
        if response.status_code != 200:
            return (
                f"the server has no {self.exit_url} (HTTP {response.status_code}): nothing can ask it to exit for its "
                "supervisor to restart it; give the harness a command that starts it (server_command) instead"
            )
        if not isinstance(state, dict) or state.get("enabled") is not True:
            return "the server was started without --admin-exit: it will not exit when asked"
        return None

    def kill(self, signal_name: str = "SIGKILL", timeout_s: float = 60.0) -> float:
        """Ask it to exit as ``signal_name`` would, and wait until its readiness URL stops answering 200; returns the
        seconds that took."""
        started = time.monotonic()
        response = requests.post(self.exit_url, json={"signal": signal_name}, headers=self._headers, timeout=30)
        if response.status_code != 202:
            raise RuntimeError(f"POST {self.exit_url}: HTTP {response.status_code}: {response.text[:200]}")
        while self._is_ready():
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{self.ready_url} still answers 200 {timeout_s:g} s after the server took the exit")
            time.sleep(POLL_S)
        self._down_ts = time.monotonic()
        return self._down_ts - started

    def start(self, timeout_s: float = 300.0) -> float:
        """Wait for its supervisor to bring it back; returns the seconds from its going down to ready again."""
        if self._down_ts is None:
            raise RuntimeError("the supervised server was not asked to exit: there is nothing to wait for")
        while not self._is_ready():
            if time.monotonic() - self._down_ts > timeout_s:
                raise TimeoutError(f"{self.ready_url} was not ready {timeout_s:g} s after the server went down")
            time.sleep(POLL_S)
        ready_s = time.monotonic() - self._down_ts
        self._down_ts = None
        return ready_s

    def stop(self) -> None:
        """Nothing: its supervisor owns it (``ManagedServer.stop`` stops a server the experiment started)."""

    def _is_ready(self) -> bool:
        try:
            return requests.get(self.ready_url, timeout=2).status_code == 200
        except requests.RequestException:
            return False
