"""loadgen talks HTTP only: no module imports the engine (or torch), and only the locustfile brings in gevent."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import loadgen
from tests.loadgen.conftest import child_env


def test_loadgen_imports_neither_engine_nor_gevent():
    modules = [f"loadgen.{m.name}" for m in pkgutil.iter_modules(loadgen.__path__) if m.name != "locustfile"]
    assert "loadgen.client" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'engine', 'torch', 'gevent', 'locust', 'kernels'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
