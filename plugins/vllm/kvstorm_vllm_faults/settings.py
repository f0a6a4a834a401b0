"""What the operator chose, from the environment of vLLM's processes (each process reads it again: vLLM may start its
engine core with ``spawn``, which passes the environment and nothing else).

============================  =======================================================================================
variable                      meaning
============================  =======================================================================================
``KVSTORM_FAULTS_TOKEN``      the bearer token ``/admin/faults`` demands; unset or empty: the plugin is off
``KVSTORM_FAULTS_PORT``       the port it listens on (default 8100)
``KVSTORM_FAULTS_HOST``       the IP address it binds (default 127.0.0.1)
``KVSTORM_FAULTS_EXPOSE``     ``1`` to allow a host beyond loopback; without it such a host is refused
============================  =======================================================================================
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

TOKEN_ENV = "KVSTORM_FAULTS_TOKEN"
PORT_ENV = "KVSTORM_FAULTS_PORT"
HOST_ENV = "KVSTORM_FAULTS_HOST"
EXPOSE_ENV = "KVSTORM_FAULTS_EXPOSE"
DEFAULT_PORT = 8100
DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class FaultSettings:
    """Where ``/admin/faults`` listens and the token it wants (never in a log line or a ``repr``)."""

    token: str = field(repr=False)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> FaultSettings | None:
        """None when the operator did not enable the plugin; ``ValueError`` naming the variable when the settings
        are unusable (a bad port, a host beyond loopback without ``KVSTORM_FAULTS_EXPOSE=1``)."""
        token = environ.get(TOKEN_ENV, "")
        if not token:
            return None
        port_text = environ.get(PORT_ENV, str(DEFAULT_PORT))
        if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"${PORT_ENV} must be a port number in [1, 65535], got {port_text!r}")
        host = environ.get(HOST_ENV, DEFAULT_HOST)
        try:
            is_loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            raise ValueError(f"${HOST_ENV} must be an IP address, got {host!r}") from None
        if not is_loopback and environ.get(EXPOSE_ENV) != "1":
            raise ValueError(
                f"${HOST_ENV}={host!r} is reachable beyond this machine: anyone who can reach it and guess the token "
                f"can stop this server's engine. Set ${EXPOSE_ENV}=1 to serve it there anyway"
            )
        return cls(token=token, host=host, port=int(port_text))
