"""What a caller of the controller may change in a library experiment, and within what bounds.

An experiment file's ``configuration`` names its parameters; ``SCHEMAS`` says, per name, which values a request may
give one: a number in a range, one of a few strings, or a loadgen spec whose numbers are bounded. A configuration
key without a schema is not overridable over HTTP; the library's test checks that every key is either here,
reserved (the controller's own target and model) or the operator's (``OPERATOR_PARAMETERS``: a command to run,
which only the controller's command line may give). Every value is a JSON scalar: an object such as Chaos
Toolkit's ``{"type": "env", ...}`` would be resolved from the controller's environment, so none is taken.

Files (a workload's ``jsonl:path=``, an arrival's ``trace:path=``) resolve only under the operator's data
directory (``kvstorm chaos serve --data-dir``); without one they are refused. The child gets the resolved path.

Bounded one by one, values still multiply: each load of the experiment (``LOADS``) is sized from its arrival,
duration, workload and lengths together (``loadgen.plan.estimate_plan_size``), and a plan above
``loadgen.plan.MAX_PLAN_TOKENS`` is refused before anything is built.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chaos.injectors.cpu_co_tenant import MAX_DURATION_S as CO_TENANT_MAX_S
from chaos.run.load import HARNESS_DEFAULTS
from loadgen.arrivals import make_arrivals
from loadgen.plan import estimate_plan_size
from loadgen.spec import Spec, parse_spec
from loadgen.traces import TRACE_FORMATS
from loadgen.workloads import sample_lengths

# Set by the controller from its own configuration, never by a caller: the run is against the controller's target,
# and the admin token goes to the fault contract of the controller's environment only ($KVSTORM_FAULTS_URL), never
# to a URL a request names.
RESERVED_PARAMETERS = ("target_url", "model", "faults_url")
# Given only by the operator (``kvstorm chaos serve --server-command``): a command the run would execute.
OPERATOR_PARAMETERS = {"server_command": "--server-command"}

# Sane maxima: an experiment's load is a few requests a second for a minute or two against one engine.
MAX_RATE = 200.0  # requests/s, any rate of an arrival spec
MAX_DURATION_S = 3600.0  # any duration or pause, and a load's length
MAX_TOKENS = 32_768  # any length of a prompt or an output
MAX_RATE_STEPS = 64  # pieces of a ``steps:rates=a/b/...`` arrival
MAX_SPEEDUP = 100.0  # a trace replayed faster than this is a different load
MAX_BURSTINESS = 100.0
MAX_STRING_CHARS = 256
MAX_SHARED_PREFIXES = 10_000
MAX_TURNS = 64
# A data file's name under the data directory: no comma (it would split the spec), no '$' (no Chaos Toolkit
# substitution), no '..' component (checked after resolving too).
_FILE_NAME = re.compile(r"[A-Za-z0-9._/-]{1,200}")
_LENGTH_ARGS = re.compile(r"\d{1,9}(?:-\d{1,9})?")


class ParameterRefused(ValueError):
    """A value a request may not give: ``name`` and ``reason`` go into the 400 answer as they are."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"parameter {name!r}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class Number:
    """An int or a float in ``[minimum, maximum]`` (a bool is neither)."""

    minimum: float
    maximum: float
    is_int: bool = False
    unit: str = ""

    def check(self, value: Any, data_dir: Path | None) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, got {value!r}")
        # JSON integers are unbounded: compare as the int it is, never through a float that could overflow.
        if not (isinstance(value, int) or math.isfinite(value)) or not self.minimum <= value <= self.maximum:
            raise ValueError(f"must be in [{self.minimum:g}, {self.maximum:g}], got {value!r}")
        if self.is_int and not float(value).is_integer():
            raise ValueError(f"must be a whole number, got {value!r}")
        return int(value) if self.is_int else value

    def describe(self) -> dict[str, Any]:
        kind = "integer" if self.is_int else "number"
        return {"type": kind, "minimum": self.minimum, "maximum": self.maximum, "unit": self.unit}


@dataclass(frozen=True)
class Choice:
    choices: tuple[str, ...]

    def check(self, value: Any, data_dir: Path | None) -> Any:
        if value not in self.choices or not isinstance(value, str):
            raise ValueError(f"must be one of {list(self.choices)}, got {value!r}")
        return value

    def describe(self) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.choices)}


@dataclass(frozen=True)
class LengthSpec:
    """``fixed:N``, ``uniform:LO-HI``, ``normal:mean=..,std=..[,max=..]``, ``lognormal:median=..,sigma=..[,max=..]``:
    every length at most ``MAX_TOKENS`` (the samples of the last two are clipped to their max, 32,768 by default),
    and a lognormal's sigma at most 1."""

    def check(self, value: Any, data_dir: Path | None) -> Any:
        spec = _spec(value, {"fixed", "uniform", "normal", "lognormal"})
        if spec.kind in ("fixed", "uniform"):
            if not _LENGTH_ARGS.fullmatch(spec.args):
                raise ValueError(f"expected fixed:N or uniform:LO-HI with whole numbers, got {value!r}")
            for number in spec.args.split("-"):
                _check_range(f"{value!r}: length", int(number), 1, MAX_TOKENS)
        else:
            for key in ("mean", "std", "median"):
                _bounded(spec, key, 0, MAX_TOKENS)
            _bounded(spec, "max", 1, MAX_TOKENS)
            _bounded(spec, "sigma", 0, 1)
        sample_lengths(value, 1, np.random.default_rng(0))  # the loadgen's own grammar, its own message
        return value

    def describe(self) -> dict[str, Any]:
        return {"type": "string", "spec": "length", "max_tokens": MAX_TOKENS}


# A trace replay's numeric settings and their bounds (seconds of the trace's own time for the window).
TRACE_BOUNDS = {
    "speedup": (1e-3, MAX_SPEEDUP),
    "start_s": (0, 1e9),
    "duration_s": (1e-3, 1e9),
    "length_scale": (1e-3, 100),
    "max_len": (1, MAX_TOKENS),
}
# Per workload kind (but jsonl), each setting a caller may give and its bounds.
WORKLOAD_BOUNDS = {
    "random": {"low": (0, 1_000_000), "high": (0, 1_000_000)},
    "chat": {},
    "shared-prefix": {
        "num_prefixes": (1, MAX_SHARED_PREFIXES),
        "prefix_len": (1, MAX_TOKENS),
        "low": (0, 1_000_000),
        "high": (0, 1_000_000),
    },
    "multiturn": {"turns": (1, MAX_TURNS), "system_len": (0, MAX_TOKENS), "think_s": (0, MAX_DURATION_S)},
}


@dataclass(frozen=True)
class WorkloadSpec:
    """``random[:low=..,high=..]``, ``chat``, ``shared-prefix:num_prefixes=..,prefix_len=..[,low=..,high=..]``,
    ``multiturn:turns=..[,system_len=..,think_s=..]``, or ``jsonl:path=<file under the data directory>``."""

    def check(self, value: Any, data_dir: Path | None) -> Any:
        spec = _spec(value, {*WORKLOAD_BOUNDS, "jsonl"})
        if spec.kind == "jsonl":
            return f"jsonl:path={_data_file(spec.params.get('path') or spec.args, data_dir)}"
        bounds = WORKLOAD_BOUNDS[spec.kind]
        if spec.args or (spec.params and not bounds):
            raise ValueError(f"{spec.kind} takes {sorted(bounds) or 'no settings'}, got {value!r}")
        spec.check_keys(set(bounds))
        for key, (minimum, maximum) in bounds.items():
            _bounded(spec, key, minimum, maximum)
        return value

    def describe(self) -> dict[str, Any]:
        kinds = ["random", "chat", "shared-prefix", "multiturn", "jsonl (under --data-dir)"]
        return {"type": "string", "spec": "workload", "kinds": kinds}


@dataclass(frozen=True)
class ArrivalSpec:
    """``constant|poisson|gamma|onoff|steps`` with every rate at most ``MAX_RATE`` and every duration at most
    ``MAX_DURATION_S``; ``trace:path=<file under the data directory>[,format=..,speedup=..,start_s=..,
    duration_s=..,length_scale=..,max_len=..]`` (``loadgen.traces``)."""

    def check(self, value: Any, data_dir: Path | None) -> Any:
        spec = _spec(value, {"constant", "poisson", "gamma", "onoff", "steps", "trace"})
        if spec.kind == "trace":
            return self._trace(spec, data_dir)
        for key in ("rate", "base", "burst"):
            _bounded(spec, key, 0, MAX_RATE)
        for key in ("burst_s", "period_s", "step_s"):
            _bounded(spec, key, 1e-3, MAX_DURATION_S)
        _bounded(spec, "burstiness", 1e-3, MAX_BURSTINESS)
        if spec.kind == "steps":
            rates = spec.get_str("rates").split("/")
            if len(rates) > MAX_RATE_STEPS:
                raise ValueError(f"at most {MAX_RATE_STEPS} rates, got {len(rates)}")
            for rate in rates:
                _check_range(f"{value!r}: rate", _finite(rate, value), 0, MAX_RATE)
        if spec.params.get("spacing", "even") not in ("even", "random"):
            raise ValueError(f"spacing must be even or random, got {spec.params['spacing']!r}")
        make_arrivals(value, num_requests=1, duration_s=None)  # the loadgen's own grammar, its own message
        return value

    @staticmethod
    def _trace(spec: Spec, data_dir: Path | None) -> str:
        spec.check_keys(set(TRACE_BOUNDS) | {"path", "format"})
        if spec.params.get("format", "auto") not in TRACE_FORMATS:
            raise ValueError(f"format must be one of {TRACE_FORMATS}, got {spec.params['format']!r}")
        for key, (minimum, maximum) in TRACE_BOUNDS.items():
            _bounded(spec, key, minimum, maximum)
        settings = "".join(f",{key}={value}" for key, value in spec.params.items() if key != "path")
        checked = f"trace:path={_data_file(spec.params.get('path', ''), data_dir)}{settings}"
        make_arrivals(checked, num_requests=1, duration_s=None)  # the loadgen's own reading, its own message
        return checked

    def describe(self) -> dict[str, Any]:
        return {
            "type": "string",
            "spec": "arrival",
            "max_rate": MAX_RATE,
            "max_duration_s": MAX_DURATION_S,
            "kinds": ["constant", "poisson", "gamma", "onoff", "steps", "trace (under --data-dir)"],
        }


Schema = Number | Choice | LengthSpec | WorkloadSpec | ArrivalSpec
_SECONDS = Number(0, MAX_DURATION_S, unit="s")

SCHEMAS: dict[str, Schema] = {
    "baseline_requests": Number(1, 100, is_int=True),
    "workload": WorkloadSpec(),
    "input_len": LengthSpec(),
    "output_len": LengthSpec(),
    "arrival": ArrivalSpec(),
    "duration_s": Number(1, MAX_DURATION_S, unit="s"),
    "cap_after_s": _SECONDS,
    "cap_for_s": _SECONDS,
    "freeze_after_s": _SECONDS,
    "freeze_s": Number(0, 600, unit="s"),
    "kill_after_s": _SECONDS,
    "faults_after_s": _SECONDS,
    "faults_for_s": _SECONDS,
    "stall_s": Number(0, 600, unit="s"),
    "client_stall_timeout_s": Number(1, 600, unit="s"),
    "cap_fraction": Number(0, 1),
    "storm_size": Number(1, 64, is_int=True),
    "proxy_port": Number(1024, 65535, is_int=True),
    "failing_steps": Number(1, 1000, is_int=True),
    "max_step_tokens": Number(1, MAX_TOKENS, is_int=True),
    "swap_delay_per_block": Number(0, 1, unit="s"),
    "kill_signal": Choice(("SIGTERM", "SIGKILL")),
    # Appended to the target's URL: a fixed set of paths, never a caller's text (it could name another host).
    "ready_path": Choice(("/ready", "/health")),
    # chaos.run.sizing: the rates of a load in multiples of the capacity measured before it (its closed loop's
    # streams and requests) or in requests/s as written, and a burst's size in multiples of the server's KV.
    "rate_unit": Choice(("capacity", "req/s")),
    "capacity_concurrency": Number(1, 64, is_int=True),
    "capacity_requests": Number(1, 256, is_int=True),
    "kv_multiple": Number(0.5, 8),
    # A second load that is the fault: unrelated traffic from a point of the main load.
    "flood_after_s": _SECONDS,
    "flood_arrival": ArrivalSpec(),
    "flood_for_s": Number(1, MAX_DURATION_S, unit="s"),
    "flood_input_len": LengthSpec(),
    "flood_output_len": LengthSpec(),
    # Processes that keep cores of this host busy (chaos.injectors.cpu_co_tenant, whose bounds these are).
    "co_tenant_after_s": _SECONDS,
    "co_tenant_for_s": Number(1, CO_TENANT_MAX_S, unit="s"),
    "co_tenant_cores": Number(1, os.cpu_count() or 1, is_int=True),
    "co_tenant_duty_cycle": Number(0.05, 1),
}


@dataclass(frozen=True)
class Load:
    """The parameters one load of an experiment is made of, by ``chaos.actions.run_load``'s argument they feed."""

    arrival: str
    duration_s: str
    workload: str
    input_len: str
    output_len: str

    def settings(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The load's settings from the experiment's values, the harness's defaults where it has no parameter."""
        return {field: values.get(name, HARNESS_DEFAULTS.get(field)) for field, name in vars(self).items()}

    @property
    def names(self) -> str:
        return ", ".join(name for name in vars(self).values() if name in SCHEMAS)


# The library's loads: the main one, and the flood that is itself the fault (prefix-cache-thrash; its workload is
# the harness's random, no parameter).
LOADS = (
    Load("arrival", "duration_s", "workload", "input_len", "output_len"),
    Load("flood_arrival", "flood_for_s", "flood_workload", "flood_input_len", "flood_output_len"),
)


def check_overrides(
    experiment: str, parameters: Mapping[str, Any], overrides: Mapping[str, Any], data_dir: Path | None
) -> dict[str, Any]:
    """The overrides as the child gets them (file paths resolved), or ``ParameterRefused`` for the first value a
    request may not give: unknown to the experiment, reserved, the operator's, not a scalar, out of bounds; or for a
    load whose plan, all its values together, is above ``MAX_PLAN_TOKENS``."""
    checked = {}
    for name, value in overrides.items():
        if name in RESERVED_PARAMETERS:
            raise ParameterRefused(name, "reserved: the controller runs against its own target and model")
        if name in OPERATOR_PARAMETERS:
            flag = OPERATOR_PARAMETERS[name]
            raise ParameterRefused(name, f"names a command to run: only the operator sets it (controller {flag})")
        if name not in parameters:
            raise ParameterRefused(
                name, f"unknown parameters [{name!r}] for {experiment}; parameters: {', '.join(parameters)}"
            )
        if not isinstance(value, (str, int, float)) or (isinstance(value, str) and len(value) > MAX_STRING_CHARS):
            raise ParameterRefused(name, f"must be a number or a short string (no object or list), got {value!r}")
        try:
            checked[name] = SCHEMAS[name].check(value, data_dir)
        except ValueError as error:
            raise ParameterRefused(name, str(error)) from None
    _check_plan_sizes({**parameters, **checked})
    return checked


def _check_plan_sizes(values: Mapping[str, Any]) -> None:
    """Each load's expected plan within ``MAX_PLAN_TOKENS``. A load without a duration here is sized from the
    server by the run (``kv_multiple``), and one whose rates are multiples of a measured capacity is sized again
    once it is measured: ``chaos.actions.run_load`` checks what only the run knows."""
    for load in LOADS:
        if load.arrival not in values or load.duration_s not in values:
            continue
        try:
            estimate_plan_size(**load.settings(values)).check()
        except ValueError as error:
            raise ParameterRefused(load.names, str(error)) from None


def describe(parameters: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The schema of each overridable parameter, for ``GET /experiments``."""
    return {name: SCHEMAS[name].describe() for name in parameters if name in SCHEMAS}


def _spec(value: Any, kinds: set[str]) -> Spec:
    if not isinstance(value, str) or "$" in value:
        raise ValueError(f"must be a spec string ({'|'.join(sorted(kinds))}), got {value!r}")
    return parse_spec(value, kinds)


def _data_file(name: str, data_dir: Path | None) -> Path:
    """``name`` resolved under the operator's data directory; a ValueError if there is none, or if it leads out."""
    if data_dir is None:
        raise ValueError("files are refused: the controller has no data directory (kvstorm chaos serve --data-dir)")
    if not _FILE_NAME.fullmatch(name) or name.startswith("/") or ".." in Path(name).parts:
        raise ValueError(f"a file name relative to the data directory ([A-Za-z0-9._/-], no '..'), got {name!r}")
    root = data_dir.resolve()
    # Resolved (symlinks followed) before the check: a link inside the data directory may not lead out of it.
    path = (root / name).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise ValueError(f"no file {name!r} under the data directory")
    return path


def _finite(text: str, value: Any) -> float:
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{value!r}: {text!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r}: {text!r} is not a finite number")
    return number


def _bounded(spec: Spec, key: str, minimum: float, maximum: float) -> None:
    if key in spec.params:
        number = spec.get_float(key)
        _check_range(f"{spec.text!r}: {key}", number, minimum, maximum)


def _check_range(what: str, number: float, minimum: float, maximum: float) -> None:
    if not math.isfinite(number) or not minimum <= number <= maximum:
        raise ValueError(f"{what}={number:g} must be in [{minimum:g}, {maximum:g}]")
