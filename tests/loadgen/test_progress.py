"""The live progress line shows what a person watching a run needs, from the run's counters."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console

from loadgen.counters import RunCounters
from loadgen.progress import LiveProgress


def test_progress_line_counts_and_token_rate():
    counters = RunCounters(total=10)
    console = Console(file=io.StringIO(), width=200, force_terminal=False)

    async def run() -> None:
        async with LiveProgress(counters, refresh_s=0.05, console=console):
            counters.num_sent, counters.num_finished, counters.num_failed = 7, 4, 1
            counters.num_tokens = 500
            await asyncio.sleep(0.12)

    asyncio.run(run())
    output = console.file.getvalue()
    assert "sent 7/10  in flight 3  finished 4  failed 1" in output
    assert "tok/s" in output
    rates = [float(part.split()[-1]) for part in output.split("tok/s")[:-1]]
    assert max(rates) > 0
