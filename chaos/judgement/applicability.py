"""Whether an experiment can run against the server it meets, decided before anything runs.

The harness drives any OpenAI-compatible server, but engine faults (a KV cap, a freeze, an out-of-memory step, a
slow host link) go through kvstorm's fault contract, ``/admin/faults``: served by kvstorm's engine, or by kvstorm's
plugin inside a vLLM engine core (``plugins/vllm``) at a URL of its own (the experiment's ``faults_url``). Against a
server without it such an experiment would run its load and then fail mid-method. The kvstorm control
(``chaos.controls``) asks first and stops the run as NOT APPLICABLE, naming the activities and why: no contract at
that URL; a contract that refuses (the plugin on a vLLM version it was not written for: 501); or, read with the
admin token, a fault the contract says this engine cannot have (its answer's ``not_applicable``: swap on vLLM v1).
A fault that loads the harness's own host (a CPU co-tenant) is not applicable to a server on another host.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import requests

from chaos.injectors.cpu_co_tenant import check_on_this_host
from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV

ENGINE_FAULT_FUNCS = frozenset({"set_engine_faults"})
# A storm aimed at swapped requests needs a server that swaps: one whose contract says swap_cap cannot apply has none.
SWAPPED_PHASE_NEEDS = "swap_cap"


# Faults that load the harness's own host (chaos.injectors.cpu_co_tenant): they reach a server only on that host.
HOST_FAULT_FUNCS = frozenset({"cpu_co_tenant"})


def _host_faults_elsewhere(experiment: Mapping[str, Any], target_url: str) -> str | None:
    """Why the method's host faults cannot reach ``target_url`` (not on this host), or None."""
    names = [
        activity.get("name", "?")
        for activity in experiment.get("method") or ()
        if (activity.get("provider") or {}).get("func") in HOST_FAULT_FUNCS
    ]
    if not names:
        return None
    try:
        check_on_this_host(target_url)
    except ValueError as error:
        return f"not applicable to this server: {', '.join(names)}: {error}; nothing was run"
    return None


def engine_fault_activities(experiment: Mapping[str, Any]) -> list[str]:
    """The names of the method's activities that inject engine faults."""
    return [
        activity.get("name", "?")
        for activity in experiment.get("method") or ()
        if (activity.get("provider") or {}).get("func") in ENGINE_FAULT_FUNCS
    ]


def inapplicability(experiment: Mapping[str, Any], target_url: str, faults_url: str | None = None) -> str | None:
    """Why ``experiment`` cannot run against ``target_url``, whose fault contract is at ``faults_url`` (default: the
    target's own URL), or None when it can (or when the contract cannot be asked: the run then says what is wrong)."""
    local = _host_faults_elsewhere(experiment, target_url)
    if local is not None:
        return local
    injecting = engine_fault_activities(experiment)
    if not injecting:
        return None
    url = (faults_url or target_url).rstrip("/")
    token = os.environ.get(ADMIN_TOKEN_ENV)
    try:
        response = requests.get(f"{url}/admin/faults", headers=_authorization(token), timeout=10)
    except requests.RequestException:
        return None
    if response.status_code == 200:
        return _faults_it_cannot_have(experiment, _not_applicable_of(response))
    if response.status_code in (401, 403):  # the contract, without our token or with a wrong one: the actions say so
        return None
    activities = f"{', '.join(injecting)} {'injects' if len(injecting) == 1 else 'inject'} engine faults"
    if response.status_code == 501:
        return (
            f"not applicable to this server: {activities}, and the fault contract at {url}/admin/faults refuses: "
            f"{_error_message(response)}; nothing was run"
        )
    return (
        f"not applicable to this server: {activities} through kvstorm's /admin/faults, which {url} does not serve "
        f"(HTTP {response.status_code}); nothing was run"
    )


def _authorization(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _faults_needed(experiment: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(fault, what of the method needs it) for each fault the method needs the engine to have."""
    for activity in experiment.get("method") or ():
        provider = activity.get("provider") or {}
        arguments = provider.get("arguments") or {}
        name = activity.get("name", "?")
        if provider.get("func") in ENGINE_FAULT_FUNCS:
            yield from (
                (fault, f"{name} sets {fault}, which this engine cannot have")
                for fault in arguments.get("faults") or {}
            )
        elif provider.get("func") == "disconnect_storm" and arguments.get("phase") == "swapped":
            yield SWAPPED_PHASE_NEEDS, f"{name} aims at swapped requests, and this engine has no swap to cap"


def _faults_it_cannot_have(experiment: Mapping[str, Any], not_applicable: dict[str, str]) -> str | None:
    reasons = [
        f"{need}: {not_applicable[fault]}" for fault, need in _faults_needed(experiment) if fault in not_applicable
    ]
    return f"not applicable to this server: {'; '.join(reasons)}; nothing was run" if reasons else None


def _not_applicable_of(response: requests.Response) -> dict[str, str]:
    """The answer's ``not_applicable`` (fault -> why), typed where it is read; kvstorm's own answer has none."""
    try:
        stated = response.json().get("not_applicable")
    except (ValueError, AttributeError):
        return {}
    if not isinstance(stated, dict):
        return {}
    return {name: reason[:500] for name, reason in stated.items() if isinstance(name, str) and isinstance(reason, str)}


def _error_message(response: requests.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"
    return message[:500] if isinstance(message, str) else f"HTTP {response.status_code}"
