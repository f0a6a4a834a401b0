"""``kvstorm chaos run|compare|list|serve`` (Chaos Toolkit experiments against any OpenAI-compatible server) and
``kvstorm demo`` (the main job: the bundled model under a burst with a VRAM cap, without kvstorm's defences and with
them, to two verdicts in one report)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn
import yaml
from rich.console import Console

from chaos.controller.app import ControllerConfig, create_app
from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.judgement.compare import Target, compare, parse_server, parse_target
from chaos.judgement.verdict_view import STATUS_WORDS
from chaos.run.runner import EXPERIMENTS_DIR, resolve_experiment, run_experiment_file
from chaos.run.state import SLO_PROFILE_ENV
from chaos.target_check import TargetCheck, check_target, measured_slo, write_check
from chaos.target_check import __doc__ as CHECK_DOC
from dashboards.slo import PROFILES
from kvstorm.exposure import committed_token_refusal
from loadgen.served_model import NoServedModel, served_model

CONTROLLER_TOKEN_ENV = "KVSTORM_CHAOS_TOKEN"
PROMETHEUS_URL_ENV = "KVSTORM_PROMETHEUS_URL"
PROMETHEUS_HELP = (
    f"a Prometheus that scrapes the target (${PROMETHEUS_URL_ENV}): each run's report links the SLO and engine "
    "dashboards over the run, drawn from it"
)
DEMO_EXPERIMENT = "burst-with-vram-cap"
# The calm requests `kvstorm chaos check` may send, one at a time.
MAX_CALM_REQUESTS = 100
# A KV pool a burst on this model fills: 88 blocks of 16 tokens (about 1,400 tokens, eight
# requests of the experiment's shapes), and the experiment's 30% cap leaves 26 blocks.
DEMO_POOL = ("--num-kv-blocks", "88", "--swap-space", "256MiB")
# The burst three times, on fresh servers: without kvstorm's defences (preemption by recompute only, every request
# admitted whatever its predicted first-token time); with its defaults (auto preemption, swapping where that is
# cheaper; admission when the first token is predicted within 10 s); and with the admission objective set to the TTFT
# SLO the experiment judges by (the cpu profile's 5 s), as the README tells an operator to. The first and the last
# tell the story; the middle one shows what the 10 s default does against a 5 s SLO.
DEMO_TARGETS = (
    Target("undefended", server_args=(*DEMO_POOL, "--preemption-mode", "recompute", "--ttft-slo", "off")),
    Target("defaults", server_args=DEMO_POOL),
    Target("defaults-ttft-slo-5s", server_args=(*DEMO_POOL, "--ttft-slo", "5s")),
)
# The library's load (a 10 s burst at 1.5 requests/s, the cap from 8 s) leaves this engine idle on a 2-core CPU in
# bfloat16: every configuration holds. The demo sends a burst the capped pool cannot serve in time: 1 request/s, and
# 20/s from 10 s to 15 s, while the cap is on from 5 s to 35 s: requests/s, the same storm for each configuration,
# not multiples of a capacity each measures first.
DEMO_VARS: dict[str, object] = {
    "rate_unit": "req/s",
    "arrival": "steps:rates=1/1/20/1,step_s=5",
    "cap_after_s": 5,
    "cap_for_s": 30,
}


# The experiments' model, as their configuration reads it from the environment.
MODEL_ENV = "KVSTORM_MODEL"


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
    run.add_argument(
        "--model",
        default=None,
        help=f"the model name the server expects (default: ${MODEL_ENV}, else with --target the first of the "
        "target's /v1/models)",
    )
    run.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any configuration value, read as YAML as in the file (where 1e-05 is a string: write 1.0e-05)",
    )
    run.add_argument(
        "--var-json",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="any configuration value as JSON, typed as written (the controller passes its overrides so)",
    )
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
    _add_compare_parser(chaos_subparsers)
    listing = chaos_subparsers.add_parser("list", help="the library of experiments, with what each reproduces")
    listing.set_defaults(handler=list_experiments)
    _add_check_parser(chaos_subparsers)
    _add_controller_parser(chaos_subparsers)


def _add_check_parser(chaos_subparsers: argparse._SubParsersAction) -> None:
    check = chaos_subparsers.add_parser(
        "check",
        help="look at a server before anything is sent: what it exports, whether kvstorm's faults answer, which "
        "experiments apply, and an SLO profile sized from a few calm requests",
        description=CHECK_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("--target", required=True, help="the server's base URL")
    check.add_argument("--model", default=None, help="the model name (default: the first in its /v1/models)")
    check.add_argument(
        "--faults-url",
        default=None,
        help="where kvstorm's fault contract answers, if not at the target (kvstorm's plugin in a vLLM); the "
        f"admin token comes from ${ADMIN_TOKEN_ENV}",
    )
    check.add_argument(
        "--calm-requests", type=int, default=5, help="calm requests to size the SLO profile from (0: none)"
    )
    check.add_argument("--results-dir", type=Path, default=Path("chaos-results"), help="the profile goes to targets/")
    check.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace) -> int:
    """Exit 0 with the check printed and written; 2 when the target does not answer as an OpenAI-compatible server."""
    experiments = {path.stem: yaml.safe_load(path.read_text()) for path in sorted(EXPERIMENTS_DIR.glob("*.yaml"))}
    if not 0 <= args.calm_requests <= MAX_CALM_REQUESTS:
        print(f"kvstorm chaos check: --calm-requests must be in 0-{MAX_CALM_REQUESTS}", file=sys.stderr)
        return 2
    try:
        check = check_target(
            args.target,
            args.model,
            experiments,
            faults_url=args.faults_url,
            admin_token=os.environ.get(ADMIN_TOKEN_ENV),
            calm_requests=args.calm_requests,
        )
    except RuntimeError as error:
        print(f"kvstorm chaos check: {error}", file=sys.stderr)
        return 2
    path = write_check(check, args.results_dir)
    print(check_markdown(check, path))
    return 0


def check_markdown(check: TargetCheck, path: Path) -> str:
    facts = check.facts
    lines = [f"## {facts.target_url}, model `{facts.model}`", "", "| exports | |", "|---|---|"]
    lines += [f"| {what} | {'yes' if present else 'no'} |" for what, present in facts.exports.items()]
    kv = "unknown" if facts.kv_tokens is None else f"{facts.kv_tokens:,} tokens"
    lines += ["", f"KV cache: {kv}. Faults ({facts.faults.url}): {facts.faults.description}.", ""]
    lines += ["| experiment | applies |", "|---|---|"]
    lines += [f"| {name} | {'yes' if why is None else 'no: ' + why} |" for name, why in check.applicability.items()]
    if check.calm is not None:
        calm, thresholds = check.calm, {name: value["threshold"] for name, value in check.slo_overrides.items()}
        lines += [
            "",
            f"Calm ({calm.num_requests} requests one at a time, 128 prompt and 64 output tokens): TTFT p50 "
            f"{calm.ttft_p50_s * 1e3:.0f} ms (max {calm.ttft_max_s * 1e3:.0f}), TPOT p50 {calm.tpot_p50_s * 1e3:.1f} "
            f"ms, E2E p50 {calm.e2e_p50_s:.2f} s. SLO profile sized from it: TTFT {thresholds['ttft']:g} s, ITL "
            f"{thresholds['itl']:g} s, E2E {thresholds['e2e']:g} s, the {check.base_profile} profile's guardrails; "
            f"`kvstorm chaos run ... --target {facts.target_url}` judges by it unless --slo-profile or --slo-file "
            "names another.",
        ]
    lines += ["", f"Written: {path}"]
    return "\n".join(lines)


def _add_controller_parser(chaos_subparsers: argparse._SubParsersAction) -> None:
    serve = chaos_subparsers.add_parser(
        "serve",
        help="the chaos controller: an HTTP API (FastAPI) that runs experiments and faults against one target",
        description="Tokens come from the flags or the environment, never from a URL; neither is logged. Bound "
        "beyond loopback, it refuses to start with a token committed in kvstorm.env.",
    )
    serve.add_argument("--target", required=True, help="the engine's base URL")
    serve.add_argument(
        "--model", default=None, help="the model name the engine serves (default: the first in its /v1/models)"
    )
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
    restart = serve.add_mutually_exclusive_group()
    restart.add_argument(
        "--server-command",
        default=None,
        help="the command kill-and-restart starts, kills and restarts the target with (it must serve at --target); "
        "without it or --supervised-target that experiment is refused. Never taken from a request",
    )
    restart.add_argument(
        "--supervised-target",
        action="store_true",
        help="the target's supervisor restarts it (compose's restart policy, systemd): kill-and-restart asks it to "
        "exit through its admin API (kvstorm serve --admin-exit) and times its return to ready",
    )
    serve.set_defaults(handler=run_controller)


def _add_compare_parser(chaos_subparsers: argparse._SubParsersAction) -> None:
    compare_parser = chaos_subparsers.add_parser(
        "compare",
        help="one experiment against several servers or kvstorm configurations, identical load, one side-by-side table",
        description="Runs the experiment against each target in the order given, one after the other, with the same "
        "configuration (the same seed: identical arrivals, prompts and lengths); then one side-by-side table "
        "(printed, and compare.md) and one report.html with every target's timeline stacked on one time axis, "
        "each run's own folder beside them. Engine faults need the admin token in $" + ADMIN_TOKEN_ENV + " (a "
        "random one is set for started servers when it is unset). Exit status: the worst of the runs' (0 only "
        "when every target HELD).",
    )
    compare_parser.add_argument("experiment", help="a .yaml/.json file or a library name")
    compare_parser.add_argument(
        "--target",
        dest="targets",
        action="append",
        type=_typed(parse_target),
        default=[],
        metavar="NAME=URL",
        help="a server someone else runs (kvstorm, vLLM, ...)",
    )
    compare_parser.add_argument(
        "--server",
        dest="targets",
        action="append",
        type=_typed(parse_server),
        metavar="NAME='kvstorm serve ARGS'",
        help="a kvstorm started fresh for its run on a free loopback port, and stopped after it",
    )
    compare_parser.add_argument("--model", default=None, help="the model name every target expects")
    compare_parser.add_argument(
        "--var", action="append", default=[], metavar="KEY=VALUE", help="any configuration value"
    )
    compare_parser.add_argument("--results-dir", type=Path, default=Path("chaos-results"))
    compare_parser.add_argument(
        "--slo-profile", choices=sorted(PROFILES), default=None, help="as for kvstorm chaos run, for every target"
    )
    compare_parser.add_argument("--slo-file", type=Path, default=None, help="as for kvstorm chaos run")
    compare_parser.set_defaults(handler=run_compare)


def _typed(parse: Callable[[str], Target]) -> Callable[[str], Target]:
    """``parse`` as an argparse type: its ValueError becomes the usage error it names."""

    def parse_argument(value: str) -> Target:
        try:
            return parse(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    return parse_argument


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="the bundled model under 'burst with a VRAM cap', without kvstorm's defences and with them, one report",
    )
    demo.add_argument("--results-dir", type=Path, default=Path("chaos-results"))
    demo.set_defaults(handler=run_demo)


def run_compare(args: argparse.Namespace) -> int:
    if len(args.targets) < 2:
        print(
            "kvstorm chaos compare: give two targets or more (--target NAME=URL, --server NAME=ARGS)", file=sys.stderr
        )
        return 2
    variables = dict(_parse_var(item) for item in args.var)
    if args.model:
        variables["model"] = args.model
    comparison = compare(
        resolve_experiment(args.experiment),
        args.targets,
        variables,
        args.results_dir,
        slo_profile=args.slo_profile,
        slo_file=args.slo_file,
    )
    print(
        f"comparison: {comparison.results_dir / 'report.html'}, {comparison.results_dir / 'compare.md'}",
        file=sys.stderr,
    )
    return comparison.exit_code


def run_chaos(args: argparse.Namespace) -> int:
    variables = chaos_run_variables(args)
    if args.target:
        variables["target_url"] = args.target
    if args.model:
        variables["model"] = args.model
    elif args.target and "model" not in variables and not os.environ.get(MODEL_ENV):
        # The experiments' default model is the bundled engine's name: another server would answer 404 to each request.
        try:
            variables["model"] = served_model(args.target)
        except NoServedModel as error:
            print(f"kvstorm chaos run: the target did not say which model it serves ({error}): give --model",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(f"model: {variables['model']} (the first of {args.target}'s /v1/models)", file=sys.stderr)
    on_event = _print_event if args.events else None
    slo_profile, slo_file = args.slo_profile, args.slo_file
    measured = None if slo_profile or slo_file or os.environ.get(SLO_PROFILE_ENV) or not args.target else (
        measured_slo(args.results_dir, args.target)
    )  # fmt: skip
    if measured is not None:
        slo_profile, slo_file = measured
        print(f"SLO profile: sized by `kvstorm chaos check` of {args.target} ({slo_file})", file=sys.stderr)
    run = run_experiment_file(
        resolve_experiment(args.experiment),
        variables,
        args.results_dir,
        on_event=on_event,
        slo_profile=slo_profile,
        slo_file=slo_file,
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
        supervised_target=args.supervised_target,
    )
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="info")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """The burst against each of ``DEMO_TARGETS`` in one comparison. Exit 0 when the story was shown: the defended
    configuration (the last) HELD and the undefended one (the first) did not; 1 when it was not; 2 when a run itself
    failed."""
    console = Console(stderr=True)
    os.environ[ADMIN_TOKEN_ENV] = secrets.token_urlsafe(16)  # the servers read it at start, the experiment's actions
    changed = ", ".join(f"{key}={value}" for key, value in DEMO_VARS.items())
    console.print(
        f"[bold]kvstorm demo[/]: '{DEMO_EXPERIMENT}' against {len(DEMO_TARGETS)} fresh servers in turn, about a "
        f"minute each; the library's load leaves this engine idle, so the demo's is heavier: {changed} (a 5 s burst "
        "at 20 requests/s, 10 s into the load, while the cap is on from 5 s to 35 s)",
        highlight=False,
    )
    comparison = compare(resolve_experiment(DEMO_EXPERIMENT), DEMO_TARGETS, DEMO_VARS, args.results_dir, console)
    print(f"report: {comparison.results_dir / 'report.html'}", file=sys.stderr)
    if comparison.exit_code == 2:
        print("the story was not shown: a run itself did not go through (see its verdict above)", file=sys.stderr)
        return 2
    undefended, defended = comparison.runs[0], comparison.runs[-1]
    if defended.run.verdict.held and not undefended.run.verdict.held:
        print(
            f"the story was shown: {undefended.target.name} did not hold the steady state, {defended.target.name} "
            "held it",
            file=sys.stderr,
        )
        return 0
    wrong = [
        f"{run.target.name} was {STATUS_WORDS[run.run.verdict.status]}, expected {expected}"
        for run, expected, ok in (
            (undefended, "not HELD", not undefended.run.verdict.held),
            (defended, "HELD", defended.run.verdict.held),
        )
        if not ok
    ]
    print(f"the story was not shown: {'; '.join(wrong)}", file=sys.stderr)
    return 1


def _print_where(results_dir: Path) -> None:
    report = results_dir / "report.html"
    where = f"report: {report}" if report.exists() else "no report (it could not be written)"
    print(f"{where}\nverdict: {results_dir / 'verdict.md'}, journal: {results_dir / 'journal.json'}", file=sys.stderr)


def chaos_run_variables(args: argparse.Namespace) -> dict[str, object]:
    """``kvstorm chaos run``'s ``--var`` values (YAML) and ``--var-json`` values (JSON, never re-read as YAML)."""
    variables = dict(_parse_var(item) for item in args.var)
    variables.update(_parse_var_json(item) for item in args.var_json)
    return variables


def _parse_var(item: str) -> tuple[str, object]:
    key, value = _split_var("--var", item)
    return key, yaml.safe_load(value)  # numbers stay numbers, as they would in the experiment file


def _parse_var_json(item: str) -> tuple[str, object]:
    key, value = _split_var("--var-json", item)
    try:
        return key, json.loads(value)
    except ValueError:
        raise ValueError(f"--var-json {item!r}: the value is not JSON") from None


def _split_var(flag: str, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
    return key, value
