"""Where a benchmark's markdown goes: to stdout, and to the file `--out` names (the GPU scripts
bring that file back and docs/ quote it), so the terminal and the file always say the same."""

from __future__ import annotations

import os
from pathlib import Path


def publish(text: str, out: str | os.PathLike | None) -> None:
    """Print `text`; with `out`, also write it there (ending in one newline)."""
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def markdown_table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    """A markdown table: `header` and `rows` of cells, the columns numbered in `right` right-aligned."""
    rule = ["---:" if i in right else "---" for i in range(len(header))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, rule, *rows])
