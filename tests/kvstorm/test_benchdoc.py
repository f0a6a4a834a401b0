"""docs/benchmarks.md: each benchmark rewrites its own section and nothing else."""

from __future__ import annotations

import shlex
from pathlib import Path

from kvstorm.bench.doc import DEFAULT_PATH, update_section
from kvstorm.cli import reproducible_args, reproducible_command

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_write_to_the_repositorys_docs():
    assert DEFAULT_PATH == REPO_ROOT / "docs" / "benchmarks.md"
    assert DEFAULT_PATH.exists()


def test_a_section_is_replaced_in_place_and_a_new_one_appended(tmp_path):
    path = tmp_path / "benchmarks.md"
    update_section("a", "first", path)
    update_section("b", "second", path)
    update_section("a", "first, again", path)
    text = path.read_text()
    assert text.index("first, again") < text.index("second")
    assert "first\n" not in text
    assert text.count("<!-- bench:a -->") == 1


def test_the_recorded_command_leaves_out_where_the_run_wrote_its_results():
    argv = ["bench", "preemption-modes", "--results-dir", "/x/y", "--modes", "swap", "--json=/a.json", "--json", "b"]
    assert reproducible_args(argv) == ["bench", "preemption-modes", "--modes", "swap"]


def test_the_recorded_command_pastes_into_a_shell_as_it_was_typed():
    argv = ["bench", "goodput", "--server-args", "--dtype float32 --num-kv-blocks 136", "--results-dir", "/x"]
    command = reproducible_command(argv)
    assert command == "kvstorm bench goodput --server-args '--dtype float32 --num-kv-blocks 136'"
    assert shlex.split(command)[1:] == argv[:4]
