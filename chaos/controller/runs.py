"""Experiment runs of the controller: each a ``kvstorm chaos run --events`` child process, one at a time.

A child of its own, not a thread: Chaos Toolkit runs an experiment in the process's main flow and stops it cleanly
on a signal (its rollbacks, then the lease keepers stop), so stopping a run is a SIGTERM, and a run that outlives
``max_run_s`` gets one too. On Linux the child also gets a SIGTERM if the controller itself dies, and the engine's
fault lease covers the rest: no fault outlives the harness by more than a lease.

The child's stdout carries its events (JSON lines); a reader thread keeps them, feeds the metrics, and records the
verdict from the last one.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chaos.controller.metrics import ControllerMetrics
from chaos.controller.parameters import OPERATOR_PARAMETERS, SCHEMAS, ParameterRefused, check_overrides
from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV, EngineAdmin
from chaos.run.runner import EXPERIMENTS_DIR
from loadgen.served_model import NoServedModel, served_model

STOP_GRACE_S = 60.0


class RunConflict(Exception):
    """Another run is active."""


class RunStartFailed(Exception):
    """The run's folder or its child process could not be made; the run is recorded as ``error``, the slot free."""


class TargetUnanswered(Exception):
    """The target did not say which model it serves (no ``--model`` was given); nothing started."""


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path
    title: str
    description: str
    # The configuration's values an override may change (those with a schema), with the defaults the file gives.
    parameters: dict[str, Any]
    # The configuration's values only the operator gives (a command to run): from the controller's own flags.
    operator_parameters: tuple[str, ...] = ()


@dataclass
class Run:
    id: str
    experiment: str
    overrides: dict[str, Any]
    results_dir: Path
    started_unix: float = field(default_factory=time.time)
    # running, then the verdict's status (chaos.judgement.verdict.STATUSES: held, not_run, deviated, ...), or
    # stopped / error.
    status: str = "running"
    phase: str | None = None
    verdict: dict[str, Any] | None = None
    ended_unix: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    process: subprocess.Popen | None = None
    stop_requested: str | None = None
    # Why the run ended in "error" when it never started (its folder or its process could not be made).
    error: str | None = None

    @property
    def is_active(self) -> bool:
        return self.ended_unix is None

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "experiment": self.experiment,
            "overrides": self.overrides,
            "status": self.status,
            "phase": self.phase,
            "started_unix": self.started_unix,
            "ended_unix": self.ended_unix,
            "verdict": self.verdict,
            "error": self.error,
            "num_events": len(self.events),
        }


def load_library() -> dict[str, Experiment]:
    library = {}
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        configuration = data.get("configuration", {})
        parameters = {
            key: value.get("default") if isinstance(value, dict) else value
            for key, value in configuration.items()
            if key in SCHEMAS
        }
        operator = tuple(key for key in configuration if key in OPERATOR_PARAMETERS)
        description = " ".join(data["description"].split())
        library[path.stem] = Experiment(path.stem, path, data["title"], description, parameters, operator)
    return library


class RunManager:
    def __init__(
        self,
        target_url: str,
        model: str | None,
        admin_token: str,
        results_dir: Path,
        metrics: ControllerMetrics,
        max_run_s: float,
        prometheus_url: str | None = None,
        data_dir: Path | None = None,
        operator_values: Mapping[str, str] | None = None,
    ) -> None:
        """``model``: None asks the target at each run's start (the first of its ``/v1/models``), so a stack
        pointed at a server by its URL alone follows it. ``data_dir``: where file parameters (``jsonl:path=``,
        ``trace:path=``) may resolve; None refuses them.
        ``operator_values``: the operator's values of ``OPERATOR_PARAMETERS`` (the kill-and-restart server command);
        an experiment that needs one the operator did not give is refused."""
        self.target_url = target_url
        self.model = model
        self.admin_token = admin_token
        self.results_dir = results_dir
        self.metrics = metrics
        self.max_run_s = max_run_s
        self.prometheus_url = prometheus_url
        self.data_dir = data_dir
        self.operator_values = dict(operator_values or {})
        self.library = load_library()
        self.runs: dict[str, Run] = {}
        self._lock = threading.Lock()

    # ---- commands ------------------------------------------------------------------------------

    def start(self, name: str, overrides: Mapping[str, Any]) -> Run:
        """``KeyError`` for an unknown experiment, ``ParameterRefused`` for a value a request may not give,
        ``RunConflict`` while another run is active, ``TargetUnanswered`` when the target names no model: nothing
        starts in those cases. ``RunStartFailed`` when its folder or process cannot be made: the run is recorded as
        failed and the slot is free again."""
        experiment = self.library[name]
        variables = check_overrides(name, experiment.parameters, overrides, self.data_dir)
        variables.update(self._operator_values(experiment))
        model = self._model()
        with self._lock:
            if any(run.is_active for run in self.runs.values()):
                raise RunConflict("another run is active: stop it (DELETE /runs/{id}) or wait for its verdict")
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            run = Run(run_id, name, dict(overrides), self.results_dir / run_id)
            self.runs[run_id] = run
        try:
            self._spawn(run, experiment, variables, model)
        except Exception as error:
            # Whatever failed (mkdir, open, Popen), the run must end, or every later POST /runs is a 409.
            self._end(run, "error", error=f"the run did not start: {type(error).__name__}: {error}")
            raise RunStartFailed(f"run {run.id} did not start: {run.error}") from error
        threading.Thread(target=self._follow, args=(run,), name=f"run-{run_id}", daemon=True).start()
        threading.Thread(target=self._watch_duration, args=(run,), name=f"watch-{run_id}", daemon=True).start()
        return run

    def _operator_values(self, experiment: Experiment) -> dict[str, Any]:
        """The operator's values an experiment needs (its server command): from the controller's flags only."""
        values = {}
        for key in experiment.operator_parameters:
            value = self.operator_values.get(key)
            if value is None:
                flag = OPERATOR_PARAMETERS[key]
                why = f"{experiment.name} needs the operator's {key}: start the controller with {flag}"
                raise ParameterRefused(key, why)
            values[key] = value
        return values

    def _model(self) -> str:
        if self.model is not None:
            return self.model
        try:
            return served_model(self.target_url)
        except NoServedModel as error:
            raise TargetUnanswered(f"the target did not say which model it serves ({error}): give --model") from None

    def _spawn(self, run: Run, experiment: Experiment, variables: Mapping[str, Any], model: str) -> None:
        run.results_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "kvstorm", "chaos", "run", str(experiment.path), "--events",
            "--target", self.target_url, "--model", model, "--results-dir", str(run.results_dir),
            *variable_args(variables),
            *(["--prometheus-url", self.prometheus_url] if self.prometheus_url else []),
        ]  # fmt: skip
        with open(run.results_dir / "run.log", "wb") as log:
            run.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, ADMIN_TOKEN_ENV: self.admin_token},
                preexec_fn=_terminate_with_parent,
            )

    def stop(self, run: Run, reason: str = "stopped by request") -> None:
        """SIGTERM (the child runs its rollbacks), then wait; the engine's faults are cleared here too."""
        if not run.is_active or run.process is None:
            return
        run.stop_requested = reason
        run.process.send_signal(signal.SIGTERM)
        try:
            run.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            run.process.kill()
            run.process.wait(10)
        self.clear_engine_faults()
        self._wait_ended(run, timeout_s=10)

    def shutdown(self) -> None:
        for run in list(self.runs.values()):
            self.stop(run, "the controller is shutting down")

    def clear_engine_faults(self) -> None:
        try:
            EngineAdmin(self.target_url, self.admin_token).clear_faults()
        finally:
            self.metrics.clear_faults()

    # ---- the child -----------------------------------------------------------------------------

    def _follow(self, run: Run) -> None:
        for line in run.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event["type"] == "phase":
                run.phase = event["phase"]
            elif event["type"] == "verdict":
                run.verdict = {key: value for key, value in event.items() if key not in ("type", "ts")}
            self.metrics.observe(run.id, run.experiment, event)
            run.events.append(event)
        run.process.wait()
        if run.verdict is not None:
            self._end(run, "stopped" if run.stop_requested else run.verdict["status"], count=False)
        else:
            self._end(run, "stopped" if run.stop_requested else "error")

    def _end(self, run: Run, status: str, *, count: bool = True, error: str | None = None) -> None:
        """The run's last event; ``count``: the metrics have not counted its result yet (no verdict event did)."""
        run.status, run.error = status, error
        if count:
            self.metrics.finish(run.id, run.experiment, status)
        end = {"ts": time.time(), "type": "end", "status": status, "reason": run.stop_requested or error}
        run.events.append(end)
        run.ended_unix = end["ts"]

    def _watch_duration(self, run: Run) -> None:
        deadline = run.started_unix + self.max_run_s
        while run.is_active and time.time() < deadline:
            time.sleep(0.5)
        if run.is_active:
            self.stop(run, f"longer than the maximum run duration ({self.max_run_s:g} s)")

    @staticmethod
    def _wait_ended(run: Run, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while run.is_active and time.monotonic() < deadline:
            time.sleep(0.05)


def variable_args(variables: Mapping[str, Any]) -> list[str]:
    """The child's options for its configuration values: JSON (``kvstorm chaos run --var-json``), so each arrives as
    the type it was checked as; ``--var`` reads YAML, where ``1e-05`` is a string the engine would refuse."""
    return [f"--var-json={key}={json.dumps(value)}" for key, value in variables.items()]


def _terminate_with_parent() -> None:
    """In the child, before exec: a SIGTERM when the controller dies, however it dies (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
