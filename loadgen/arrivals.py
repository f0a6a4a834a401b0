"""Arrival processes: when each request of a run leaves, as offsets in seconds from the start of the run.

Everything here is a pure function of the spec and a seeded RNG, so schedules are reproducible and testable without
sleeping. The runner sends request *i* at ``start + arrivals[i].offset_s`` whatever earlier requests are doing.

Specs (``--arrival``)::

    constant:rate=20                    evenly spaced, 20 requests/s
    poisson:rate=20                     exponential gaps
    gamma:rate=20,burstiness=0.5        gamma gaps; burstiness < 1 is burstier than Poisson, > 1 smoother
    onoff:base=2,burst=40,burst_s=5,period_s=30[,spacing=even]
                                        base rate, then burst rate for burst_s at the start of every period
    steps:rates=5/10/20,step_s=30[,spacing=even]
                                        each rate for step_s seconds, in order (the last one holds)
    trace:path=FILE[,format=auto|kvstorm|mooncake|azure|burstgpt][,speedup=2][,start_s=..,duration_s=..]
         [,length_scale=0.25][,max_len=2048]
                                        replay a real trace (loadgen.traces): kvstorm's own JSONL/CSV
                                        (timestamp, prompt_len, output_len), Mooncake's JSONL (its prefix
                                        blocks reach the server), the Azure 2023 CSV or BurstGPT's CSV; a window
                                        of it, faster or slower, lengths scaled or clipped, each said in the results
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loadgen.spec import Spec, parse_spec
from loadgen.traces import replay

ARRIVAL_KINDS = {"constant", "poisson", "gamma", "onoff", "steps", "trace"}


@dataclass(frozen=True)
class Arrival:
    """One scheduled request; a trace also fixes its prompt and output lengths (None: the workload decides), and a
    Mooncake trace its prompt's prefix blocks (each ``block_len`` tokens; equal ids are equal blocks)."""

    offset_s: float
    prompt_len: int | None = None
    output_len: int | None = None
    block_ids: tuple[int, ...] = ()
    block_len: int = 0


def make_arrivals(text: str, *, num_requests: int | None, duration_s: float | None, seed: int = 0) -> list[Arrival]:
    """The schedule for ``--arrival text``, cut at ``num_requests`` and/or ``duration_s`` (at least one is needed,
    except for a trace, which ends by itself)."""
    spec = parse_spec(text, ARRIVAL_KINDS)
    if spec.kind == "trace":
        arrivals = _trace(spec)
    else:
        rng = np.random.default_rng(seed)
        offsets = _offsets(spec, rng, num_requests, duration_s)
        arrivals = [Arrival(float(offset)) for offset in offsets]
    if duration_s is not None:
        arrivals = [arrival for arrival in arrivals if arrival.offset_s < duration_s]
    return arrivals[:num_requests] if num_requests is not None else arrivals


def expected_num_arrivals(text: str, *, num_requests: int | None, duration_s: float | None) -> float:
    """How many requests ``make_arrivals`` schedules, on average, worked out from the rates without drawing one (a
    run's size is known before its plan is built: ``loadgen.plan.estimate_plan_size``); a trace's are counted."""
    spec = parse_spec(text, ARRIVAL_KINDS)
    if spec.kind == "trace":
        return float(len(make_arrivals(text, num_requests=num_requests, duration_s=duration_s)))
    if spec.kind in ("constant", "poisson", "gamma"):
        spec.check_keys({"rate", "burstiness"} if spec.kind == "gamma" else {"rate"})
        rate = spec.get_float("rate", minimum=1e-9)
        pieces_and_repeat = [(rate, math.inf)], False
    else:
        pieces_and_repeat = _onoff_segments(spec) if spec.kind == "onoff" else _step_segments(spec)
    _check_bounded(spec, num_requests, duration_s)
    if duration_s is None:
        return float(num_requests)
    expected = _integrated_rate(*pieces_and_repeat, duration_s)
    if spec.kind == "constant":
        expected = math.ceil(expected)  # one at 0, then one every 1/rate
    elif spec.kind in ("poisson", "gamma"):
        expected += 1  # the first leaves at 0, the gaps follow it
    return expected if num_requests is None else min(expected, float(num_requests))


def _integrated_rate(pieces: list[tuple[float, float]], repeats: bool, duration_s: float) -> float:
    """The requests a piecewise-constant rate sends in ``duration_s``: whole periods at once, then the pieces of the
    last one (a loop per period would spin for a tiny period over an hour)."""
    total, start = 0.0, 0.0
    if repeats:
        period_s = sum(length_s for _, length_s in pieces)
        num_periods = math.floor(duration_s / period_s)
        total, start = num_periods * sum(rate * length_s for rate, length_s in pieces), num_periods * period_s
    for rate, length_s in pieces:
        if start >= duration_s:
            break
        total += rate * min(length_s, duration_s - start)
        start += length_s
    return total


# The keys of each kind that are rates (requests/s), which ``scale_rates`` multiplies.
_RATE_KEYS = {"constant": ("rate",), "poisson": ("rate",), "gamma": ("rate",), "onoff": ("base", "burst")}


def scale_rates(text: str, factor: float, max_rate: float = math.inf) -> str:
    """The arrival spec ``text`` with every rate multiplied by ``factor`` (a load written in multiples of a
    server's measured capacity, ``chaos.run.sizing``); durations and shapes stay as written. ``ValueError`` if a rate
    of ``text`` (before scaling) exceeds ``max_rate``."""
    spec = parse_spec(text, ARRIVAL_KINDS)
    if spec.kind == "trace":
        raise ValueError(f"{text!r}: a trace's rates are its own (use its speedup), they cannot be scaled")
    if not factor > 0:
        raise ValueError(f"cannot scale the rates of {text!r} by {factor}: the factor must be > 0")
    params = dict(spec.params)
    keys = ("rates",) if spec.kind == "steps" else _RATE_KEYS[spec.kind]
    for key in keys:
        rates = [float(rate) for rate in spec.get_str(key).split("/")]
        if max(rates) > max_rate:
            raise ValueError(f"{text!r}: {key} {max(rates):g} exceeds {max_rate:g}")
        params[key] = "/".join(f"{rate * factor:.4g}" for rate in rates)
    return f"{spec.kind}:" + ",".join(f"{key}={value}" for key, value in params.items())


def _offsets(spec: Spec, rng: np.random.Generator, num_requests: int | None, duration_s: float | None) -> np.ndarray:
    if spec.kind in ("constant", "poisson", "gamma"):
        spec.check_keys({"rate", "burstiness"} if spec.kind == "gamma" else {"rate"})
        rate = spec.get_float("rate", minimum=1e-9)
        _check_bounded(spec, num_requests, duration_s)
        if spec.kind == "constant":
            bound = int(np.ceil(rate * duration_s)) + 1 if duration_s is not None else num_requests
            return np.arange(min(bound, num_requests or bound)) / rate
        burstiness = spec.get_float("burstiness", 1.0, minimum=1e-9) if spec.kind == "gamma" else 1.0
        # Gamma gaps with shape k and mean 1/rate (as vLLM's benchmark draws them); k = 1 is Poisson.
        batch = num_requests or int(np.ceil(rate * duration_s)) + 16

        def draw_gaps() -> np.ndarray:
            return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=batch)

        return _renewal(draw_gaps, num_requests, duration_s)
    segments = _onoff_segments(spec) if spec.kind == "onoff" else _step_segments(spec)
    _check_bounded(spec, num_requests, duration_s)
    return _piecewise(segments, spec.get_str("spacing", "poisson"), rng, num_requests, duration_s)


def _renewal(draw_gaps: Callable[[], np.ndarray], num_requests: int | None, duration_s: float | None) -> np.ndarray:
    """Offsets 0, g1, g1 + g2, ... drawn in batches until either bound is reached (the first request leaves at 0,
    so runs of different processes line up)."""
    offsets = np.zeros(1)
    while not (
        (num_requests is not None and len(offsets) >= num_requests)
        or (duration_s is not None and offsets[-1] >= duration_s)
    ):
        offsets = np.concatenate([offsets, offsets[-1] + np.cumsum(draw_gaps())])
    return offsets


def _check_bounded(spec: Spec, num_requests: int | None, duration_s: float | None) -> None:
    if num_requests is None and duration_s is None:
        raise ValueError(f"{spec.text!r}: give --num-requests or --duration to bound the run")


def _onoff_segments(spec: Spec) -> tuple[list[tuple[float, float]], bool]:
    """(rate, length_s) pieces of one period; True: the pieces repeat."""
    spec.check_keys({"base", "burst", "burst_s", "period_s", "spacing"})
    base, burst = spec.get_float("base", minimum=0.0), spec.get_float("burst", minimum=0.0)
    burst_s, period_s = spec.get_float("burst_s", minimum=1e-9), spec.get_float("period_s", minimum=1e-9)
    if burst_s > period_s:
        raise ValueError(f"{spec.text!r}: burst_s={burst_s} is longer than period_s={period_s}")
    return [(burst, burst_s), (base, period_s - burst_s)], True


def _step_segments(spec: Spec) -> tuple[list[tuple[float, float]], bool]:
    spec.check_keys({"rates", "step_s", "spacing"})
    try:
        rates = [float(rate) for rate in spec.get_str("rates").split("/")]
    except ValueError:
        raise ValueError(f"{spec.text!r}: rates must be numbers separated by '/', e.g. rates=5/10/20") from None
    step_s = spec.get_float("step_s", minimum=1e-9)
    # The last rate holds until the run ends: a long final piece instead of a repeat.
    return [(rate, step_s) for rate in rates[:-1]] + [(rates[-1], float("inf"))], False


def _piecewise(
    pieces_and_repeat: tuple[list[tuple[float, float]], bool],
    spacing: str,
    rng: np.random.Generator,
    num_requests: int | None,
    duration_s: float | None,
) -> np.ndarray:
    """Arrivals of a piecewise-constant rate. Poisson restarts at each boundary (memoryless, so still exact);
    ``spacing=even`` spaces each piece's arrivals evenly from its start."""
    if spacing not in ("poisson", "even"):
        raise ValueError(f"spacing={spacing!r}: expected poisson or even")
    pieces, repeats = pieces_and_repeat
    if all(rate == 0 for rate, _ in pieces):
        raise ValueError("every rate is 0: no request would ever leave")
    offsets: list[float] = []
    piece_start = 0.0
    index = 0
    while (num_requests is None or len(offsets) < num_requests) and (duration_s is None or piece_start < duration_s):
        rate, length_s = pieces[index % len(pieces)]
        piece_end = piece_start + length_s
        if rate > 0:
            t = piece_start + (rng.exponential(1.0 / rate) if spacing == "poisson" else 0.0)
            num_in_piece = 0
            while t < piece_end and (num_requests is None or len(offsets) < num_requests):
                if duration_s is not None and t >= duration_s:
                    break
                offsets.append(t)
                num_in_piece += 1
                # Even spacing from the piece's start, not by accumulation: no float drift across a boundary.
                t = t + rng.exponential(1.0 / rate) if spacing == "poisson" else piece_start + num_in_piece / rate
        if piece_end == float("inf"):
            break
        piece_start = piece_end
        index += 1
        if not repeats and index >= len(pieces):
            break
    return np.asarray(offsets)


def _trace(spec: Spec) -> list[Arrival]:
    return [
        Arrival(r.offset_s, r.prompt_len, r.output_len, r.block_ids, r.block_len) for r in replay(spec.text).requests
    ]
