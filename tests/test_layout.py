"""The layering rules of the repository, read from the source: what may import what, and what the serving layer may
touch of the engine. Each rule fails with the file, the line and what broke it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.interface import EngineClient

ROOT = Path(__file__).resolve().parent.parent
OUR_PACKAGES = ("kvstorm", "engine", "kernels", "loadgen", "chaos", "dashboards")
# What the serving layer may import of the core: the interface, plain data, the forecast and admission control (its
# decisions from forecasts, which the simulator runs too). Never the request the engine thread mutates, the scheduler
# or the pools.
SERVING_SEES_OF_THE_CORE = (
    "interface",
    "outputs",
    "config",
    "sampling_params",
    "fault_limits",
    "forecast",
    "admission",
)


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (a lazy import inside a function counts too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def forbidden_imports(package: str, allowed: tuple[str, ...]) -> list[str]:
    """Imports of our own packages from ``package`` that are not under one of the ``allowed`` prefixes."""
    problems = []
    for path in python_files(package):
        for line, module in imported_modules(path):
            ours = module.split(".")[0] in OUR_PACKAGES
            if ours and not any(module == prefix or module.startswith(prefix + ".") for prefix in allowed):
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return problems


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("kernels", ("kernels",)),
        ("engine/core", ("engine.core",)),
        ("engine/serving", ("engine.serving", *(f"engine.core.{module}" for module in SERVING_SEES_OF_THE_CORE))),
        ("engine", ("engine", "kernels")),
        ("loadgen", ("loadgen",)),
        ("dashboards", ("dashboards",)),
        ("chaos", ("chaos", "loadgen", "dashboards")),
    ],
)
def test_imports_run_one_way(package, allowed):
    """kernels depend on nothing of ours, the engine on kernels, the core on itself, the serving layer on the core's
    interface and plain data (never ``engine.core.request``: it holds no object the engine thread changes); the
    harness (loadgen, dashboards, chaos) talks HTTP and imports no engine; only kvstorm/ imports
    everything."""
    assert forbidden_imports(package, allowed) == []


def test_the_scheduling_core_imports_without_torch():
    modules = sorted(f"engine.core.{path.stem}" for path in python_files("engine/core") if path.stem != "__init__")
    # torch made unimportable: any import of it, however indirect, fails the child.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        f"for name in {modules!r}: __import__(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('engine.') and not m.startswith('engine.core')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", "the core pulled in other engine modules"
    assert len(modules) >= 10


def engine_attribute_uses(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every ``<x>.engine.<attribute>`` and ``engine.<attribute>`` in the file, where ``engine``
    is the engine object the serving layer holds (``self.engine``, ``async_engine.engine``, a parameter named
    ``engine``)."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value
        if (isinstance(holder, ast.Name) and holder.id == "engine") or (
            isinstance(holder, ast.Attribute) and holder.attr == "engine"
        ):
            uses.append((node.lineno, node.attr))
    return uses


def test_the_serving_layer_uses_only_the_engine_interface():
    """The server sees the engine through one snapshot and a few commands (``EngineClient``), never its scheduler,
    block pools or model runner, so those can change without touching the server."""
    interface = {name for name in dir(EngineClient) if not name.startswith("_")} | set(EngineClient.__annotations__)
    problems = [
        f"{path.relative_to(ROOT)}:{line} uses engine.{attribute}"
        for path in python_files("engine/serving")
        for line, attribute in engine_attribute_uses(path)
        if attribute not in interface
    ]
    assert problems == []
    uses = {attribute for path in python_files("engine/serving") for _, attribute in engine_attribute_uses(path)}
    assert {"snapshot", "step", "abort_request", "update_faults"} <= uses, "the check no longer sees the engine"
