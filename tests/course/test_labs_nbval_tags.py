"""Labs show no nbval marker: the solutions' first-line ``# NBVAL_CHECK_OUTPUT`` becomes the cell
tag ``nbval-check-output``, which nbval reads as the same instruction."""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbval_plugin = pytest.importorskip("nbval.plugin")

from memlab.course import labs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name[:2])
def test_lab_check_cells_carry_the_tag_not_the_comment(solution):
    sol = nbformat.read(solution, as_version=4)
    lab = labs.build_lab(sol, solution.name)
    marked = [c for c in sol.cells if c.cell_type == "code" and c.source.startswith("# NBVAL_CHECK_OUTPUT")]
    assert marked, "the solutions mark their check cells"
    assert not any("NBVAL_" in c.source for c in lab.cells), "a learner sees no nbval marker"
    by_id = {c.get("id"): c for c in lab.cells}
    for cell in marked:
        twin = by_id[cell.get("id")]
        assert "nbval-check-output" in twin.metadata.get("tags", [])
        assert twin.source == cell.source.split("\n", 1)[1]  # the marker line only, the code unchanged
        # nbval reads the tag as it reads the comment: compare this cell's output
        assert dict(nbval_plugin.find_metadata_tags(twin.metadata)) == dict(nbval_plugin.find_comment_markers(cell.source)) == {"check": True}


def test_a_tag_already_there_is_not_doubled():
    cell = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\ncheck('00.x', x)")
    cell.metadata["tags"] = ["nbval-check-output"]
    labs._nbval_comment_to_tag(cell)
    assert cell.source == "check('00.x', x)" and cell.metadata["tags"] == ["nbval-check-output"]
    plain = nbformat.v4.new_code_cell("x = 1  # NBVAL_CHECK_OUTPUT later on the line is left alone")
    labs._nbval_comment_to_tag(plain)
    assert plain.source.startswith("x = 1") and "tags" not in plain.metadata
