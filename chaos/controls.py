"""A Chaos Toolkit control that starts the server under test before the experiment and stops it after, so the
experiment can kill and restart it (``chaos.actions.kill_server`` / ``restart_server``)::

    controls:
      - name: managed-server
        provider:
          type: python
          module: chaos.controls
          arguments: {command: "${server_command}", ready_url: "${target_url}/ready"}

An empty ``command`` starts nothing: the experiment targets a server someone else runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chaos.processes import ManagedServer
from chaos.state import current


def before_experiment_control(
    context: Any, command: str = "", ready_url: str = "", log_path: str = "", **_: Any
) -> None:
    if not command:
        return
    server = ManagedServer(command, ready_url, Path(log_path) if log_path else None)
    server.start()
    current().managed_server = server


def after_experiment_control(context: Any, state: Any = None, **_: Any) -> None:
    server = current().managed_server
    if server is not None:
        server.stop()
