"""The live line a person watches during ``kvstorm chaos run``: phase, activity, load counts, faults, server state.

Chaos Toolkit reports phases through a run event handler and activities through controls; this module is both (it
is registered as a global control by the runner), and a thread redraws the line twice a second with the server's
queues and KV usage scraped from ``/metrics``. Phases, activities and the loads' figures (every second) also go
to the run's event listeners (``RunState.emit``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from chaoslib.run import RunEventHandler
from rich.console import Console
from rich.live import Live
from rich.text import Text

from chaos.run.metrics import KVOccupancy, scrape
from chaos.run.state import current

_active: LiveLine | None = None
LOAD_FIGURES = ("total", "num_sent", "num_finished", "num_failed", "num_tokens")


class LiveLine(RunEventHandler):
    def __init__(self, target_url: str, console: Console, refresh_s: float = 0.5) -> None:
        self.target_url = target_url
        self.refresh_s = refresh_s
        self.phase = "starting"
        self.activities: list[str] = []
        self._live = Live(console=console, auto_refresh=False, transient=False)
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._redraw_forever, name="chaos-progress", daemon=True)
        self._server = ""
        self._last_scrape = 0.0

    def __enter__(self) -> LiveLine:
        global _active
        _active = self
        self._live.start()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _active
        _active = None
        self._stop.set()
        self._thread.join(5)
        self._live.update(self.render(), refresh=True)
        self._live.stop()
        self._live.console.print()

    # ---- Chaos Toolkit events ------------------------------------------------------------------

    def start_hypothesis_before(self, experiment: Any) -> None:
        self._enter("steady state before")

    def start_method(self, experiment: Any) -> None:
        self._enter("method")

    def start_hypothesis_after(self, experiment: Any) -> None:
        self._enter("steady state after")

    def start_rollbacks(self, experiment: Any) -> None:
        self._enter("rollbacks")

    def finish(self, journal: Any) -> None:
        self._enter(f"finished ({journal.get('status')})")

    def _enter(self, phase: str) -> None:
        self.phase = phase
        current().emit("phase", phase=phase)

    # ---- the line ------------------------------------------------------------------------------

    def render(self) -> Text:
        state = current()
        line = Text()
        line.append(f"{time.monotonic() - self._start:6.1f} s  ", style="bold")
        line.append(f"{self.phase}", style="cyan")
        if self.activities:
            line.append(f" · {', '.join(self.activities)}")
        for load in state.loads.values():
            c = load.counters
            line.append(f"\n  load {load.name}: sent {c.num_sent}/{c.total}, in flight {c.num_in_flight}, ")
            line.append(f"finished {c.num_finished}, ")
            line.append(f"failed {c.num_failed}", style="red" if c.num_failed else "")
        if state.open_faults:
            line.append(f"\n  faults on: {', '.join(state.open_faults)}", style="bold red")
        if self._server:
            line.append(f"\n  server: {self._server}")
        return line

    def _redraw_forever(self) -> None:
        while not self._stop.wait(self.refresh_s):
            if time.monotonic() - self._last_scrape >= 1.0:
                self._last_scrape = time.monotonic()
                self._server = self._describe_server()
                for load in current().loads.values():
                    c = load.counters
                    current().emit("load", load=load.name, **{k: getattr(c, k) for k in LOAD_FIGURES})
            self._live.update(self.render(), refresh=True)

    def _describe_server(self) -> str:
        try:
            sample = scrape(self.target_url, timeout_s=2.0)
        except Exception as error:
            return f"unreachable ({type(error).__name__})"
        o = KVOccupancy.of(sample)
        preemptions = round(sample.total("vllm:num_preemptions_total"))
        return (
            f"running {o.running}, waiting {o.waiting}, swapped {o.swapped}, KV {o.device_usage:.0%} "
            f"(host {o.host_usage:.0%}), preemptions {preemptions}"
        )


# ---- the global control (chaoslib calls these for every activity) ---------------------------------


def before_activity_control(context: dict[str, Any], **_: Any) -> None:
    current().emit("activity", name=context.get("name"), activity_type=context.get("type"), started=True)
    if _active is not None:
        _active.activities.append(_describe(context))


def after_activity_control(context: dict[str, Any], **_: Any) -> None:
    current().emit("activity", name=context.get("name"), activity_type=context.get("type"), started=False)
    if _active is not None:
        name = _describe(context)
        if name in _active.activities:
            _active.activities.remove(name)


def _describe(activity: dict[str, Any]) -> str:
    name = activity.get("name", "?")
    return f"{name} (background)" if activity.get("background") else name
