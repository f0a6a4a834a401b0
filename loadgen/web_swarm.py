"""What Locust's web UI may change: the load's size and target, never a path nor any other option of the operator's.

Locust's ``/swarm`` copies every form field named like a parsed option into the options, typed as the option was:
whoever reaches the UI could point ``--results-dir`` (where the master writes results) anywhere on the machine,
make the users read any file (``--workload jsonl:path=``, ``--arrival trace:path=``), or change any option of
Locust's own. Here ``/swarm`` takes only the fields of the UI's own start form, Locust's (``SWARM_FORM_FIELDS``):
the locustfile shows none of its options in the UI. Any other field is a 400 whose JSON names it and says why,
and nothing of that form is applied. flask is imported only when the check is installed; nothing here imports
locust.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

# The fields of the web UI's start form (Locust's /swarm reads each by name): the number of users, the spawn rate,
# the target host, the run time, a profile's name and, with --class-picker, the user classes and the shape.
SWARM_FORM_FIELDS = ("user_count", "spawn_rate", "host", "run_time", "profile", "user_classes", "shape_class")
SWARM_ENDPOINT = "locust.swarm"


def swarm_refusal(field_names: Iterable[str]) -> str | None:
    """Why ``/swarm`` must not apply a form of ``field_names``, or None when it may."""
    for name in field_names:
        if name not in SWARM_FORM_FIELDS:
            return (
                f"/swarm may not set {name!r}: the web UI sets {', '.join(SWARM_FORM_FIELDS)}; every other option "
                "(paths, workloads, schedules) is the operator's, given where Locust starts"
            )
    return None


def install(web_ui) -> None:
    """``/swarm`` checked by :func:`swarm_refusal` before Locust applies its form (after the login, where there is
    one)."""
    from flask import jsonify, request

    swarm = web_ui.app.view_functions[SWARM_ENDPOINT]

    @functools.wraps(swarm)
    def checked_swarm():
        refusal = swarm_refusal(request.form.keys())
        if refusal is None:
            return swarm()
        return jsonify({"success": False, "message": refusal, "host": web_ui.environment.host}), 400

    web_ui.app.view_functions[SWARM_ENDPOINT] = web_ui.auth_required_if_enabled(checked_swarm)
