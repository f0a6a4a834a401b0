"""What Locust's web UI may change: the load's size and target, never a path nor any other option of the operator's.

Locust's ``/swarm`` copies every form field named like a parsed option into the options, typed as the option was:
whoever reaches the UI could point ``--results-dir`` (where the master writes results) anywhere on the machine,
make the users read any file (``--workload jsonl:path=``, ``--arrival trace:path=``), or change any option of
Locust's own. Here ``/swarm`` takes only the fields of the UI's own start form, Locust's (``SWARM_FORM_FIELDS``):
the locustfile shows none of its options in the UI. Any other field is a 400 whose JSON names it and says why,
and nothing of that form is applied. Locust's ``/user`` sets any attribute of a user class to any JSON value (and
an unknown class is a 500); here it takes only what the UI's user settings edit (``USER_SETTINGS``), typed, for a
class that exists. flask is imported only when the checks are installed; nothing here imports locust.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

# The fields of the web UI's start form (Locust's /swarm reads each by name): the number of users, the spawn rate,
# the target host, the run time, a profile's name and, with --class-picker, the user classes and the shape.
SWARM_FORM_FIELDS = ("user_count", "spawn_rate", "host", "run_time", "profile", "user_classes", "shape_class")
SWARM_ENDPOINT = "locust.swarm"
# What the web UI's user settings send to /user (Locust's User.json(), the class's name and its ticked tasks).
USER_SETTINGS = {"host": str, "weight": int, "fixed_count": int, "tasks": list}
USER_ENDPOINT = "locust.update_user"


def swarm_refusal(field_names: Iterable[str]) -> str | None:
    """Why ``/swarm`` must not apply a form of ``field_names``, or None when it may."""
    for name in field_names:
        if name not in SWARM_FORM_FIELDS:
            return (
                f"/swarm may not set {name!r}: the web UI sets {', '.join(SWARM_FORM_FIELDS)}; every other option "
                "(paths, workloads, schedules) is the operator's, given where Locust starts"
            )
    return None


def user_settings_refusal(settings: object, class_names: Iterable[str]) -> str | None:
    """Why ``/user`` must not apply ``settings`` (its JSON body), or None when it may."""
    if not isinstance(settings, dict) or settings.get("user_class_name") not in set(class_names):
        return f"/user takes a JSON object whose user_class_name is one of {', '.join(sorted(class_names))}"
    for name, value in settings.items():
        if name == "user_class_name":
            continue
        kind = USER_SETTINGS.get(name)
        if kind is None:
            return f"/user may not set {name!r}: the web UI sets {', '.join(USER_SETTINGS)}"
        if type(value) is not kind or (kind is int and value < 0):
            return f"/user: {name} must be a {'non-negative integer' if kind is int else kind.__name__}, got {value!r}"
        if kind is list and not all(isinstance(task, str) for task in value):
            return f"/user: tasks must be a list of task names, got {value!r}"
    return None


def install(web_ui) -> None:
    """``/swarm`` and ``/user`` checked (:func:`swarm_refusal`, :func:`user_settings_refusal`) before Locust applies
    what they were sent (after the login, where there is one)."""
    from flask import jsonify, request

    swarm, update_user = web_ui.app.view_functions[SWARM_ENDPOINT], web_ui.app.view_functions[USER_ENDPOINT]

    @functools.wraps(swarm)
    def checked_swarm():
        refusal = swarm_refusal(request.form.keys())
        if refusal is None:
            return swarm()
        return jsonify({"success": False, "message": refusal, "host": web_ui.environment.host}), 400

    @functools.wraps(update_user)
    def checked_update_user():
        settings = request.get_json(silent=True)
        refusal = user_settings_refusal(settings, web_ui.environment.available_user_classes or {})
        if refusal is None:
            return update_user()
        return jsonify({"success": False, "message": refusal}), 400

    web_ui.app.view_functions[SWARM_ENDPOINT] = web_ui.auth_required_if_enabled(checked_swarm)
    web_ui.app.view_functions[USER_ENDPOINT] = web_ui.auth_required_if_enabled(checked_update_user)
