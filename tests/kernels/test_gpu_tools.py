"""The GPU-side tools' CPU parts: the kernel benchmark end to end under the interpreter, and gpu_check.sh's
stage handling on a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kernels import bench

REPO = Path(__file__).resolve().parents[2]


def test_kernel_bench_times_every_kernel_and_writes_json(tmp_path, capsys):
    result_file = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--shapes", "smoke", "--dtype", "float32", "--json", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    kernels = {row["kernel"] for row in result["rows"]}
    assert kernels == {"paged_decode_attention", "paged_prefill_attention", "reshape_and_cache", "copy_blocks"}
    for row in result["rows"]:
        assert row["triton_ms"] > 0
        assert row["reference_ms"] > 0
        assert row.get("bandwidth_gbps", 1) > 0
        assert row.get("tflops", 1) > 0
    assert result["copy_bandwidth_gbps"] > 0
    assert "| paged_decode_attention | smollm2-135m | batch=2 context=40 |" in capsys.readouterr().out


def test_gpu_check_reports_each_failed_stage_without_cuda(tmp_path):
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 1
    assert "FAILED: kernel correctness kernel benchmark engine offline (triton) engine offline (torch)" in run.stdout
    assert "kernel correctness: exit 1" in (tmp_path / "check.log").read_text()
    assert "kernel benchmark: exit 1" in (tmp_path / "bench.log").read_text()
    assert "device 'cuda' requested but CUDA is not available" in (tmp_path / "engine.log").read_text()
