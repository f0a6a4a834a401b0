"""The kvstorm control of Chaos Toolkit, which every experiment of the library loads::

    controls:
      - name: kvstorm
        provider: {type: python, module: chaos.controls}

It does three things:

- **An experiment the server cannot take stops before it starts.** One that injects engine faults needs kvstorm's
  ``/admin/faults`` (at ``faults_url`` when it is set), with the faults it sets; against a server without them the
  run is interrupted before the baseline, and the journal carries the reason (``kvstorm_not_applicable``), which
  the verdict reports as NOT APPLICABLE (``chaos.judgement.applicability``).

- **A baseline miss fails the run.** chaostoolkit-lib records a steady state missed before the method as status
  "completed", not deviated, and the stock ``chaos run`` then exits 0 although nothing was injected. After the
  experiment this control marks such a journal "failed", so the stock CLI exits 1 (``kvstorm chaos run`` judges the
  journal itself: NOT RUN, ``chaos.judgement.verdict.judge``).
- **A managed server** (optional): with a ``command`` it starts the server under test before the experiment and
  stops it after, so the experiment can kill and restart it (``chaos.actions.kill_server`` / ``restart_server``)::

      arguments: {command: "${server_command}", ready_url: "${target_url}/ready"}

  An empty ``command`` starts nothing: the experiment targets a server someone else runs.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from chaoslib.exceptions import InterruptExecution

from chaos.injectors.processes import ManagedServer
from chaos.judgement.applicability import inapplicability
from chaos.run.state import current

logger = logging.getLogger("chaostoolkit")


def before_experiment_control(
    context: Any, command: str = "", ready_url: str = "", log_path: str = "", configuration: Any = None, **_: Any
) -> None:
    """``context``: the experiment; ``configuration``: its values (``target_url``, and ``faults_url`` where its
    fault contract is elsewhere: kvstorm's plugin in a vLLM)."""
    if command:
        server = ManagedServer(command, ready_url, Path(log_path) if log_path else None)
        server.start()
        current().managed_server = server
    target_url, faults_url = ((configuration or {}).get(key) for key in ("target_url", "faults_url"))
    problem = inapplicability(context, target_url, faults_url) if isinstance(context, dict) and target_url else None
    if problem is not None:
        current().not_applicable = problem
        raise InterruptExecution(problem)


def after_experiment_control(context: Any, state: Any = None, **_: Any) -> None:
    """``state``: the run's journal (Chaos Toolkit passes the one it returns and writes, so a change here shows in
    the journal file and in the CLI's exit status)."""
    try:
        if isinstance(state, MutableMapping):
            if current().not_applicable is not None:
                state["kvstorm_not_applicable"] = current().not_applicable
            fail_a_baseline_miss(state)
    finally:
        server = current().managed_server
        if server is not None:
            server.stop()


def fail_a_baseline_miss(journal: MutableMapping[str, Any]) -> bool:
    """Mark a journal whose steady state was missed before the method "failed" (what chaostoolkit-lib itself records
    when a probe raises there); True when it changed it. A journal that is already failed, aborted, interrupted or
    deviated, or whose baseline was met, is left as it is."""
    before = (journal.get("steady_states") or {}).get("before")
    if before is None or before.get("steady_state_met") is not False or journal.get("status") != "completed":
        return False
    journal["status"] = "failed"
    logger.error("The steady state was missed before the method: nothing was injected; the run is marked failed")
    return True
