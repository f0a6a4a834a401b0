"""The instruction-set ceiling: ``KVSTORM_CPU_ISA`` caps what every part of the engine uses on this CPU, so that one
machine stands in for a CPU with less (an AVX2-only server on an AVX-512 one, say).

Under a ceiling the C++ kernels are compiled for it (a build cache of their own), the tile matmuls and ``--dtype
auto`` see only the CPU flags it allows, and oneDNN, ATen and MKL are capped to match through their own variables.
Those three read their variable once, when first used, so :func:`apply_cpu_isa_ceiling` must run before torch does
any work: every ``kvstorm`` command runs it first thing, and so does the test suite. A ceiling above the real CPU is
refused. Imports nothing heavy (no torch), for that reason.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

CPU_ISA_ENV = "KVSTORM_CPU_ISA"
NATIVE = "native"


@dataclass(frozen=True)
class Ceiling:
    """One ceiling: the CPU flags it needs (as /proc/cpuinfo names them), the compiler's target for the kernels,
    and the caps of oneDNN (``ONEDNN_MAX_CPU_ISA``), ATen (``ATEN_CPU_CAPABILITY``) and MKL
    (``MKL_ENABLE_INSTRUCTIONS``)."""

    name: str
    flags: frozenset[str]
    compiler_flags: tuple[str, ...]
    onednn: str
    aten: str
    mkl: str


_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c", "bmi2"})  # x86-64-v3, the compiler's level for AVX2 machines
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
# Lowest first: each allows what the ones before it allow.
CEILINGS = (
    Ceiling("avx2", _AVX2_FLAGS, ("-march=x86-64-v3",), "AVX2", "avx2", "AVX2"),
    Ceiling("avx512", _AVX512_FLAGS, ("-march=x86-64-v4",), "AVX512_CORE", "avx512", "AVX512"),
    Ceiling(
        "avx512-bf16",
        _AVX512_FLAGS | {"avx512_bf16"},
        ("-march=x86-64-v4", "-mavx512bf16"),
        "AVX512_CORE_BF16",
        "avx512",
        "AVX512_E3",
    ),
    Ceiling(
        "amx",
        _AVX512_FLAGS | {"avx512_bf16", "amx_tile", "amx_bf16"},
        ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
        "AVX512_CORE_AMX",
        "avx512",
        "AVX512_E4",
    ),
)
CEILING_NAMES = (*(ceiling.name for ceiling in CEILINGS), NATIVE)
# The flag families above AVX2: AVX-512's, AMX's, and the VEX-encoded AI extensions of recent Intel cores.
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")
# Each library's variable, with the ceiling's field that sets it.
LIBRARY_CAPS = {"ONEDNN_MAX_CPU_ISA": "onednn", "ATEN_CPU_CAPABILITY": "aten", "MKL_ENABLE_INSTRUCTIONS": "mkl"}


class CeilingError(ValueError):
    """A ceiling that is unknown, or above what this CPU has."""


@functools.cache
def real_cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (x86 "flags", Arm "Features"); none off Linux."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = cpuinfo.read().splitlines()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def ceiling_name() -> str:
    """The ceiling in force (``KVSTORM_CPU_ISA``, default native), checked against the real CPU."""
    return check_ceiling(os.environ.get(CPU_ISA_ENV, "").strip().lower() or NATIVE)


def check_ceiling(name: str) -> str:
    """``name`` if this CPU reaches that ceiling; else ``CeilingError`` naming what the CPU lacks."""
    if name == NATIVE:
        return NATIVE
    ceiling = _ceiling(name)
    missing = ceiling.flags - real_cpu_flags()
    if missing:
        raise CeilingError(
            f"{CPU_ISA_ENV}={name} is above this CPU, which lacks {', '.join(sorted(missing))}; "
            f"choose one of {', '.join(_ceilings_this_cpu_allows())}"
        )
    return name


def _ceiling(name: str) -> Ceiling:
    for ceiling in CEILINGS:
        if ceiling.name == name:
            return ceiling
    raise CeilingError(f"{CPU_ISA_ENV}={name!r} is not a ceiling; choose one of {', '.join(CEILING_NAMES)}")


def _ceilings_this_cpu_allows() -> list[str]:
    return [ceiling.name for ceiling in CEILINGS if ceiling.flags <= real_cpu_flags()] + [NATIVE]


def visible_cpu_flags(name: str | None = None) -> frozenset[str]:
    """The CPU flags the engine may use under ceiling ``name`` (default: the one in force): the real ones, less any
    instruction-set flag above the ceiling."""
    name = ceiling_name() if name is None else check_ceiling(name)
    if name == NATIVE:
        return real_cpu_flags()
    allowed = _ceiling(name).flags
    # What lies above AVX2 goes unless the ceiling names it (avx512_vnni and amx_int8 too, under avx2); flags below
    # every ceiling (sse4_2, avx, popcnt...) stay.
    return frozenset(flag for flag in real_cpu_flags() if flag in allowed or not flag.startswith(_ABOVE_AVX2))


def kernel_compiler_flags() -> tuple[str, ...]:
    """The compiler's target for the C++ kernels under the ceiling (tuned for this CPU, using no more than allowed)."""
    name = ceiling_name()
    if name == NATIVE:
        return ("-march=native",)
    return (*_ceiling(name).compiler_flags, "-mtune=native")


def library_caps() -> dict[str, str]:
    """The variables that cap oneDNN, ATen and MKL to the ceiling (none under native)."""
    name = ceiling_name()
    if name == NATIVE:
        return {}
    ceiling = _ceiling(name)
    return {variable: getattr(ceiling, field) for variable, field in LIBRARY_CAPS.items()}


def apply_cpu_isa_ceiling() -> str:
    """Check the ceiling and cap oneDNN, ATen and MKL to it in this process's environment (children inherit it);
    returns the ceiling's name. Run before torch does any work; a ceiling above the CPU raises ``CeilingError``."""
    caps = library_caps()
    os.environ.update(caps)
    return ceiling_name()


def check_library_caps() -> None:
    """Raise ``CeilingError`` unless oneDNN, ATen and MKL are capped to the ceiling in force: a process that set
    ``KVSTORM_CPU_ISA`` after torch started working (not through the ``kvstorm`` command) would run them uncapped."""
    import torch  # here, not at the top: this module is imported before torch is, to cap it

    caps = library_caps()
    aten = torch.backends.cpu.get_cpu_capability().lower()
    wrong = [variable for variable, value in caps.items() if os.environ.get(variable) != value]
    if caps and (wrong or aten != caps["ATEN_CPU_CAPABILITY"]):
        raise CeilingError(
            f"{CPU_ISA_ENV}={ceiling_name()} was set after torch started (ATen runs {aten}; not capped: "
            f"{', '.join(wrong) or 'ATen'}): set it before the process starts, or call "
            "kernels.cpu_isa.apply_cpu_isa_ceiling() before importing torch"
        )


def real_cpu_kind() -> str:
    """The highest ceiling the real CPU reaches ("amx", "avx512-bf16", "avx512", "avx2"), else the machine's name."""
    reached = [ceiling.name for ceiling in CEILINGS if ceiling.flags <= real_cpu_flags()]
    return reached[-1] if reached else platform.machine()


def cpu_kind(name: str | None = None) -> str:
    """What the engine runs on under ceiling ``name`` (default: the one in force), for benchmark sections and
    reports: the real CPU's kind, or under a ceiling the ceiling and the real kind ("avx2-on-avx512-bf16")."""
    name = ceiling_name() if name is None else check_ceiling(name)
    return real_cpu_kind() if name == NATIVE else f"{name}-on-{real_cpu_kind()}"


def describe_cpu_isa() -> str:
    """For start-up lines and reports: the ceiling and what the CPU really has."""
    name = ceiling_name()
    if name == NATIVE:
        return f"instruction set native ({real_cpu_kind()})"
    return f"instruction set capped at {name} by {CPU_ISA_ENV} (the CPU has {real_cpu_kind()})"
