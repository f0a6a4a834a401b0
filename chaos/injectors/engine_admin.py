"""A client of kvstorm's ``/admin/*`` routes (engine faults, live request phases), for the harness side.

The admin token comes from the caller or ``$KVSTORM_ADMIN_TOKEN``; it travels in a header, never in a URL, and is
never logged.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import requests

ADMIN_TOKEN_ENV = "KVSTORM_ADMIN_TOKEN"
logger = logging.getLogger(__name__)


class AdminError(RuntimeError):
    """The admin route refused (bad token, bad fault, no admin routes on this server). ``status``: the server's HTTP
    status, None when no request was sent (no token)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineAdmin:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        token = token or os.environ.get(ADMIN_TOKEN_ENV)
        if not token:
            raise AdminError(f"engine faults need the server's admin token: pass it or set ${ADMIN_TOKEN_ENV}")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s

    def faults(self) -> dict[str, Any]:
        return self._call("GET", "/admin/faults")

    def set_faults(self, faults: dict[str, Any], lease_s: float | None = None) -> dict[str, Any]:
        """Change some faults; with ``lease_s`` the server clears every fault unless renewed within it."""
        body = {**faults, **({"lease_s": lease_s} if lease_s is not None else {})}
        return self._call("POST", "/admin/faults", body)

    def clear_faults(self) -> dict[str, Any]:
        return self._call("DELETE", "/admin/faults")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/admin/stats")

    def steps(self) -> dict[str, Any]:
        """The engine loop's last busy iterations: each step's shape and wall time."""
        return self._call("GET", "/admin/steps")

    def _call(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        response = requests.request(
            method, self.base_url + path, json=body, headers=self._headers, timeout=self.timeout_s
        )
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise AdminError(f"{method} {path}: HTTP {response.status_code}: {message}", response.status_code)
        return response.json()


class LeaseKeeper:
    """Renews the lease on a server's faults while this process holds them: if the process dies, the renewals stop
    and the server clears every fault when the lease runs out (kvstorm's /admin/faults lease)."""

    def __init__(self, admin: EngineAdmin, lease_s: float) -> None:
        self.admin = admin
        self.lease_s = lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_until_stopped, name="fault-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.lease_s)

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.admin.set_faults({}, lease_s=self.lease_s)
            except Exception as error:  # the server restarting: the next renewal tries again
                logger.warning("renewing the fault lease failed: %s", error)
