"""The server under test as compose's stack finds it: ``python -m dashboards.scrape_target URL FILE``.

compose.yaml points chaos, Locust and Prometheus at one URL, ``${KVSTORM_TARGET_URL:-http://engine:8000}``: the
bundled engine, or a server you run (compose.target.yaml). Prometheus reads no variable in its scrape config, so this
one-shot service waits until that server answers ``/health``, then writes where to scrape it into a file_sd target
file, which prometheus.yml's engine job reads: the URL's host and port, its scheme, and ``/metrics`` under its path
(``http://gpu-box:8000`` is scraped at ``http://gpu-box:8000/metrics``). The harness's services start once it has
exited 0 (``depends_on: service_completed_successfully``), as they waited for the bundled engine's healthcheck.

The URL is the operator's; it is still checked: http or https, a host, no credentials (they would show in
Prometheus' target page), no query or fragment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import requests

POLL_S = 1.0


def scrape_targets(target_url: str) -> list[dict[str, Any]]:
    """Prometheus' file_sd content for the server at ``target_url``; ``ValueError`` for a URL it cannot be."""
    parts = urllib.parse.urlsplit(target_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{target_url!r}: expected http://HOST[:PORT][/PATH] or https://...")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{parts.scheme}://...@{parts.hostname}: credentials in the URL would show in Prometheus")
    if parts.query or parts.fragment:
        raise ValueError(f"{target_url!r}: a server's base URL has no query or fragment")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{target_url!r}: the port is not a number in 0-65535") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    labels = {"__scheme__": parts.scheme, "__metrics_path__": f"{parts.path.rstrip('/')}/metrics"}
    return [{"targets": [f"{host}:{port}"], "labels": labels}]


def wait_until_healthy(target_url: str, timeout_s: float) -> float:
    """Seconds until ``target_url``'s ``/health`` answered 200; ``TimeoutError`` after ``timeout_s``."""
    started = time.monotonic()
    health = f"{target_url.rstrip('/')}/health"
    while True:
        try:
            if requests.get(health, timeout=5).status_code == 200:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{health} did not answer 200 within {timeout_s:g} s")
        time.sleep(POLL_S)


def write_targets(path: Path, targets: list[dict[str, Any]]) -> None:
    """Whole or not at all: Prometheus watches the file and must never read half of it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(targets, indent=2) + "\n")
    os.replace(partial, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dashboards.scrape_target", description=__doc__.split("\n")[0])
    parser.add_argument("target_url", help="the server's base URL (its /health, /metrics, /v1/...)")
    parser.add_argument("targets_file", type=Path, help="the file_sd file Prometheus' engine job reads")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long to wait for /health")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = scrape_targets(args.target_url)
        waited_s = wait_until_healthy(args.target_url, args.timeout_s)
    except (ValueError, TimeoutError) as error:
        print(f"scrape-target: {error}", file=sys.stderr)
        return 1
    write_targets(args.targets_file, targets)
    where = (
        f"{targets[0]['labels']['__scheme__']}://{targets[0]['targets'][0]}{targets[0]['labels']['__metrics_path__']}"
    )
    print(f"scrape-target: {args.target_url} answered after {waited_s:.1f} s; Prometheus scrapes {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
