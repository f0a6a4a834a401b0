"""The admission options of ``kvstorm serve``, which ``kvstorm simulate run`` takes too (the same limits, the same
defaults): a simulated engine admits as the server it stands for."""

from __future__ import annotations

import argparse

from engine.core.admission import AdmissionLimits
from loadgen.spec import parse_duration

# Admission's default TTFT objective: twice the bundled CPU profile's TTFT SLO (5 s), and about as long as
# a person waits for a first word before giving up; see README ("Admission control").
DEFAULT_TTFT_SLO_S = 10.0


def add_admission_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The admission limits' options, in a group of their own (returned: ``kvstorm serve`` adds its back-pressure)."""
    admission = parser.add_argument_group("admission (a 429 with Retry-After before a request starts)")
    admission.add_argument(
        "--ttft-slo",
        type=objective,
        default=DEFAULT_TTFT_SLO_S,
        help="admit a request only if its first token is predicted within this (e.g. 5s, 800ms; 'off' admits all; "
        f"default {DEFAULT_TTFT_SLO_S:g}s, see README)",
    )
    admission.add_argument(
        "--tpot-slo",
        type=objective,
        default=None,
        help="admit a request only if the time per output token is predicted within this (e.g. 200ms; default off)",
    )
    admission.add_argument("--max-waiting", type=int, default=None, help="hard limit: 429 when this many requests wait")
    admission.add_argument(
        "--max-queue-delay",
        type=float,
        default=None,
        help="hard limit: 429 when the predicted time before a request's first step exceeds this (s)",
    )
    return admission


def admission_limits(args: argparse.Namespace, **others: object) -> AdmissionLimits:
    """The limits ``add_admission_arguments`` parsed, with ``others`` (AdmissionLimits' other fields)."""
    return AdmissionLimits(
        ttft_slo_s=args.ttft_slo,
        tpot_slo_s=args.tpot_slo,
        max_waiting=args.max_waiting,
        max_queue_delay_s=args.max_queue_delay,
        **others,
    )


def objective(text: str) -> float | None:
    """A duration ('5s', '800ms', '2.5'), or 'off' for none."""
    if text.strip().lower() in ("off", "none", "0"):
        return None
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def describe_admission(limits: AdmissionLimits) -> str:
    rules = [
        f"{name} {value:g} s"
        for name, value in (
            ("TTFT objective", limits.ttft_slo_s),
            ("TPOT objective", limits.tpot_slo_s),
            ("queue time at most", limits.max_queue_delay_s),
        )
        if value is not None
    ]
    if limits.max_waiting is not None:
        rules.append(f"at most {limits.max_waiting} waiting")
    if not rules:
        return "off: every request that fits is admitted"
    batch = (
        ""
        if limits.ttft_slo_s is None
        else "; an offline batch sent all at once is mostly refused: start with --ttft-slo off to queue it all"
    )
    return f"on: a request that would miss these is refused with 429 and Retry-After ({', '.join(rules)}){batch}"
