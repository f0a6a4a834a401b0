"""A real Prometheus (Debian's) for the dashboards' tests, on loopback, stopped when the block ends."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chaos.injectors.processes import ManagedServer


@contextmanager
def running_prometheus(built: Path, workdir: Path, port: int) -> Iterator[str]:
    """Prometheus on 127.0.0.1:``port`` with the scrape config and rules ``dashboards.build.build_all`` wrote under
    ``built``, its data and log under ``workdir``; yields its URL once ready."""
    url = f"http://127.0.0.1:{port}"
    command = [
        shutil.which("prometheus") or "prometheus",
        f"--config.file={built / 'prometheus' / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    prometheus = ManagedServer(command, f"{url}/-/ready", workdir / "prometheus.log")
    prometheus.start()
    try:
        yield url
    finally:
        prometheus.stop()
