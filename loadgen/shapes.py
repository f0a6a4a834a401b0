"""Locust load shapes as pure functions of the run time: how many users, spawned how fast (no locust import here,
so they are tested without gevent and without sleeping; ``locustfile.py`` wraps them in a ``LoadTestShape``).

Specs (``--shape`` / ``$LOCUST_SHAPE``)::

    constant                                   -u users (Locust's usual behaviour)
    onoff:base=2,burst=20,burst_s=10,period_s=60   burst users for burst_s at the start of every period
    spike:base=2,peak=50,at_s=30,spike_s=10    base users, peak users from at_s for spike_s, base again
    step:start=5,step=5,step_s=30,max=50       start users, step more every step_s, up to max

Every kind takes ``spawn_rate=R`` (default: Locust's -r, else fast enough to reach a level within a second).
The shape ends the test when ``run_time_s`` (Locust's -t) has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadgen.spec import Spec, parse_spec

SHAPE_KINDS = {"constant", "onoff", "spike", "step"}
SHAPE_KEYS = {
    "constant": {"users"},
    "onoff": {"base", "burst", "burst_s", "period_s"},
    "spike": {"base", "peak", "at_s", "spike_s"},
    "step": {"start", "step", "step_s", "max"},
}


@dataclass(frozen=True)
class UserShape:
    """``tick(t)`` -> (users, spawn_rate) at ``t`` seconds into the test, or None once the test should stop."""

    spec: Spec
    default_users: int
    spawn_rate: float | None
    run_time_s: float | None

    def users_at(self, t: float) -> int:
        spec = self.spec
        if spec.kind == "constant":
            return spec.get_int("users", self.default_users, minimum=0)
        if spec.kind == "onoff":
            in_burst = t % spec.get_float("period_s", minimum=1e-9) < spec.get_float("burst_s", minimum=0)
            return spec.get_int("burst" if in_burst else "base", minimum=0)
        if spec.kind == "spike":
            at_s = spec.get_float("at_s", minimum=0)
            in_spike = at_s <= t < at_s + spec.get_float("spike_s", minimum=0)
            return spec.get_int("peak" if in_spike else "base", minimum=0)
        steps_done = int(t // spec.get_float("step_s", minimum=1e-9))
        users = spec.get_int("start", minimum=0) + steps_done * spec.get_int("step", minimum=0)
        return min(users, spec.get_int("max", minimum=0))

    def tick(self, t: float) -> tuple[int, float] | None:
        if self.run_time_s is not None and t >= self.run_time_s:
            return None
        users = self.users_at(t)
        return users, self.spawn_rate or float(max(users, 1))


def make_shape(text: str, *, default_users: int, spawn_rate: float | None, run_time_s: float | None) -> UserShape:
    spec = parse_spec(text, SHAPE_KINDS)
    spec.check_keys(SHAPE_KEYS[spec.kind] | {"spawn_rate"})
    if "spawn_rate" in spec.params:
        spawn_rate = spec.get_float("spawn_rate", minimum=1e-9)
    shape = UserShape(spec, default_users, spawn_rate, run_time_s)
    shape.users_at(0.0)  # every required key is read at t=0: a bad spec fails now, not mid-test
    return shape
