"""Shared by the benchmark scripts: print a section and append it to RESULTS.md."""

from __future__ import annotations

from pathlib import Path


def report(lines: list[str], write: bool) -> None:
    text = "\n".join(lines)
    print(text)
    if write:
        path = Path(__file__).with_name("RESULTS.md")
        old = path.read_text() if path.exists() else "# Benchmark results\n\n"
        path.write_text(old.rstrip("\n") + "\n\n" + text)
