"""The live line a person watches during ``kvstorm bench serve``: elapsed, sent, in flight, finished, failed, tokens/s.

Refreshed by a task on the run's own event loop rather than by rich's refresh thread: a thread would take the GIL
from the loop at arbitrary moments and add its jitter to the timestamps being measured. Rendering one short line
twice a second costs well under a millisecond.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from rich.console import Console
from rich.live import Live
from rich.text import Text

from loadgen.counters import RunCounters


class LiveProgress:
    def __init__(self, counters: RunCounters, *, refresh_s: float = 0.5, console: Console | None = None) -> None:
        self.counters = counters
        self.refresh_s = refresh_s
        self._live = Live(console=console or Console(stderr=True), auto_refresh=False, transient=False)
        self._task: asyncio.Task | None = None
        self._start_ts = self._last_ts = time.perf_counter()
        self._last_tokens = 0
        self._tokens_per_s = 0.0

    async def __aenter__(self) -> LiveProgress:
        self._start_ts = self._last_ts = time.perf_counter()
        self._live.start()
        self._task = asyncio.create_task(self._refresh_forever())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # The last line stays on screen: it shows the whole run's average rate, not the last half second's.
        elapsed_s = time.perf_counter() - self._start_ts
        self._tokens_per_s = self.counters.num_tokens / elapsed_s if elapsed_s > 0 else 0.0
        self._live.update(self.render(elapsed_s), refresh=True)
        self._live.stop()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            self._refresh()

    def _refresh(self) -> None:
        now = time.perf_counter()
        if now > self._last_ts:
            self._tokens_per_s = (self.counters.num_tokens - self._last_tokens) / (now - self._last_ts)
        self._last_ts, self._last_tokens = now, self.counters.num_tokens
        self._live.update(self.render(now - self._start_ts), refresh=True)

    def render(self, elapsed_s: float) -> Text:
        c = self.counters
        line = Text()
        line.append(f"{elapsed_s:7.1f} s  ", style="bold")
        line.append(f"sent {c.num_sent}/{c.total}  in flight {c.num_in_flight}  finished {c.num_finished}  ")
        line.append(f"failed {c.num_failed}  ", style="red" if c.num_failed else "")
        line.append(f"{self._tokens_per_s:8.1f} tok/s", style="cyan")
        return line
