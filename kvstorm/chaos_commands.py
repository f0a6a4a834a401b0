"""``kvstorm chaos run|list`` (Chaos Toolkit experiments against any OpenAI-compatible server) and ``kvstorm demo``
(the main job: the bundled model under a burst with a VRAM cap, to a verdict)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

import uvicorn
import yaml
from rich.console import Console

from chaos.controller.app import ControllerConfig, create_app
from chaos.engine_admin import ADMIN_TOKEN_ENV
from chaos.processes import ManagedServer, free_port
from chaos.runner import EXPERIMENTS_DIR, resolve_experiment, run_experiment_file
from chaos.state import SLO_PROFILE_ENV
from dashboards.slo import PROFILES
from kvstorm.exposure import committed_token_refusal

CONTROLLER_TOKEN_ENV = "KVSTORM_CHAOS_TOKEN"
PROMETHEUS_URL_ENV = "KVSTORM_PROMETHEUS_URL"
PROMETHEUS_HELP = (
    f"a Prometheus that scrapes the target (${PROMETHEUS_URL_ENV}): each run's report links the SLO and engine "
    "dashboards over the run, drawn from it"
)
DEMO_EXPERIMENT = "burst-with-vram-cap"
# A KV pool a burst on this model fills: 88 blocks of 16 tokens (about 1,400 tokens, eight
# requests of the experiment's shapes), and the experiment's 30% cap leaves 26 blocks.
DEMO_SERVER_ARGS = ("--num-kv-blocks", "88", "--swap-space", "256MiB", "--preemption-mode", "auto")


def add_chaos_parser(subparsers: argparse._SubParsersAction) -> None:
    chaos = subparsers.add_parser("chaos", help="chaos experiments (Chaos Toolkit files) against a running server")
    chaos_subparsers = chaos.add_subparsers(dest="chaos", required=True)
    run = chaos_subparsers.add_parser(
        "run",
        help="run an experiment with live progress, then a verdict table and an HTML report",
        description="Runs a Chaos Toolkit experiment (a file, or a name from the library: `kvstorm chaos list`). "
        "Engine faults need the server's admin token in $" + ADMIN_TOKEN_ENV + ". Exit status 0: HELD (the method "
        "ran and every check was met before and after it); 1: NOT RUN (a check missed before the method, nothing "
        "was injected) or DEVIATED (missed after it); 2: the run itself failed, aborted or was interrupted, or the "
        "server cannot take the experiment (NOT APPLICABLE: engine faults without kvstorm's admin API).",
    )
    run.add_argument("experiment", help="a .yaml/.json file or a library name")
    run.add_argument("--target", default=None, help="the server's base URL (the experiment's target_url)")
    run.add_argument("--model", default=None, help="the model name the server expects")
    run.add_argument("--var", action="append", default=[], metavar="KEY=VALUE", help="any configuration value")
    run.add_argument("--results-dir", type=Path, default=Path("chaos-results"), help="where each run's folder goes")
    run.add_argument(
        "--slo-profile",
        choices=sorted(PROFILES),
        default=None,
        help=f"the dashboards' SLO spec the verdict reports and slo_* probes judge by (${SLO_PROFILE_ENV}, else cpu)",
    )
    run.add_argument("--slo-file", type=Path, default=None, help="YAML overrides: {slo: {threshold, objective}}")
    run.add_argument("--prometheus-url", default=os.environ.get(PROMETHEUS_URL_ENV), help=PROMETHEUS_HELP)
    run.add_argument(
        "--events",
        action="store_true",
        help="write the run's events to stdout as JSON lines (phases, activities, faults, load figures, each "
        "request's end, the verdict); the tables go to stderr either way",
    )
    run.set_defaults(handler=run_chaos)
    listing = chaos_subparsers.add_parser("list", help="the library of experiments, with what each reproduces")
    listing.set_defaults(handler=list_experiments)
    serve = chaos_subparsers.add_parser(
        "serve",
        help="the chaos controller: an HTTP API (FastAPI) that runs experiments and faults against one target",
        description="Tokens come from the flags or the environment, never from a URL; neither is logged. Bound "
        "beyond loopback, it refuses to start with a token committed in kvstorm.env.",
    )
    serve.add_argument("--target", required=True, help="the engine's base URL")
    serve.add_argument("--model", default="smollm2-135m", help="the model name the engine serves")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default: loopback only; beyond it, a token committed in kvstorm.env is refused)",
    )
    serve.add_argument("--port", type=int, default=8090)
    serve.add_argument(
        "--token",
        default=os.environ.get(CONTROLLER_TOKEN_ENV),
        help=f"the controller's bearer token (${CONTROLLER_TOKEN_ENV})",
    )
    serve.add_argument(
        "--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV), help=f"the engine's admin token (${ADMIN_TOKEN_ENV})"
    )
    serve.add_argument("--results-dir", type=Path, default=Path("chaos-results/controller"))
    serve.add_argument("--max-run-s", type=float, default=1800.0, help="a run that lasts longer is stopped")
    serve.add_argument("--lease-s", type=float, default=30.0, help="the engine clears unrenewed faults after this")
    serve.add_argument("--prometheus-url", default=os.environ.get(PROMETHEUS_URL_ENV), help=PROMETHEUS_HELP)
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where a run's files (workload jsonl:path=, arrival trace:path=) resolve; without it they are refused",
    )
    serve.add_argument(
        "--server-command",
        default=None,
        help="the command kill-and-restart starts, kills and restarts the target with (it must serve at --target); "
        "without it that experiment is refused. Never taken from a request",
    )
    serve.set_defaults(handler=run_controller)


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
    on_event = _print_event if args.events else None
    run = run_experiment_file(
        resolve_experiment(args.experiment),
        variables,
        args.results_dir,
        on_event=on_event,
        slo_profile=args.slo_profile,
        slo_file=args.slo_file,
        prometheus_url=args.prometheus_url,
    )
    _print_where(run.results_dir)
    return run.verdict.exit_code


def _print_event(event: dict) -> None:
    sys.stdout.write(json.dumps(event, default=str) + "\n")
    sys.stdout.flush()


def list_experiments(_: argparse.Namespace) -> int:
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        experiment = yaml.safe_load(path.read_text())
        print(f"{path.stem}: {experiment['title']}\n    {' '.join(experiment['description'].split())}\n")
    return 0


def run_controller(args: argparse.Namespace) -> int:
    # A committed token never guards a port reachable beyond the machine (kvstorm/exposure.py).
    refusal = committed_token_refusal("kvstorm chaos serve", args.host, args.token, "--token", CONTROLLER_TOKEN_ENV)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    config = ControllerConfig(
        target_url=args.target.rstrip("/"),
        model=args.model,
        admin_token=args.admin_token or "",
        controller_token=args.token or "",
        results_dir=args.results_dir,
        max_run_s=args.max_run_s,
        lease_s=args.lease_s,
        prometheus_url=args.prometheus_url,
        data_dir=args.data_dir,
        server_command=args.server_command,
    )
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="info")
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
    where = f"report: {report}" if report.exists() else "no report (it could not be written)"
    print(f"{where}\nverdict: {results_dir / 'verdict.md'}, journal: {results_dir / 'journal.json'}", file=sys.stderr)


def _parse_var(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--var {item!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)  # numbers stay numbers, as they would in the experiment file
