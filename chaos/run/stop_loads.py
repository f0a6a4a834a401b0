"""A global control of ``kvstorm chaos run``: an interrupted experiment stops its loads instead of waiting them out.

Chaos Toolkit turns a SIGTERM (the controller's stop) or a Ctrl-C into an interruption, but before it runs the
rollbacks it waits for the method's background activities to return, and a load returns when its whole schedule has
been sent. For the run, this control wraps the handlers of both signals: the signal first sets
``RunState.stopping``, which ``chaos.run.load`` watches, then interrupts as before.
"""

from __future__ import annotations

import signal
from typing import Any

from chaos.run.state import current

_replaced: dict[int, Any] = {}


def before_experiment_control(context: Any, **_: Any) -> None:
    stopping = current().stopping
    for signum in (signal.SIGTERM, signal.SIGINT):
        interrupt = signal.getsignal(signum)
        if not callable(interrupt):  # ignored, or the default action (the process ends: nothing waits)
            continue

        def stop_loads_then_interrupt(signum: int, frame: Any, interrupt: Any = interrupt) -> None:
            stopping.set()
            interrupt(signum, frame)

        _replaced[signum] = interrupt
        signal.signal(signum, stop_loads_then_interrupt)


def after_experiment_control(context: Any, state: Any = None, **_: Any) -> None:
    while _replaced:
        signum, interrupt = _replaced.popitem()
        signal.signal(signum, interrupt)
