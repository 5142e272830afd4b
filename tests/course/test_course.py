"""The course as a whole: every check passes on memlab's own answer, every solution scores full
marks, every untouched lab scores todo on every exercise, labs/ is what solutions/ generates and
leaks no solution."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from memlab.course import labs
from memlab.course.grading import check, exercises_in, grade_notebook, load_all

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
REGISTRY = load_all()


@pytest.mark.parametrize("exercise_id", sorted(REGISTRY))
def test_check_passes_on_memlab_reference(exercise_id):
    r = check(exercise_id, REGISTRY[exercise_id].reference(), quiet=True)
    assert r.status == "pass", r.message


def test_every_chapter_has_solution_and_lab():
    assert SOLUTIONS, "no solutions/*.ipynb"
    assert [p.name for p in SOLUTIONS] == [p.name for p in LABS]


def test_labs_in_sync_with_solutions():
    assert labs.drift(ROOT) == []


def _solution_lines(nb) -> list[str]:
    lines = []
    for cell in nb.cells:
        inside = False
        for line in cell.source.split("\n"):
            if line.strip().startswith(labs.BEGIN):
                inside = True
            elif line.strip().startswith(labs.END):
                inside = False
            elif inside and len(line.strip()) > 12:
                lines.append(line.strip())
    return lines


@pytest.mark.parametrize("sol", SOLUTIONS, ids=lambda p: p.stem)
def test_lab_leaks_no_solution(sol):
    solution = nbformat.read(sol, as_version=4)
    lab = nbformat.read(ROOT / "labs" / sol.name, as_version=4)
    lab_text = "\n".join(c.source for c in lab.cells)
    assert labs.BEGIN not in lab_text and labs.END not in lab_text
    assert labs.find_markers(lab, name=sol.name) == []  # no marker in any case, with any number of '#'
    assert lab.metadata["kernelspec"] == labs.KERNELSPEC  # what JupyterLab writes: opening it changes nothing
    assert not any(labs.SOLUTION_ONLY in c.get("metadata", {}).get("tags", []) for c in lab.cells)
    assert all(not c.get("outputs") for c in lab.cells if c.cell_type == "code")
    leaked = [line for line in _solution_lines(solution) if line in lab_text.split("\n") or f"\n{line}\n" in lab_text]
    # a solution line may legitimately equal a line the lab keeps elsewhere (e.g. `return out`): allow only short ones
    leaked = [line for line in leaked if not re.fullmatch(r"(return|pass|break|continue)\b.{0,20}", line)]
    assert not leaked, f"{sol.name}: lab contains solution lines: {leaked[:3]}"
    ids = [e for e, _ in exercises_in(lab)]
    assert len(ids) >= 3 and ids == [e for e, _ in exercises_in(solution)]
    stubs = re.findall(r'raise NotImplementedError\("exercise (\d{2}\.\w+)', lab_text)
    assert sorted(set(stubs)) == sorted(ids), "every exercise needs a stub naming it"


@pytest.mark.slow
@pytest.mark.parametrize("sol", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_scores_full_marks(sol):
    results = grade_notebook(sol)
    assert results and all(r.status == "pass" for r in results), [(r.exercise, r.status, r.message) for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_untouched_lab_is_all_todo(lab):
    results = grade_notebook(lab)
    assert results and all(r.status == "todo" for r in results), [(r.exercise, r.status, r.message) for r in results]
    assert sum(r.points for r in results) == 0
