"""Real request traces replayed as arrivals: ``--arrival trace:path=FILE[,format=..][,speedup=..][,start_s=..]
[,duration_s=..][,length_scale=..][,max_len=..]``.

Formats (``format=auto`` tells them apart by their columns):

- ``kvstorm``: JSONL or CSV with ``timestamp`` (seconds), ``prompt_len``, ``output_len``;
- ``mooncake``: Mooncake's JSONL (FAST'25): ``timestamp`` (ms from the start), ``input_length``, ``output_length``,
  ``hash_ids`` (one id per 512-token block; equal ids are the same prefix block). The ids reach the server: with a
  token-id workload each id becomes its own block of tokens, the same wherever the id recurs, so the prefix
  structure of the trace is what a prefix cache sees;
- ``azure``: the Azure LLM inference trace's CSV (2023): ``TIMESTAMP`` (wall clock), ``ContextTokens``,
  ``GeneratedTokens``;
- ``burstgpt``: BurstGPT's CSV: ``Timestamp`` (seconds), ``Request tokens``, ``Response tokens``; a row with no
  response tokens is a failed request in the trace: it is skipped, and counted.

The window (``start_s``, ``duration_s``: seconds of the trace's own time) is cut first, then its time divided by
``speedup``; lengths (and Mooncake's blocks) are multiplied by ``length_scale`` and rounded (at least 1), then a
request longer than ``max_len`` tokens (prompt + output) has its prompt, then its output, clipped to fit. A
``length_scale`` other than 1 needs a ``max_len``. Every one of these is said in the run's results
(``TraceReplay.description``), never applied silently.
"""

from __future__ import annotations

import csv
import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from loadgen.spec import parse_spec

TRACE_FORMATS = ("auto", "kvstorm", "mooncake", "azure", "burstgpt")
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: seconds of the trace's time, lengths in tokens, Mooncake's prefix-block ids."""

    timestamp_s: float
    prompt_len: int
    output_len: int
    block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TraceRequest:
    """One request as the run sends it: offset from the run's start, lengths after scaling and clipping, and (for
    Mooncake) the prompt's blocks, each ``block_len`` tokens."""

    offset_s: float
    prompt_len: int
    output_len: int
    block_ids: tuple[int, ...] = ()
    block_len: int = 0


@dataclass(frozen=True)
class TraceReplay:
    requests: list[TraceRequest]
    description: str


KEYS = {"path", "format", "speedup", "start_s", "duration_s", "length_scale", "max_len"}


def replay(spec_text: str) -> TraceReplay:
    """The trace's requests in the window, scaled and clipped, and what was done to them in words (cached while the
    file is unchanged: the schedule and the results' notes read it once)."""
    path = Path(parse_spec(spec_text, {"trace"}).get_str("path"))
    return _replay(spec_text, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _replay(spec_text: str, modified_ns: int) -> TraceReplay:
    spec = parse_spec(spec_text, {"trace"})
    spec.check_keys(KEYS)
    path = Path(spec.get_str("path"))
    trace_format = spec.get_str("format", "auto")
    if trace_format not in TRACE_FORMATS:
        raise ValueError(f"{spec_text!r}: format={trace_format!r}: expected one of {TRACE_FORMATS}")
    rows, num_failed, trace_format = _read(path, trace_format)
    speedup = spec.get_float("speedup", 1.0, minimum=1e-9)
    start_s = spec.get_float("start_s", 0.0, minimum=0.0)
    duration_s = spec.get_float("duration_s", float("inf"), minimum=1e-9)
    scale = spec.get_float("length_scale", 1.0, minimum=1e-6)
    max_len = spec.get_int("max_len", 0, minimum=0) or None
    if scale != 1 and max_len is None:
        # A scale makes lengths the trace never had (x100 of a 30,000-token prompt): the run says what it allows.
        raise ValueError(f"{spec_text!r}: length_scale={scale:g} needs max_len=N (the longest prompt + output to send)")
    first = rows[0].timestamp_s
    window = [row for row in rows if start_s <= row.timestamp_s - first < start_s + duration_s]
    if not window:
        raise ValueError(f"trace {path}: no request in the window [{start_s:g}, {start_s + duration_s:g}) s")
    block_len = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    requests, num_clipped = [], 0
    for row in window:
        prompt_len, output_len = _scaled(row.prompt_len, scale), _scaled(row.output_len, scale)
        if max_len is not None and prompt_len + output_len > max_len:
            num_clipped += 1
            output_len = min(output_len, max_len - 1)
            prompt_len = max_len - output_len
        offset_s = (row.timestamp_s - first - start_s) / speedup
        blocks = row.block_ids[: -(-prompt_len // block_len)]
        requests.append(TraceRequest(offset_s, prompt_len, output_len, blocks, block_len if blocks else 0))
    words = [
        f"Trace {path.name} ({trace_format}): {len(requests)} of its {len(rows)} requests"
        + (f" ({num_failed} failed rows skipped)" if num_failed else ""),
        f"window {start_s:g} s + {duration_s:g} s of its time" if (start_s or duration_s != float("inf")) else "",
        f"replayed {speedup:g}x as fast" if speedup != 1 else "at its own pace",
        f"lengths scaled by {scale:g}"
        + (f" (prefix blocks of {block_len} tokens)" if trace_format == "mooncake" else "")
        if scale != 1
        else "",
        f"{num_clipped} requests clipped to {max_len} tokens (prompt + output)" if num_clipped else "",
    ]
    return TraceReplay(requests, ", ".join(word for word in words if word) + ".")


def _scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def _read(path: Path, trace_format: str) -> tuple[list[TraceRow], int, str]:
    """Rows sorted by time, the failed rows skipped, and the format (``auto`` resolved)."""
    with path.open(newline="") as file:
        if path.suffix == ".csv":
            records: list[dict[str, Any]] = list(csv.DictReader(file))
        else:
            records = [json.loads(line) for line in file if line.strip()]
    if not records:
        raise ValueError(f"trace {path} has no requests")
    if trace_format == "auto":
        trace_format = _detect(path, records[0])
    parse = {"kvstorm": _kvstorm_row, "mooncake": _mooncake_row, "azure": _azure_row, "burstgpt": _burstgpt_row}
    try:
        parsed = [parse[trace_format](record) for record in records]
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(
            f"trace {path} ({trace_format}): a row does not read: {type(error).__name__}: {error}"
        ) from None
    rows = sorted((row for row in parsed if row is not None), key=lambda row: row.timestamp_s)
    if not rows:
        raise ValueError(f"trace {path}: every row is a failed request")
    return rows, len(parsed) - len(rows), trace_format


def _detect(path: Path, record: dict[str, Any]) -> str:
    for trace_format, column in (
        ("mooncake", "hash_ids"),
        ("azure", "ContextTokens"),
        ("burstgpt", "Request tokens"),
        ("kvstorm", "prompt_len"),
    ):
        if column in record:
            return trace_format
    raise ValueError(f"trace {path}: columns {sorted(record)} are none of the formats {TRACE_FORMATS[1:]}")


def _kvstorm_row(record: dict[str, Any]) -> TraceRow:
    return TraceRow(float(record["timestamp"]), int(record["prompt_len"]), int(record["output_len"]))


def _mooncake_row(record: dict[str, Any]) -> TraceRow:
    block_ids = tuple(int(block_id) for block_id in record["hash_ids"])
    return TraceRow(
        float(record["timestamp"]) / 1000, int(record["input_length"]), int(record["output_length"]), block_ids
    )


def _azure_row(record: dict[str, Any]) -> TraceRow:
    timestamp = datetime.fromisoformat(record["TIMESTAMP"]).timestamp()
    return TraceRow(timestamp, int(record["ContextTokens"]), int(record["GeneratedTokens"]))


def _burstgpt_row(record: dict[str, Any]) -> TraceRow | None:
    output_len = int(float(record["Response tokens"]))
    if output_len == 0:
        return None
    return TraceRow(float(record["Timestamp"]), int(float(record["Request tokens"])), output_len)
