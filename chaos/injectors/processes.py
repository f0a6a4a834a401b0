"""A server process the harness starts itself, so it can kill it (SIGTERM or SIGKILL) and start it again.

Time to ready is measured from the start of the process to the first 200 from its readiness URL. Its output goes to
a log file beside the experiment's results, not to the terminal.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests


class ManagedServer:
    """``command``: a list or a shell-like string; a leading ``python`` (or ``kvstorm``) means the interpreter (or
    the kvstorm of) the harness itself, which need not be on the PATH. ``env``: variables over the harness's own."""

    def __init__(
        self,
        command: list[str] | str,
        ready_url: str,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = _resolve(shlex.split(command) if isinstance(command, str) else list(command))
        self.ready_url = ready_url
        self.log_path = log_path
        self.env = None if env is None else {**os.environ, **env}
        self.process: subprocess.Popen | None = None

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 300.0) -> float:
        """Start it and wait until it is ready; returns the seconds that took."""
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        started = time.monotonic()
        # Its own process group: a kill reaches whatever it started too.
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
        )
        if log is not subprocess.DEVNULL:
            log.close()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{shlex.join(self.command)} exited with {self.process.returncode} before ready{self._log_tail()}"
                )
            try:
                if requests.get(self.ready_url, timeout=2).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"{shlex.join(self.command)} was not ready at {self.ready_url} within {timeout_s:g} s{self._log_tail()}"
        )

    def _log_tail(self, num_lines: int = 20) -> str:
        """The end of its log, for an error that says why it did not start ("" without a log)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-num_lines:]
        return f"; the end of {self.log_path}:\n" + "\n".join(lines)

    def kill(self, signal_name: str = "SIGKILL", timeout_s: float = 60.0) -> float:
        """Send the signal to the process group and wait for the process to end; returns the seconds it took."""
        if not self.is_running:
            raise RuntimeError("the managed server is not running")
        signum = signal.Signals[signal_name]
        started = time.monotonic()
        os.killpg(self.process.pid, signum)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        return time.monotonic() - started

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not end within 30 s; nothing if it is not running."""
        if self.is_running:
            self.kill("SIGTERM", timeout_s=30.0)


def _resolve(command: list[str]) -> list[str]:
    if not command:
        raise ValueError("a managed server needs a command")
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    if command[0] == "kvstorm":
        return [sys.executable, "-m", "kvstorm", *command[1:]]
    return command


@dataclass(frozen=True)
class RunningKvstorm:
    url: str
    server: ManagedServer


@contextmanager
def kvstorm_server(
    serve_args: Sequence[str], log_path: Path | None = None, env: Mapping[str, str] | None = None
) -> Iterator[RunningKvstorm]:
    """``kvstorm serve SERVE_ARGS`` on a free loopback port, waited for until ready (an error with the end of its log
    when it does not get there); yields its base URL and process, and stops it when the block ends. The one way
    chaos, benchmarks, scripts and tests start a kvstorm. Without ``log_path`` the log lives as long as the server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvstorm-serve-") as scratch:
        log = log_path or Path(scratch) / "server.log"
        server = ManagedServer(["kvstorm", "serve", "--port", str(port), *serve_args], f"{url}/ready", log, env)
        server.start()
        try:
            yield RunningKvstorm(url, server)
        finally:
            server.stop()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
