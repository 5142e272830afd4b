"""Lab generation: stubs, solution-only cells, cleared outputs, kept ids, determinism, drift."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from memlab import labs

ROOT = Path(__file__).resolve().parents[1]


def _solution() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    md = nbformat.v4.new_markdown_cell("# Lab")
    setup = nbformat.v4.new_code_cell("from memlab.grading import check")
    ex = nbformat.v4.new_code_cell(
        "def double(x):\n"
        '    """Twice x."""\n'
        "    ### BEGIN SOLUTION\n"
        "    y = x + x\n"
        "    return y\n"
        "    ### END SOLUTION\n"
        "\n"
        "class Box:\n"
        "    def area(self, w, h):\n"
        "        ### BEGIN SOLUTION\n"
        "        return w * h\n"
        "        ### END SOLUTION"
    )
    ex.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    ex.execution_count = 7
    ex.metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    chk = nbformat.v4.new_code_cell('check("00.model_state_bytes", double)')
    secret = nbformat.v4.new_code_cell("print('the answer is 42')")
    secret.metadata["tags"] = ["solution-only"]
    nb.cells = [md, setup, ex, chk, secret]
    return nb


def test_build_lab_stubs_and_cleans():
    sol = _solution()
    lab = labs.build_lab(sol)
    src = lab.cells[2].source
    assert '    raise NotImplementedError("exercise 00.model_state_bytes: replace this line with your code")' in src
    assert '        raise NotImplementedError("exercise 00.model_state_bytes' in src  # indentation of the method body kept
    assert "x + x" not in src and "w * h" not in src and "BEGIN SOLUTION" not in src
    assert '"""Twice x."""' in src and "class Box:" in src
    assert lab.cells[2].outputs == [] and lab.cells[2].execution_count is None
    assert "execution" not in lab.cells[2].metadata
    assert len(lab.cells) == 4 and all("42" not in c.source for c in lab.cells)  # solution-only dropped
    assert [c.id for c in lab.cells] == [c.id for c in sol.cells[:4]]  # ids kept
    assert sol.cells[2].outputs, "the solution itself is not modified"
    assert labs.render(labs.build_lab(sol)) == labs.render(lab)  # deterministic


def test_stubbed_lab_compiles():
    lab = labs.build_lab(_solution())
    compile(lab.cells[2].source, "cell", "exec")


@pytest.mark.parametrize(
    "source, problem",
    [
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "never closed"),
        ("def f():\n    return 1\n    ### END SOLUTION\n", "without"),
        ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION\n", "inside another"),
    ],
)
def test_malformed_blocks_are_named(source, problem):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source), nbformat.v4.new_code_cell('check("00.x", f)')]
    with pytest.raises(labs.LabBuildError, match=problem):
        labs.build_lab(nb, name="bad.ipynb")


def test_block_without_check_is_an_error():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")]
    with pytest.raises(labs.LabBuildError, match="no check"):
        labs.build_lab(nb, name="bad.ipynb")


def _course_copy(tmp_path: Path) -> Path:
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs").mkdir()
    nbformat.write(_solution(), tmp_path / "solutions" / "00_demo.ipynb")
    return tmp_path


def _memlab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memlab", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cli_build_then_check_then_drift(tmp_path):
    root = _course_copy(tmp_path)
    missing = _memlab("labs", "check", cwd=root)
    assert missing.returncode == 1 and "00_demo.ipynb" in missing.stdout
    assert _memlab("labs", "build", cwd=root).returncode == 0
    first = (root / "labs" / "00_demo.ipynb").read_text()
    assert _memlab("labs", "build", cwd=root).returncode == 0
    assert (root / "labs" / "00_demo.ipynb").read_text() == first  # byte-identical rebuild
    ok = _memlab("labs", "check", cwd=root)
    assert ok.returncode == 0, ok.stdout
    # a hand edit of the lab is drift, and so is an orphan lab
    lab = root / "labs" / "00_demo.ipynb"
    lab.write_text(first.replace("Lab", "Lab (edited)"))
    shutil.copy(lab, root / "labs" / "99_orphan.ipynb")
    drift = _memlab("labs", "check", cwd=root)
    assert drift.returncode == 1
    assert "labs/00_demo.ipynb" in drift.stdout and "99_orphan.ipynb" in drift.stdout


@pytest.mark.slow
def test_memlab_grade_chapter_00_both_ways():
    """The README's command: the untouched lab scores 0 with every row TODO; the solution full marks."""
    lab = _memlab("grade", "labs/00_where_the_memory_goes.ipynb", cwd=ROOT)
    assert lab.returncode == 1, lab.stdout + lab.stderr
    rows = [line for line in lab.stdout.splitlines() if line.startswith(("PASS", "FAIL", "TODO", "ERROR", "TIMEOUT"))]
    assert len(rows) >= 3 and all(r.startswith("TODO") for r in rows), lab.stdout
    assert f"0/{len(rows)}" in lab.stdout.splitlines()[-2] or f"0/{len(rows)}" in lab.stdout
    sol = _memlab("grade", "solutions/00_where_the_memory_goes.ipynb", cwd=ROOT)
    assert sol.returncode == 0, sol.stdout + sol.stderr
    assert f"{len(rows)}/{len(rows)}" in sol.stdout
