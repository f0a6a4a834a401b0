"""One run's results as one JSON file: configuration, summary, every request record, fault windows and the server's
Prometheus series. Reading a file back validates it, so the report can be re-rendered from any saved run."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from loadgen.analysis import Summary
from loadgen.records import RequestRecord


class FaultWindow(BaseModel):
    """A fault that was active during the run, in wall-clock seconds."""

    name: str
    start_unix: float
    end_unix: float


class PromSeries(BaseModel):
    """One Prometheus range query over the run: ``points`` are (unix seconds, value)."""

    name: str
    query: str
    points: list[tuple[float, float]]


# The most processes one run may be sent from (a bound on an operator's typo, not a measured limit).
MAX_WORKERS = 256
# The most times a refused request may be sent again (OpenAI's Python SDK sends it twice more by default).
MAX_RETRIES = 10


class RunConfig(BaseModel):
    base_url: str
    model: str
    arrival: str
    workload: str
    input_len: str
    output_len: str
    num_requests: int | None
    duration_s: float | None
    max_concurrency: int | None
    request_timeout_s: float
    stall_timeout_s: float
    exact_output: bool
    seed: int
    slo: str | None
    # Processes the sending was shared by (loadgen.workers).
    workers: int = Field(1, ge=1, le=MAX_WORKERS)
    # Times a refused request (429, 503) was sent again after its Retry-After, at most (loadgen.client).
    retries: int = Field(0, ge=0, le=MAX_RETRIES)


class RunResult(BaseModel):
    """``start_unix`` and ``start_ts`` (perf_counter) are the same instant: the zero of every record's offsets."""

    run_id: str
    start_unix: float
    start_ts: float
    config: RunConfig
    summary: Summary
    advisories: list[str] = []
    records: list[RequestRecord]
    fault_windows: list[FaultWindow] = []
    prometheus: list[PromSeries] = []
    # Why the run stopped before its end (interrupted, a load worker lost); None for a run that ran to its end.
    cut_short: str | None = None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> RunResult:
        return cls.model_validate_json(path.read_text())


def read_fault_windows(path: Path) -> list[FaultWindow]:
    """A JSON list of ``{"name", "start_unix", "end_unix"}`` objects."""
    return [FaultWindow.model_validate(item) for item in json.loads(path.read_text())]


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write in full; it becomes ``path`` (``os.replace``) only when the block
    ends without an error, so a reader sees the old file or the whole new one, never a partial one. On an error the
    temporary file goes and ``path`` is left as it was."""
    # The same directory: os.replace is atomic only within one file system. A fresh name the caller creates
    # (not mkstemp's 0600 file), so the result gets the usual permissions.
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """``path.write_text(text)``, atomically (``replacing``)."""
    with replacing(path) as temporary:
        temporary.write_text(text)
