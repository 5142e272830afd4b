"""The course as a whole: every check passes on memlab's own answer (the one place it is tested), every
solution runs clean and scores full marks (its one execution in `make test`), every untouched lab
scores todo on every exercise, labs/ is what solutions/ generates and leaks no solution."""
from __future__ import annotations

import copy
import re
from collections import defaultdict
from pathlib import Path

import nbformat
import pytest

from memlab.course import labs
from memlab.course.grading import check, check_calls, exercises_in, grade_notebook, load_all, run_and_grade

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


# nbval's --nbval-lax comparison of a `# NBVAL_CHECK_OUTPUT` cell (nbval/plugin.py, IPyNbCell.compare_outputs):
# streams merged per name, then each key but these (MIME types flattened) to its sanitized values, in order
_NBVAL_SKIP = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
               "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")


def _as_nbval_compares(outputs: list, patterns: list[tuple[str, str]]) -> dict[str, list]:
    from nbval.plugin import coalesce_streams, transform_streams_for_comparison

    def clean(value):
        for regex, replace in patterns if isinstance(value, str) else ():
            value = re.sub(regex, replace, value)
        return value

    found = defaultdict(list)
    for out in transform_streams_for_comparison(coalesce_streams(copy.deepcopy(outputs))):
        for key, value in out.items():
            if key == "data":
                for mime, data in value.items():
                    if mime not in _NBVAL_SKIP:
                        found[mime].append(clean(data))
            elif key not in _NBVAL_SKIP:
                found[key].append(clean(value))
    return dict(found)


def test_make_test_leaves_solutions_to_the_grader(tmp_path):
    """nbval executes the lectures; the solutions execute once, in the test below."""
    import subprocess

    stamp = tmp_path / "stamp"  # set-up counts as done: the dry run shows the test's own commands (never the
    stamp.touch()               # Makefile itself as the stamp: make would remake it, recursively, even under -n)
    recipe = subprocess.run(["make", "-n", "-C", str(ROOT), "test", f"STAMP={stamp}"], capture_output=True, text=True,
                            env={k: v for k, v in __import__("os").environ.items() if k not in ("MAKEFLAGS", "MFLAGS")},
                            timeout=60).stdout
    pytest_line = next(ln for ln in recipe.splitlines() if " -m pytest " in ln)
    assert "--nbval-lax" in recipe and "notebooks" in pytest_line.split() and "solutions" not in recipe, recipe


@pytest.mark.slow
@pytest.mark.parametrize("sol", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_runs_clean_and_scores_full_marks(sol):
    """The grader's run of every cell: no cell fails, every exercise passes, and each `# NBVAL_CHECK_OUTPUT`
    cell shows its stored output, sanitized with tests/nbval_sanitize.cfg and compared as nbval does.
    In the grader's kernel check() only marks its cell: a check cell's output there is the grader's row."""
    results, ran = run_and_grade(sol)
    assert results and all(r.status == "pass" for r in results), [(r.exercise, r.status, r.message) for r in results]
    rows = {r.exercise: r.row() for r in results}
    stored = nbformat.read(sol, as_version=4)
    nbval = pytest.importorskip("nbval.plugin")
    patterns = nbval.get_sanitize_patterns((ROOT / "tests" / "nbval_sanitize.cfg").read_text())
    calls = check_calls(stored)
    for i, (cell, out) in enumerate(zip(stored.cells, ran.cells)):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        errors = [f"{o.ename}: {o.evalue}" for o in out.outputs if o.output_type == "error"]
        assert out.execution_count is not None and not errors, f"{sol.name} cell {i}: {errors or 'did not run'}"
        if {**dict(nbval.find_comment_markers(cell.source)), **dict(nbval.find_metadata_tags(cell.metadata))}.get("check"):
            shown = out.outputs + [nbformat.v4.new_output("stream", name="stdout", text=rows[c.exercise] + "\n")
                                   for c in calls if c.cell == i]
            got, want = _as_nbval_compares(shown, patterns), _as_nbval_compares(cell.outputs, patterns)
            assert got == want, f"{sol.name} cell {i}: the output differs from the stored one:\n{got}\n!=\n{want}"


@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_untouched_lab_is_all_todo(lab):
    results = grade_notebook(lab)
    assert results and all(r.status == "todo" for r in results), [(r.exercise, r.status, r.message) for r in results]
    assert sum(r.points for r in results) == 0
