"""Every code cell of a lecture or a solution holds at most MAX_LINES lines of code, so that a reader sees a
cell whole and reads one idea at a time (CONTRIBUTING.md: cells of at most about 40 lines of code).

A line of code is a line that is neither blank nor a comment only (``# ...``, markers like
``# NBVAL_CHECK_OUTPUT`` included); lines inside a multi-line string count, as a reader reads them too.
Labs are generated from the solutions (``memlab labs build``), so they follow.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 40
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def code_lines(source: str) -> int:
    """Lines that are neither blank nor only a comment."""
    return sum(1 for ln in source.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))


def long_cells(nb: dict, limit: int = MAX_LINES) -> list[str]:
    """``cell N (L lines of code): first line`` for each code cell over ``limit``."""
    out = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        src = "".join(cell.get("source", ""))
        n = code_lines(src)
        if n > limit:
            first = next((ln.strip() for ln in src.splitlines() if ln.strip()), "")
            out.append(f"cell {i} ({n} lines of code): {first[:70]}")
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_code_cell_has_at_most_40_lines_of_code(path):
    found = long_cells(json.loads(path.read_text(encoding="utf-8")))
    assert not found, f"{path.relative_to(ROOT)}: split these cells (at most {MAX_LINES} lines of code each):\n" + "\n".join(found)


def test_the_count_leaves_out_blank_and_comment_lines_only():
    src = "# a comment\n\nx = 1\n    # indented comment\ns = '''\n# inside a string\n'''\ny = x  # trailing comment\n"
    assert code_lines(src) == 4
    nb = {"cells": [{"cell_type": "markdown", "source": "x\n" * 99},
                    {"cell_type": "code", "source": "\n".join(["a = 1", "# why"] * 41)},
                    {"cell_type": "code", "source": "\n".join(["a = 1"] * 40)}]}
    assert long_cells(nb) == ["cell 1 (41 lines of code): a = 1"]
