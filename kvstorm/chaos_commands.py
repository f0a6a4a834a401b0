"""``kvstorm chaos run|list`` (Chaos Toolkit experiments against any OpenAI-compatible server) and ``kvstorm demo``
(the main job: the bundled model under a burst with a VRAM cap, to a verdict)."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

import yaml
from rich.console import Console

from chaos.engine_admin import ADMIN_TOKEN_ENV
from chaos.processes import ManagedServer, free_port
from chaos.runner import EXPERIMENTS_DIR, resolve_experiment, run_experiment_file

DEMO_EXPERIMENT = "burst-with-vram-cap"
# A KV pool a burst on this model fills: 64 MiB holds 88 blocks of 16 tokens in float32 (about 1,400 tokens, eight
# requests of the experiment's shapes), and the experiment's 30% cap leaves 26 blocks.
DEMO_SERVER_ARGS = ("--kv-cache-memory", "64MiB", "--swap-space", "256MiB", "--preemption-mode", "auto")


def add_chaos_parser(subparsers: argparse._SubParsersAction) -> None:
    chaos = subparsers.add_parser("chaos", help="chaos experiments (Chaos Toolkit files) against a running server")
    chaos_subparsers = chaos.add_subparsers(dest="chaos", required=True)
    run = chaos_subparsers.add_parser(
        "run",
        help="run an experiment with live progress, then a verdict table and an HTML report",
        description="Runs a Chaos Toolkit experiment (a file, or a name from the library: `kvstorm chaos list`). "
        "Engine faults need the server's admin token in $" + ADMIN_TOKEN_ENV + ". Exit status 0: the steady state "
        "held; 1: it did not; 2: the run failed.",
    )
    run.add_argument("experiment", help="a .yaml/.json file or a library name")
    run.add_argument("--target", default=None, help="the server's base URL (the experiment's target_url)")
    run.add_argument("--model", default=None, help="the model name the server expects")
    run.add_argument("--var", action="append", default=[], metavar="KEY=VALUE", help="any configuration value")
    run.add_argument("--results-dir", type=Path, default=Path("chaos-results"), help="where each run's folder goes")
    run.set_defaults(handler=run_chaos)
    listing = chaos_subparsers.add_parser("list", help="the library of experiments, with what each reproduces")
    listing.set_defaults(handler=list_experiments)


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="start the engine on the bundled model and run 'burst with a VRAM cap' against it, to a verdict",
    )
    demo.add_argument("--results-dir", type=Path, default=Path("chaos-results"))
    demo.set_defaults(handler=run_demo)


def run_chaos(args: argparse.Namespace) -> int:
    variables = dict(_parse_var(item) for item in args.var)
    if args.target:
        variables["target_url"] = args.target
    if args.model:
        variables["model"] = args.model
    run = run_experiment_file(resolve_experiment(args.experiment), variables, args.results_dir)
    _print_where(run.results_dir)
    return run.verdict.exit_code


def list_experiments(_: argparse.Namespace) -> int:
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        experiment = yaml.safe_load(path.read_text())
        print(f"{path.stem}: {experiment['title']}\n    {' '.join(experiment['description'].split())}\n")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    port = free_port()
    token = secrets.token_urlsafe(16)
    os.environ[ADMIN_TOKEN_ENV] = token  # the server reads it at start, the experiment's actions when they call
    command = [sys.executable, "-m", "kvstorm", "serve", "--port", str(port), *DEMO_SERVER_ARGS]
    base_url = f"http://127.0.0.1:{port}"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    server = ManagedServer(command, f"{base_url}/ready", log_path=args.results_dir / "demo-server.log")
    console.print(f"[bold]kvstorm demo[/]: starting `kvstorm serve {' '.join(DEMO_SERVER_ARGS)}` on {base_url} ...")
    ready_s = server.start()
    console.print(f"engine ready in {ready_s:.1f} s; running the experiment '{DEMO_EXPERIMENT}' (about two minutes)")
    try:
        run = run_experiment_file(
            resolve_experiment(DEMO_EXPERIMENT), {"target_url": base_url, "model": "smollm2-135m"}, args.results_dir
        )
    finally:
        server.stop()
    _print_where(run.results_dir)
    return run.verdict.exit_code


def _print_where(results_dir: Path) -> None:
    report = results_dir / "report.html"
    where = f"report: {report}" if report.exists() else "no report (the load did not run)"
    print(f"{where}\nverdict: {results_dir / 'verdict.md'}, journal: {results_dir / 'journal.json'}")


def _parse_var(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--var {item!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)  # numbers stay numbers, as they would in the experiment file
