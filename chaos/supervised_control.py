"""The control that gives kill-and-restart a server someone else runs, for its supervisor to restart::

    controls:
      - name: supervised-server
        provider:
          type: python
          module: chaos.supervised_control
          arguments: {command: "${server_command}", ready_url: "${target_url}${ready_path}"}

With a ``command`` the experiment starts the server itself (the kvstorm control, ``chaos.controls``) and this control
does nothing. Without one the server is someone else's: the experiment's kill asks it to exit through its admin API
and its supervisor starts it again (``chaos.injectors.supervised``). A server that would not exit when asked (no
``/admin/exit``, started without ``--admin-exit``, no admin token) stops the run before anything is sent, and the
verdict says NOT APPLICABLE with the reason, as for a server without the engine faults an experiment needs.
"""

from __future__ import annotations

from typing import Any

from chaoslib.exceptions import InterruptExecution

from chaos.injectors.supervised import SupervisedServer
from chaos.run.state import current


def before_experiment_control(
    context: Any, command: str = "", ready_url: str = "", configuration: Any = None, **_: Any
) -> None:
    """``configuration``: the experiment's values (``target_url``)."""
    target_url = (configuration or {}).get("target_url")
    if command or not ready_url or not target_url:
        return
    server = SupervisedServer(target_url, ready_url)
    problem = server.refusal()
    if problem is not None:
        current().not_applicable = f"not applicable to this server: {problem}; nothing was run"
        raise InterruptExecution(current().not_applicable)
    current().managed_server = server
