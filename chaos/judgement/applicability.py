"""Whether an experiment can run against the server it meets, decided before anything runs.

The harness drives any OpenAI-compatible server, but engine faults (a KV cap, a freeze, an out-of-memory step, a
slow host link) go through kvstorm's ``/admin/faults``: against a server that does not serve it (vLLM, SGLang, TGI,
or kvstorm started without an admin token) such an experiment would run its load and then fail mid-method. The
kvstorm control (``chaos.controls``) asks first and stops the run as NOT APPLICABLE, naming the activities.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import requests

ENGINE_FAULT_FUNCS = frozenset({"set_engine_faults"})


def engine_fault_activities(experiment: Mapping[str, Any]) -> list[str]:
    """The names of the method's activities that inject engine faults."""
    return [
        activity.get("name", "?")
        for activity in experiment.get("method") or ()
        if (activity.get("provider") or {}).get("func") in ENGINE_FAULT_FUNCS
    ]


def inapplicability(experiment: Mapping[str, Any], target_url: str) -> str | None:
    """Why ``experiment`` cannot run against ``target_url``, or None when it can (or when the server cannot be
    asked: the steady state's health probe then says what is wrong)."""
    needs = engine_fault_activities(experiment)
    if not needs:
        return None
    try:
        response = requests.get(f"{target_url.rstrip('/')}/admin/faults", timeout=10)
    except requests.RequestException:
        return None
    if response.status_code in (200, 401, 403):  # kvstorm's admin API, with or without our token
        return None
    verb = "injects" if len(needs) == 1 else "inject"
    return (
        f"not applicable to this server: {', '.join(needs)} {verb} engine faults through kvstorm's /admin/faults, "
        f"which {target_url} does not serve (HTTP {response.status_code}); nothing was run"
    )
