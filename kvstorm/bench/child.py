"""One way a benchmark measures in a fresh process: ``run_in_child(function, Result, **kwargs)`` runs
``function(**kwargs)`` in a new Python (its own torch threads, allocator and caches, so one measurement does not
leak into the next, and a crash or a timeout ends only it) and returns what it returned, a ``Result`` dataclass.

The child is ``python -m kvstorm.bench.child MODULE:FUNCTION KWARGS_JSON RESULT_PATH``: a module-level function (the
benchmark's code names it, never a caller) taking JSON values and returning a dataclass of JSON values, which the
child writes to ``RESULT_PATH``; nothing is parsed out of its output.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvstorm.bench.process import ChildRun, run_child

Result = TypeVar("Result")


def run_in_child(
    function: Callable[..., Result], result_type: type[Result], timeout_s: float | None = None, **kwargs: Any
) -> Result:
    """``function(**kwargs)`` in a child process; ``RuntimeError`` with the end of its output if it fails or times
    out."""
    return measure_in_child(function, result_type, timeout_s, **kwargs)[0]


def measure_in_child(
    function: Callable[..., Result], result_type: type[Result], timeout_s: float | None = None, **kwargs: Any
) -> tuple[Result, ChildRun]:
    """``run_in_child``, and the child process as measured from outside (wall time, peak RSS)."""
    target = f"{function.__module__}:{function.__qualname__}"
    with tempfile.TemporaryDirectory() as folder:
        result_path = Path(folder) / "result.json"
        command = [sys.executable, "-m", "kvstorm.bench.child", target, json.dumps(kwargs), str(result_path)]
        child = run_child(command, timeout_s)
        if child.exit_code != 0 or not result_path.exists():
            ended = "timed out" if child.exit_code is None else f"exited with {child.exit_code}"
            raise RuntimeError(f"{target}(**{kwargs}) {ended} in its child process:\n{child.output[-3000:]}")
        return result_type(**json.loads(result_path.read_text())), child


def main(argv: list[str]) -> int:
    target, kwargs, result_path = argv
    module_name, _, function_name = target.partition(":")
    result = getattr(importlib.import_module(module_name), function_name)(**json.loads(kwargs))
    Path(result_path).write_text(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
