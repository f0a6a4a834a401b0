"""The Triton kernels compiled for sm_80 and sm_90 without a GPU (``kernels.aot``): every launch of the engine's
matrix compiles with no spill and within shared memory (about a minute on 2 cores: spills it found sat in
small configurations), the launches are the launchers' own, and a kernel the interpreter accepts but a GPU compile
rejects is caught.

The matrix here is in bf16 and fp32: fp16 compiled to the same registers and shared memory as bf16 in all 144 of
its kernel, launch, configuration and target cases (``python -m kernels.aot``, triton 3.9.0), and took a third of
the compile time; ``kvstorm bench kernels-aot`` compiles all three dtypes."""

from __future__ import annotations

import os
import subprocess
import sys

from kernels.aot import TARGETS
from kernels.triton_paged_attention import DECODE_TILES_16BIT

COMPILED = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}


def test_every_kernel_of_the_matrix_compiles_without_spills():
    result = subprocess.run(
        [sys.executable, "-m", "kernels.aot", "--dtypes", "bf16,fp32"], capture_output=True, text=True, env=COMPILED,
        timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| _")]
    kernels = {"_reshape_and_cache_kernel", "_paged_decode_kernel", "_paged_decode_reduce_kernel",
               "_paged_prefill_kernel", "_copy_blocks_kernel"}  # fmt: skip
    assert {row.split(" | ")[0].removeprefix("| ") for row in rows} == kernels
    assert {row.split(" | ")[3] for row in rows} == {target.name for target in TARGETS}
    assert all(row.endswith("| ok |") for row in rows)
    assert {row.split(" | ")[2].split()[0] for row in rows} == {"bf16", "fp32"}


def compiled(script: str) -> str:
    """Run ``script`` where Triton compiles (this test process interprets: tests/conftest.py); its stdout."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=COMPILED, timeout=600,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_launches_are_what_the_launchers_pick():
    output = compiled(
        "from kernels.aot import Config, launches\n"
        "(decode,) = [l for l in launches(Config('bf16', 128, 16, 4)) if 'one partition' in l.what]\n"
        "source, options = decode.source()\n"
        "print(decode.kwargs['GROUP_PAD'], decode.kwargs['SINGLE_PARTITION'], source.signature['q_ptr'], options)"
    )
    # 4 query heads per KV head padded to the 16 rows tl.dot needs; one partition; the launcher's warps.
    assert output.split(maxsplit=3) == ["16", "True", "*bf16", f"{{'num_warps': {DECODE_TILES_16BIT[1]}}}\n"]


def test_a_kernel_the_interpreter_runs_and_a_gpu_rejects_fails_the_check():
    interpreted = subprocess.run(
        [sys.executable, "-m", "tests.kernels.broken_dot"], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert interpreted.stdout.strip() == "True", interpreted.stderr[-2000:]
    output = compiled(
        "import torch\n"
        "from kernels.aot import TARGETS, Config, compile_launch, recorded_launches\n"
        "from tests.kernels.broken_dot import K, short_k_dot\n"
        "a, b = torch.zeros(16, K, dtype=torch.float16), torch.zeros(K, 16, dtype=torch.float16)\n"
        "with recorded_launches('short_k_dot') as calls:\n"
        "    short_k_dot(a, b)\n"
        "for target in TARGETS:\n"
        "    print(target.name, compile_launch(calls[0], Config('fp16', 16, 16, 1), target).problems)"
    )
    lines = output.splitlines()
    assert [line.split()[0] for line in lines] == [target.name for target in TARGETS]
    assert all("K >= 16" in line or "k >= 16" in line.lower() for line in lines), output
