"""``memlab grade`` (issue 40.6): with no PATH it grades only the labs of work/ changed since
``memlab labs start`` / ``reset`` copied them (``--all``: every one), lists each notebook's
exercises in the notebook's order, and every argument error exits 2 in one line naming the
allowed chapters. The notebooks are not run here: ``grade_notebook`` is replaced by a recorder
that returns the registry's rows (the real grader is tested in test_grading.py, test_workflow.py)."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from memlab.course import labs
from memlab.course.grading import command
from memlab.course.grading.notebook import exercises_in
from memlab.course.grading.registry import CheckResult, chapter_exercises

ROOT = Path(__file__).resolve().parents[2]
LABS = ("00_where_the_memory_goes.ipynb", "02_gradient_checkpointing.ipynb")


@pytest.fixture
def course(tmp_path, monkeypatch):
    root = tmp_path / "course"
    (root / "labs").mkdir(parents=True)
    for name in LABS:
        shutil.copyfile(ROOT / "labs" / name, root / "labs" / name)
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def graded(monkeypatch):
    """The notebooks grade_main grades, in order; each gets every exercise of its chapter, TODO, in registry order."""
    seen: list[Path] = []

    def fake(path, **kw):
        seen.append(Path(path))
        return [CheckResult(ex.id, "todo", 0.0, ex.points) for ex in chapter_exercises(Path(path).name[:2])]

    monkeypatch.setattr(command, "grade_notebook", fake)
    return seen


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = command.grade_main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _edit(path: Path, text: str = "my notes") -> None:
    nb = json.loads(path.read_text())
    nb["cells"].append({"cell_type": "markdown", "id": "learner-note", "metadata": {}, "source": text})
    path.write_text(json.dumps(nb))


def test_only_the_labs_changed_since_they_were_copied_are_graded(course, graded):
    labs.start(course)
    work = course / "work"
    assert (work / ".memlab-copies.json").is_file()  # what start copied is recorded
    _edit(work / LABS[1])
    rc, out, err = _main()
    assert graded == [Path("work") / LABS[1]], out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("not graded, unchanged since copied")]
    assert LABS[0] in line and LABS[1] not in line and "--all" in line
    points = sum(ex.points for name in LABS for ex in chapter_exercises(name[:2]))
    assert re.search(rf"^all labs\s+0/{points:g}$", out, re.M), out  # the total still counts every lab
    assert rc == 1 and err == ""
    graded.clear()
    assert _main("--all")[0] == 1 and graded == [Path("work") / n for n in LABS]
    graded.clear()
    assert _main("00")[0] == 1 and graded == [Path("work") / LABS[0]]  # a lab named is graded, changed or not


def test_running_a_lab_is_no_change_and_a_lost_record_falls_back_on_labs(course, graded):
    labs.start(course)
    work = course / "work"
    nb = json.loads((work / LABS[0]).read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [{"output_type": "stream", "name": "stdout", "text": "ran"}], 1
    (work / LABS[0]).write_text(json.dumps(nb))  # outputs only: nothing of the learner's to grade
    (work / ".memlab-copies.json").write_text("{ damaged")
    _main()
    assert graded == []
    # a course updated after the copy: the record still knows what was copied
    labs.reset("02", course)
    _edit(course / "labs" / LABS[1], "the course changed")
    _main()
    assert graded == []
    _edit(work / LABS[0])
    _main()
    assert graded == [Path("work") / LABS[0]]


def test_without_work_every_lab_is_graded(course, graded):
    assert _main()[0] == 1 and graded == [Path("labs") / n for n in LABS]


def test_all_with_a_path_is_an_argument_error(course, graded):
    rc, out, err = _main("--all", "00")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "--all" in err and graded == []


def test_rows_come_in_notebook_order(course, graded):
    """Lab 02 checks 02.rng_replay before 02.checkpoint_function; the registry has them the other way."""
    nb = nbformat.read(course / "labs" / LABS[1], as_version=4)
    order = [ex for ex, _ in exercises_in(nb)]
    registry = [ex.id for ex in chapter_exercises("02")]
    assert sorted(order) == sorted(registry)
    rc, out, _ = _main("labs/" + LABS[1])
    rows = re.findall(r"^TODO\s+(\d{2}\.\w+)", out, re.M)
    assert rows == order, out


def test_notebook_order_keeps_a_missing_exercise_in_place_and_other_rows_last(tmp_path):
    nb = nbformat.read(ROOT / "labs" / LABS[1], as_version=4)
    order = [ex for ex, _ in exercises_in(nb)]
    gone = order[2]
    for cell in nb.cells:
        if cell.cell_type == "code" and f'check("{gone}"' in cell.source:
            cell.source = ""
    path = tmp_path / LABS[1]
    nbformat.write(nb, path)
    registry = [ex.id for ex in chapter_exercises("02")]
    rows = [CheckResult(ex, "missing" if ex == gone else "todo", 0.0, 1.0) for ex in registry]
    rows.append(CheckResult("01.live_bytes", "error", 0.0, 0.0, "not an exercise of chapter 02"))
    got = [r.exercise for r in command.in_notebook_order(path, rows)]
    before = registry[registry.index(gone) - 1]
    expected = [ex for ex in order if ex != gone]
    expected.insert(expected.index(before) + 1, gone)
    assert got == expected + ["01.live_bytes"]


@pytest.mark.parametrize("arg", ["²", "xx", "99", "٣", "1e3"])
def test_argument_errors_exit_2_naming_the_allowed_chapters(course, graded, arg):
    rc, out, err = _main(arg)
    assert rc == 2 and out == "" and graded == [], out
    (line,) = err.strip().splitlines()
    assert line.startswith("memlab grade: ") and repr(arg) in line and "allowed: 00, 02, or a notebook's path" in line, line
    assert "invalid literal" not in line


def test_a_missing_notebook_path_is_still_a_row_of_the_batch(course, graded):
    rc, out, err = _main("work/00_nope.ipynb", "labs/" + LABS[0])
    assert rc == 2 and "00_nope.ipynb: no such notebook file" in out and graded == [Path("labs") / LABS[0]]


@pytest.mark.parametrize("lab", sorted((ROOT / "labs").glob("*.ipynb")), ids=lambda p: p.name[:2])
def test_registry_order_is_the_notebook_order(lab):
    """The registry lists a chapter's exercises in its lab's order (grade_notebook's rows follow it; lab 02's
    rng_replay comes before checkpoint_function)."""
    assert [e.id for e in chapter_exercises(lab.name[:2])] == [ex for ex, _ in exercises_in(nbformat.read(lab, as_version=4))]
