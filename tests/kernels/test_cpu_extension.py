"""Building the CPU kernels does not depend on which ninja, if any, the caller's PATH has: the loader uses the one the
package installs, so a shell without a system ninja gets the kernels, and it reuses the build another PATH made. A
build killed midway does not stop later ones. A non-editable install carries every source file the build reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

from kernels.cpu_extension import compiled_kernels, extension_name, kernels_build_directory

LOADS_THE_KERNELS = "from kernels.cpu_extension import cpu_kernels_available; assert cpu_kernels_available()"


def test_kernels_load_from_the_same_build_with_no_ninja_on_path(tmp_path):
    compiled_kernels()  # built (or found) with this process's PATH
    library = kernels_build_directory() / f"{extension_name()}.so"
    built_at = library.stat().st_mtime_ns
    tools = tmp_path / "bin"  # a C++ compiler and the binutils it calls, and nothing else
    tools.mkdir()
    for tool in ("c++", "as", "ld"):
        if shutil.which(tool):
            (tools / tool).symlink_to(shutil.which(tool))
    assert shutil.which("ninja", path=str(tools)) is None

    child = subprocess.run(
        [sys.executable, "-c", LOADS_THE_KERNELS],
        env={**os.environ, "PATH": str(tools)},
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert child.returncode == 0, child.stderr
    assert "unavailable" not in child.stderr, child.stderr
    assert library.stat().st_mtime_ns == built_at, "the kernels were rebuilt: " + child.stderr


def test_the_lock_a_build_killed_midway_left_does_not_hang_the_next_start():
    """torch's loader waits forever for the lock file of a build that was killed (a Ctrl-C during a first start)."""
    compiled_kernels()
    leftover = kernels_build_directory() / "lock"
    leftover.touch()

    child = subprocess.run([sys.executable, "-c", LOADS_THE_KERNELS], capture_output=True, text=True, timeout=120)

    assert child.returncode == 0, child.stderr
    assert not leftover.exists()


def test_a_non_editable_install_ships_every_kernel_source():
    """The image installs kvstorm with `pip install .` and builds the kernels from the installed copy, so the package
    data must name every file the build reads: each .cpp and the headers they include (the headers were left out
    once, and the image's kernels could not build)."""
    root = Path(__file__).resolve().parents[2]
    patterns = read_configuration(root / "pyproject.toml")["tool"]["setuptools"]["package-data"]["kernels"]
    shipped = {path for pattern in patterns for path in (root / "kernels").glob(pattern)}
    assert shipped == set((root / "kernels" / "csrc").iterdir())
