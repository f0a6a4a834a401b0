"""Compact command-line specs: ``kind:key=value,key=value`` (e.g. ``poisson:rate=20``, ``uniform:64-512``).

One grammar for arrival processes, length distributions, workloads, Locust shapes and SLOs, so every option reads
the same way and fails the same way: a ``ValueError`` that names the spec, the key and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m)?")
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0}


def parse_duration(text: str) -> float:
    """'200ms', '2s', '1.5', '3m' -> seconds (a bare number is seconds)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a duration: {text!r} (examples: 200ms, 2s, 1.5, 3m)")
    return float(match["number"]) * _DURATION_UNITS[match["unit"] or "s"]


@dataclass(frozen=True)
class Spec:
    """A parsed ``kind:key=value,...`` spec; ``args`` keeps a bare argument (``fixed:128`` -> args '128')."""

    text: str
    kind: str
    params: dict[str, str] = field(default_factory=dict)
    args: str = ""

    def get_float(self, key: str, default: float | None = None, *, minimum: float | None = None) -> float:
        raw = self.params.get(key)
        if raw is None:
            if default is None:
                raise ValueError(f"{self.text!r}: missing {key}=<number>")
            return default
        try:
            value = parse_duration(raw) if key.endswith("_s") else float(raw)
        except ValueError:
            raise ValueError(f"{self.text!r}: {key}={raw!r} is not a number") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"{self.text!r}: {key}={value} must be >= {minimum}")
        return value

    def get_int(self, key: str, default: int | None = None, *, minimum: int | None = None) -> int:
        value = self.get_float(key, None if default is None else float(default), minimum=minimum)
        if value != int(value):
            raise ValueError(f"{self.text!r}: {key}={value} must be a whole number")
        return int(value)

    def get_str(self, key: str, default: str | None = None) -> str:
        value = self.params.get(key, default)
        if value is None:
            raise ValueError(f"{self.text!r}: missing {key}=...")
        return value

    def check_keys(self, allowed: set[str]) -> None:
        unknown = set(self.params) - allowed
        if unknown:
            raise ValueError(f"{self.text!r}: unknown key(s) {sorted(unknown)}; {self.kind} takes {sorted(allowed)}")


def parse_spec(text: str, kinds: set[str] | None = None) -> Spec:
    """Split ``kind:rest``; ``rest`` is ``key=value`` pairs separated by commas, or one bare argument."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kinds is not None and kind not in kinds:
        raise ValueError(f"{text!r}: unknown kind {kind!r}; expected one of {sorted(kinds)}")
    if not rest or "=" not in rest:
        return Spec(text=text, kind=kind, args=rest.strip())
    params: dict[str, str] = {}
    for item in rest.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{text!r}: {item!r} is not key=value")
        params[key.strip()] = value.strip()
    return Spec(text=text, kind=kind, params=params)
