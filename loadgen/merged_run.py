"""One run's results from the records of several senders: the shards of one seeded open-loop plan, each sent by a
Locust worker (``OpenLoopUser`` in ``loadgen/locustfile.py``), possibly on another host.

Every shard measures its own requests on its own clock (a token's time minus its request's send time: both taken by
one process), so TTFT, ITL and E2E need no shared clock. Send times are offsets from the run's zero, which the master
set in wall-clock time and each worker turned into its own monotonic clock when it heard of it: across hosts, they
are as good as the hosts' clock agreement (NTP: typically within a millisecond or a few).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loadgen.analysis import advisories, summarize
from loadgen.records import RequestRecord
from loadgen.results import RunConfig, RunResult


def merged_result(
    config: RunConfig,
    run_id: str,
    start_unix: float,
    shards: Mapping[int, Sequence[dict[str, Any]]],
    num_shards: int,
    errors: Sequence[str] = (),
) -> RunResult:
    """``shards``: each reporting shard's records (as ``RequestRecord.model_dump`` gives them), by shard index;
    ``errors``: requests that raised instead of ending in a record."""
    records = sorted(
        (RequestRecord.model_validate(record) for shard in shards.values() for record in shard), key=lambda r: r.index
    )
    duration_s = max((record.end_s for record in records), default=0.0) or 1e-9
    summary = summarize(records, duration_s)
    notes = [
        f"Sent from {num_shards} Locust workers, each its shard of one seeded open-loop plan; latencies are each "
        "worker's own, send times are offsets from a zero set in wall-clock time (across hosts, as close as their "
        "clocks agree)."
    ]
    missing = sorted(set(range(num_shards)) - set(shards))
    if missing:
        notes.append(
            f"Incomplete: shards {', '.join(map(str, missing))} of {num_shards} sent no records (their worker "
            "stopped or left before its shard ended); their requests are missing from every number here."
        )
    if errors:
        notes.append(
            f"Lost: {len(errors)} requests raised in their worker instead of ending in a record (first: "
            f"{errors[0]}); they are missing from every number here."
        )
    notes += advisories(summary, records, exact_output=config.exact_output, max_concurrency=None)
    return RunResult(
        run_id=run_id,
        start_unix=start_unix,
        start_ts=0.0,
        config=config,
        summary=summary,
        advisories=notes,
        records=records,
    )
