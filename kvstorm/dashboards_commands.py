"""``kvstorm dashboards build`` (Grafana dashboards, Prometheus rules and config from the SLO spec) and ``kvstorm
dashboards render`` (the same panels from a Prometheus server into one HTML file, no Grafana needed)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dashboards.build import (
    COMPOSE_CONTROLLER_TARGETS,
    COMPOSE_ENGINE_TARGETS,
    COMPOSE_PROMETHEUS_URL,
    boards,
    build_all,
)
from dashboards.render import render
from dashboards.rules import recordings
from dashboards.slo import PROFILES, load_spec
from loadgen.spec import parse_duration


def add_dashboards_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dashboards", help="SLO dashboards and Prometheus rules from one SLO spec")
    commands = parser.add_subparsers(dest="dashboards", required=True)
    build = commands.add_parser("build", help="write the Grafana dashboards, Prometheus rules, scrape config")
    build.add_argument("--out", type=Path, required=True)
    build.add_argument(
        "--engine-target",
        action="append",
        default=None,
        help="host:port (repeatable; default: compose's, the file its scrape-target service writes)",
    )
    build.add_argument("--controller-target", action="append", default=None, help="host:port (repeatable)")
    build.add_argument("--prometheus-url", default=COMPOSE_PROMETHEUS_URL, help="Grafana's datasource URL")
    build.add_argument("--scrape-interval", default="5s")
    render_parser = commands.add_parser("render", help="draw every panel from a Prometheus server into one HTML file")
    render_parser.add_argument("--prometheus-url", required=True)
    render_parser.add_argument("--since", type=parse_duration, default=900.0, help="how far back (15m)")
    render_parser.add_argument("--out", type=Path, required=True)
    for sub in (build, render_parser):
        sub.add_argument("--profile", choices=sorted(PROFILES), default="cpu", help="the SLO spec's profile")
        sub.add_argument("--slo-file", type=Path, default=None, help="YAML overrides: {slo: {threshold, objective}}")
    build.set_defaults(handler=run_build)
    render_parser.set_defaults(handler=run_render)


def run_build(args: argparse.Namespace) -> int:
    written = build_all(
        args.out,
        load_spec(args.profile, args.slo_file),
        engine_targets=args.engine_target or COMPOSE_ENGINE_TARGETS,
        controller_targets=args.controller_target or COMPOSE_CONTROLLER_TARGETS,
        prometheus_url=args.prometheus_url,
        scrape_interval=args.scrape_interval,
    )
    for path in written:
        print(path)
    return 0


def run_render(args: argparse.Namespace) -> int:
    end = time.time()
    slos = load_spec(args.profile, args.slo_file)
    page = render(boards(slos), args.prometheus_url, end - args.since, end, recordings(slos))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
