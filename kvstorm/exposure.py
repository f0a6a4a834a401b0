"""The rule that keeps the stack closed by default: a secret committed to the repository (kvstorm.env) never guards
a port reachable beyond the machine.

A server is *exposed* when it binds beyond loopback and the deployment does not say that the ports it publishes are
loopback-only. Inside compose's containers the services must bind 0.0.0.0 (they reach each other over compose's
network), so the bind address alone cannot tell a laptop from a server: compose.yaml publishes every port on
``${KVSTORM_BIND_ADDRESS:-127.0.0.1}`` and passes the same address into the containers as ``$KVSTORM_PUBLISHED_ON``.
A plain ``docker compose up`` therefore starts with the committed tokens (reachable from this machine only), and
``KVSTORM_BIND_ADDRESS=0.0.0.0 docker compose up`` starts only once kvstorm.env holds tokens of the operator's own.
Outside compose nothing sets the variable, and ``--host`` alone decides.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

# The deployment's declaration and what counts as loopback: one definition, shared with Locust's login.
from loadgen.web_login import PUBLISHED_ON_ENV, is_loopback

__all__ = ["PUBLISHED_ON_ENV", "committed_token_refusal", "is_committed_default", "is_exposed", "is_loopback"]

# kvstorm.env's committed values, in one place (tests/kvstorm/test_exposure.py holds the two files together). Any
# of them is refused as a token of an exposed server, whichever variable it was meant for.
COMMITTED_DEFAULTS = {
    "KVSTORM_ADMIN_TOKEN": "local-admin-token",
    "KVSTORM_CHAOS_TOKEN": "local-chaos-token",
    "GF_SECURITY_ADMIN_PASSWORD": "local-grafana-password",
}


def is_exposed(host: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a server bound to ``host`` may be reached beyond this machine (see the module's docstring)."""
    if is_loopback(host):
        return False
    published_on = environ.get(PUBLISHED_ON_ENV, "")
    return not (published_on and is_loopback(published_on))


def is_committed_default(token: str | None) -> bool:
    """Whether ``token`` is one of kvstorm.env's committed values; every value is compared, in constant time."""
    if not token:
        return False
    matches = [hmac.compare_digest(token.encode(), value.encode()) for value in COMMITTED_DEFAULTS.values()]
    return any(matches)


def committed_token_refusal(
    program: str, host: str, token: str | None, flag: str, env_var: str, environ: Mapping[str, str] = os.environ
) -> str | None:
    """Why ``program`` must not start bound to ``host`` with ``token`` (the value of ``flag`` / ``$env_var``), or
    None when it may. The message names the variable, never the token."""
    if not is_exposed(host, environ) or not is_committed_default(token):
        return None
    published_on = environ.get(PUBLISHED_ON_ENV)
    where = f"its ports published on {published_on}" if published_on else f"bound to {host}"
    return (
        f"{program}: refusing to start: {where} (reachable beyond this machine) with ${env_var} ({flag}) set to a "
        "token committed to the repository in kvstorm.env, which anyone who reads the repository can use.\n"
        f"Set a token of your own, e.g.\n"
        f'    sed -i "s/^{env_var}=.*/{env_var}=$(openssl rand -hex 16)/" kvstorm.env\n'
        f"(or pass {flag}), or keep the port on loopback: --host 127.0.0.1, or under compose leave "
        "KVSTORM_BIND_ADDRESS unset (README, `docker compose up`)."
    )
