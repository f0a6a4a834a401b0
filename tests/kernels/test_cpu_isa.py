"""The instruction-set ceiling (``KVSTORM_CPU_ISA``): every part obeys it, and a ceiling above the CPU is refused.

The refusal's rules are checked against a stand-in CPU (an AVX2-only flag set); the end-to-end tests run the real
``kvstorm`` command and the real kernels under the avx2 ceiling, which every CPU this project runs on reaches.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from kernels import cpu_isa
from kernels.cpu_isa import CEILINGS, CPU_ISA_ENV, LIBRARY_CAPS, CeilingError, real_cpu_flags

AVX2_ONLY_CPU = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "popcnt"})


@pytest.fixture
def avx2_only_cpu(monkeypatch):
    monkeypatch.setattr(cpu_isa, "real_cpu_flags", lambda: AVX2_ONLY_CPU)


@pytest.mark.parametrize("name", ["avx512", "avx512-bf16", "amx"])
def test_a_ceiling_above_the_cpu_is_refused_with_what_the_cpu_lacks(avx2_only_cpu, monkeypatch, name):
    monkeypatch.setenv(CPU_ISA_ENV, name)
    lacks = r"which lacks [a-z0-9_, ]*avx512f, avx512vl"
    with pytest.raises(CeilingError, match=rf"{name} is above this CPU, {lacks}; choose one of avx2, native$"):
        cpu_isa.ceiling_name()


def test_an_unknown_ceiling_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(CPU_ISA_ENV, "sse2")
    choices = "avx2, avx512, avx512-bf16, amx, native"
    with pytest.raises(CeilingError, match=f"'sse2' is not a ceiling; choose one of {choices}"):
        cpu_isa.apply_cpu_isa_ceiling()


def test_native_is_the_default_and_leaves_everything_as_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv(CPU_ISA_ENV, raising=False)
    assert cpu_isa.ceiling_name() == "native"
    assert cpu_isa.visible_cpu_flags() == real_cpu_flags()
    assert cpu_isa.kernel_compiler_flags() == ("-march=native",)
    assert cpu_isa.library_caps() == {}


def test_under_avx2_nothing_above_it_is_visible_and_every_library_is_capped(monkeypatch):
    monkeypatch.setattr(cpu_isa, "real_cpu_flags", lambda: AVX2_ONLY_CPU | {"avx512f", "avx512_bf16", "amx_int8"})
    monkeypatch.setenv(CPU_ISA_ENV, "avx2")
    assert cpu_isa.visible_cpu_flags() == AVX2_ONLY_CPU
    assert cpu_isa.kernel_compiler_flags() == ("-march=x86-64-v3", "-mtune=native")
    assert cpu_isa.library_caps() == {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }


def test_each_ceiling_allows_what_the_ones_below_it_allow():
    for lower, higher in itertools.pairwise(CEILINGS):
        assert lower.flags < higher.flags


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python with ``env`` and without the library caps this process may run under."""
    uncapped = {name: value for name, value in os.environ.items() if name not in LIBRARY_CAPS}
    return subprocess.run(
        [sys.executable, "-c", code], env={**uncapped, **env}, capture_output=True, text=True, timeout=600
    )


def test_under_the_avx2_ceiling_every_part_obeys_it():
    # The kernels' own build, ATen's dispatch, oneDNN's kernels, the tile matmuls and --dtype auto, in one process
    # started as the kvstorm command starts.
    code = """
from kernels.cpu_isa import apply_cpu_isa_ceiling
apply_cpu_isa_ceiling()
import torch
from engine.model.registry import describe_dtype_choice, resolve_dtype
from kernels.cpu_extension import compiled_kernels, kernels_build_directory
from kernels.cpu_matmul import tile_matmul_isa
compiled_kernels()
print("aten", torch.backends.cpu.get_cpu_capability())
print("tiles", tile_matmul_isa())
print("dtype", resolve_dtype("auto", torch.device("cpu")), describe_dtype_choice("auto", torch.device("cpu")))
print("build", (kernels_build_directory() / "build.ninja").read_text().count("-march=x86-64-v3"))
torch.nn.functional.linear(torch.randn(4, 64).to_mkldnn(), torch.randn(64, 64).to_mkldnn())
"""
    child = _python(code, **{CPU_ISA_ENV: "avx2", "ONEDNN_VERBOSE": "1"})
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert "aten AVX2" in lines
    assert "tiles None" in lines
    assert "dtype torch.float32 auto: no native bfloat16 multiply under the avx2 ceiling" in lines
    assert next(line for line in lines if line.startswith("build ")) != "build 0"
    assert any(line.startswith("onednn_verbose") and "isa:Intel AVX2" in line for line in lines), child.stdout[-2000:]


def test_a_ceiling_set_after_torch_started_stops_the_engine():
    child = _python(
        "import torch\n"
        "torch.randn(8) @ torch.randn(8)\n"
        "from kernels.cpu_isa import check_library_caps\n"
        "check_library_caps()\n",
        **{CPU_ISA_ENV: "avx2"},
    )
    assert child.returncode != 0
    assert "KVSTORM_CPU_ISA=avx2 was set after torch started" in child.stderr


def test_kvstorm_generate_under_avx2_says_so_and_answers():
    child = subprocess.run(
        [sys.executable, "-m", "kvstorm", "generate", "--chat", "--prompt", "What is the capital of France?"],
        env={**os.environ, CPU_ISA_ENV: "avx2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr
    assert "Paris" in child.stdout
    assert "on cpu (instruction set capped at avx2 by KVSTORM_CPU_ISA (the CPU has " in child.stderr
    assert "float32 (auto: no native bfloat16 multiply under the avx2 ceiling)" in child.stderr


@pytest.mark.parametrize("ceiling", [ceiling.name for ceiling in CEILINGS])
def test_kvstorm_takes_each_ceiling_this_cpu_reaches_and_refuses_the_others(ceiling):
    # --isa is parsed before --help acts: a refused ceiling exits 2, an accepted one prints the help.
    bench = subprocess.run(
        [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "cpu-speed", "--isa", f"avx2,{ceiling}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if _ceiling_flags(ceiling) <= real_cpu_flags():
        assert bench.returncode == 0, bench.stderr
        return
    assert bench.returncode == 2
    assert f"--isa: KVSTORM_CPU_ISA={ceiling} is above this CPU, which lacks" in bench.stderr
    serve = subprocess.run(
        [sys.executable, "-m", "kvstorm", "serve"],
        env={**os.environ, CPU_ISA_ENV: ceiling},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serve.returncode == 2
    assert f"kvstorm: error: KVSTORM_CPU_ISA={ceiling} is above this CPU, which lacks" in serve.stderr


def _ceiling_flags(name: str) -> frozenset[str]:
    return next(ceiling.flags for ceiling in CEILINGS if ceiling.name == name)
