"""A CPU co-tenant: processes on this host that keep cores busy beside the server, as a batch job or a noisy
neighbour in a shared machine does, taking CPU the server counted on.

Each process runs a busy loop for ``duty_cycle`` of every ``PERIOD_S`` and sleeps the rest, and ends by itself at its
deadline (its lease): a harness that dies leaves nothing running past ``duration_s``. The bounds (``check``) keep
it a neighbour, not a fork bomb: at most one process per CPU of this host, at most ``MAX_DURATION_S``. It loads the
host this process runs on, so it reaches a server only on the same host (a loopback target).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_DURATION_S = 600.0
PERIOD_S = 0.1
# The child's whole program: its arguments are two numbers this module formats, never a caller's text.
_BUSY_LOOP = """
import sys, time
duty, deadline, period = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
while (now := time.time()) < deadline:
    busy_until = min(now + duty * period, deadline)
    while time.time() < busy_until:
        pass
    rest = min(period * (1 - duty), deadline - time.time())
    if rest > 0:
        time.sleep(rest)
"""


@dataclass(frozen=True)
class CoTenantSpec:
    cores: int = 1
    duty_cycle: float = 1.0
    duration_s: float = 30.0

    def check(self) -> CoTenantSpec:
        """``ValueError`` naming the bound a value breaks."""
        cpus = os.cpu_count() or 1
        if type(self.cores) is not int or not 1 <= self.cores <= cpus:
            raise ValueError(f"cores must be a whole number from 1 to this host's {cpus} CPUs, got {self.cores!r}")
        if not 0 < self.duty_cycle <= 1:
            raise ValueError(f"duty_cycle must be in (0, 1], got {self.duty_cycle!r}")
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration_s must be in (0, {MAX_DURATION_S:g}], got {self.duration_s!r}")
        return self


def check_on_this_host(target_url: str) -> None:
    """``ValueError`` unless ``target_url`` is on this host (a loopback address or localhost): the co-tenant loads
    only the CPUs of the host it runs on."""
    host = urlsplit(target_url).hostname or ""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if not local:
        raise ValueError(
            f"a CPU co-tenant runs on the harness's host, and {target_url} is not on it (a loopback address): run "
            "the harness on the server's host"
        )


class CpuCoTenant:
    """``spec.cores`` busy-looping processes from ``start`` until their deadline, or ``stop``."""

    def __init__(self, spec: CoTenantSpec) -> None:
        self.spec = spec.check()
        self._processes: list[subprocess.Popen] = []

    def start(self) -> None:
        deadline = time.time() + self.spec.duration_s
        arguments = [f"{self.spec.duty_cycle!r}", f"{deadline!r}", f"{PERIOD_S!r}"]
        self._processes = [
            subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, *arguments], stdin=subprocess.DEVNULL)
            for _ in range(self.spec.cores)
        ]

    def wait(self) -> None:
        """Until every process reached its deadline (a little past ``duration_s``, never much more: then stopped)."""
        for process in self._processes:
            try:
                process.wait(timeout=self.spec.duration_s + 5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop(self) -> int:
        """Every process still running killed; how many were."""
        running = [process for process in self._processes if process.poll() is None]
        for process in running:
            process.kill()
        for process in running:
            process.wait()
        return len(running)

    @property
    def num_running(self) -> int:
        return sum(process.poll() is None for process in self._processes)
