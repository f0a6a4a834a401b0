"""Keeps docs/benchmarks.md up to date: each benchmark owns one section and rewrites only that."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
HEADER = (
    "# kvstorm benchmarks\n\n"
    "Measured numbers, each with the command that reproduces it. Sections are rewritten by their benchmark.\n"
)


@dataclass(frozen=True)
class BenchReport:
    """What a ``kvstorm bench`` subcommand returns: the markdown it prints and records, the raw numbers, and what
    made the numbers meaningless (non-empty: exit 1, nothing recorded)."""

    markdown: str
    data: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    # Where one benchmark keeps a section per case (a dtype, an instruction set): this run's case.
    case: str | None = None


def update_section(name: str, markdown: str, path: Path = DEFAULT_PATH) -> None:
    """Replace (or append) the section delimited by ``<!-- bench:NAME -->`` markers."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text.rstrip()}\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
