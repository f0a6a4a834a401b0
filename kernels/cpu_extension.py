"""kvstorm's C++ kernels for the CPU (``kernels/csrc``): attention from the paged cache, bfloat16 matmuls on AMX
tiles, RMSNorm and rotary embeddings, greedy's argmax. Built on first use with PyTorch's JIT extension loader (needs a
C++ compiler and ninja) and cached under ``TORCH_EXTENSIONS_DIR``, for the instruction-set ceiling in force
(``kernels.cpu_isa``): each ceiling has a build of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu_isa import NATIVE, ceiling_name, kernel_compiler_flags

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
# What the kernels compute on (activations and the KV cache).
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def cpu_kernels_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels take tensors of this device and dtype (not whether they build: ``cpu_kernels_available``)."""
    return device.type == "cpu" and dtype in CPU_KERNEL_DTYPES


@functools.cache
def compiled_kernels() -> ModuleType:
    """Build (first time on this machine, then from cache) and load the C++ kernels."""
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    build_directory = kernels_build_directory()
    build_directory.mkdir(parents=True, exist_ok=True)
    with _installed_ninja_first(), open(build_directory / "kvstorm-build.flock", "w") as guard:
        # torch's loader guards a build with a file it deletes when done: a build killed midway (Ctrl-C on a first
        # start) leaves it, and every later load waits for it forever, silently. Each kvstorm build holds this
        # flock, which the kernel releases when its holder dies, so a torch lock found while holding it is such a
        # leftover.
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_directory / "lock").unlink(missing_ok=True)
        module = load(
            name=extension_name(),
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O3", *kernel_compiler_flags(), "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_directory),
            verbose=False,
        )
    elapsed = time.perf_counter() - start
    if elapsed > 5:
        print(f"kvstorm: built the CPU kernels in {elapsed:.0f} s (cached from now on)", file=sys.stderr)
    return module


def extension_name() -> str:
    """The kernels' module name, which names their build directory: one per instruction-set ceiling, so that a
    build for one never loads under another."""
    ceiling = ceiling_name()
    return "kvstorm_cpu_kernels" if ceiling == NATIVE else f"kvstorm_cpu_kernels_{ceiling.replace('-', '_')}"


def kernels_build_directory() -> Path:
    """Where torch's loader builds and caches the kernels (under ``TORCH_EXTENSIONS_DIR``, or its default root)."""
    from torch.utils.cpp_extension import _get_build_directory  # private, but the one place that names it

    return Path(_get_build_directory(extension_name(), verbose=False))


@contextlib.contextmanager
def _installed_ninja_first():
    """PATH with the ninja our package depends on (the ``ninja`` wheel) in front, while torch's loader builds: it runs
    whatever ``ninja`` PATH finds, so ``.venv/bin/kvstorm`` found none on a machine without a system ninja and fell
    back to the torch reference, and two ninjas (the wheel's in an activated venv, the system's elsewhere) read each
    other's build log as stale and rebuilt the kernels (about a minute) every time the caller's PATH changed."""
    try:
        import ninja
    except ImportError:  # installed without its dependencies: whatever ninja PATH has, if any
        yield
        return
    saved = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(filter(None, (ninja.BIN_DIR, saved)))
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = saved


def cpu_kernels_available() -> bool:
    """True when the C++ kernels build and load here; False (with the reason on stderr) otherwise."""
    try:
        compiled_kernels()
    except Exception as error:  # a missing compiler or ninja must not stop the engine: it falls back
        print(f"kvstorm: CPU kernels unavailable, using the torch reference ({error})", file=sys.stderr)
        return False
    return True
