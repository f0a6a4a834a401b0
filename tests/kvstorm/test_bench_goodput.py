"""`kvstorm bench goodput` end to end on the bundled model, shortened: a fresh server per run, admission off and on,
the table, the server's prediction histogram read back, the Retry-After probe, and the HTML plot."""

from __future__ import annotations

import subprocess
import sys

from kernels.cpu_isa import cpu_kind
from kvstorm.bench.goodput import _bucket_quantile
from kvstorm.bench.peer import cpu_name


def test_the_goodput_benchmark_runs_both_admission_modes_and_sheds_only_with_admission(tmp_path):
    # 4x of 6 req/s is far above what the server serves here: with the compiled attention it kept up with 4x of 2.
    # The client gives up after 10 s: without admission a slow machine would otherwise drain the whole backlog. One
    # multiple: each row is a fresh server and a run (about 30 s on 2 cores), and one overload tells the two apart.
    command = [
        sys.executable, "-m", "kvstorm", "bench", "--no-docs", "goodput", "--capacity", "6", "--multiples", "4",
        "--duration", "5s", "--request-timeout", "10s", "--input-len", "fixed:128", "--output-len", "fixed:16",
        "--ttft-slo", "2s",
        "--warm-up", "0s", "--server-args", "--dtype float32 --kv-cache-memory 32MiB --swap-space 64MiB",
        "--results-dir", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {
        tuple(cells[:2]): cells
        for line in run.stdout.splitlines()
        if line.startswith(("| off", "| TTFT"))
        for cells in [[cell.strip() for cell in line.strip().strip("|").split("|")]]
    }
    assert set(rows) == {("off", "4x"), ("TTFT 2s", "4x")}
    ok, rejected, broken, _ = (int(n) for n in rows["off", "4x"][3].split("/"))
    assert rejected == 0
    assert broken == 0
    ok, rejected, broken, _ = (int(n) for n in rows["TTFT 2s", "4x"][3].split("/"))
    assert rejected > 0
    assert ok > 0
    assert broken == 0
    assert rows["TTFT 2s", "4x"][8].endswith("%")  # the server's predictions were read back
    p10, p50, p90 = (float(q) for q in rows["TTFT 2s", "4x"][9].split("/"))  # and their error's distribution
    assert 0 < p10 <= p50 <= p90
    assert float(rows["TTFT 2s", "4x"][10]) > 0  # the cold start's longest TTFT
    # The section is this dtype's on this CPU kind: the promise is measured per machine.
    assert f"## `kvstorm bench goodput` (float32-{cpu_kind()})" in run.stdout
    assert cpu_name() in run.stdout
    assert len(list(tmp_path.glob("goodput-*.html"))) == 1
    assert len(list(tmp_path.glob("goodput-*.json"))) == 2


def test_the_prediction_error_quantiles_interpolate_within_buckets_as_prometheus_does():
    cumulative = {"0.5": 0.0, "1.0": 10.0, "2.0": 20.0, "+Inf": 20.0}
    assert _bucket_quantile(cumulative, 0.25) == 0.75
    assert _bucket_quantile(cumulative, 0.5) == 1.0
    assert _bucket_quantile(cumulative, 0.75) == 1.5
    # Beyond the last finite bound: that bound, as histogram_quantile answers.
    assert _bucket_quantile({"1.0": 5.0, "+Inf": 10.0}, 0.9) == 1.0
