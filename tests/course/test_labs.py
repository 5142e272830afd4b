"""Lab generation: stubs, solution-only cells, cleared outputs, kept ids, determinism, drift."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from memlab.course import labs

ROOT = Path(__file__).resolve().parents[2]


def _solution() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    md = nbformat.v4.new_markdown_cell("# Lab")
    setup = nbformat.v4.new_code_cell("from memlab.course.grading import check")
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


# ------------------------------------------------------------------ solution markers (issue 9, item 6)


def _nb(*cells: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


@pytest.mark.parametrize(
    "begin, end",
    [
        ("# begin solution", "# end solution"),
        ("#### BEGIN SOLUTION", "#### END SOLUTION"),
        ("### Begin Solution", "##END SOLUTION"),
        ("#BEGIN_SOLUTION", "# end-solution"),
    ],
)
def test_marker_variants_are_stripped(begin, end):
    sol = _nb(
        nbformat.v4.new_code_cell(f"def f(x):\n    {begin}\n    secret = x * 7\n    return secret\n    {end}"),
        nbformat.v4.new_code_cell('check("00.x", f)'),
    )
    src = labs.build_lab(sol, name="v.ipynb").cells[0].source
    assert "secret" not in src and "solution" not in src.lower()
    assert src == 'def f(x):\n    raise NotImplementedError("exercise 00.x: replace this line with your code")'


@pytest.mark.parametrize(
    "cells, problem",
    [
        ([nbformat.v4.new_markdown_cell("Put it here:\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION")], "in a markdown cell"),
        ([nbformat.v4.new_raw_cell("#### begin solution")], "in a raw cell"),
        ([nbformat.v4.new_code_cell("def f():\n    # begin solution\n    return 1\n")], "never closed"),
        ([nbformat.v4.new_code_cell("def f():\n    return 1\n    #### end solution\n")], "without"),
        ([nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    #### begin solution\n    ### END SOLUTION\n")], "nested"),
        ([nbformat.v4.new_code_cell("def f():\n    return 1  ### BEGIN SOLUTION\n    ### END SOLUTION\n")], "a line of its own"),
    ],
    ids=["markdown", "raw", "begin-unclosed", "end-unopened", "nested", "inline"],
)
def test_bad_markers_are_one_line_errors_naming_file_and_cell(cells, problem):
    nb = _nb(nbformat.v4.new_code_cell("from memlab.course.grading import check"), *cells, nbformat.v4.new_code_cell('check("00.x", f)'))
    with pytest.raises(labs.LabBuildError, match=problem) as info:
        labs.build_lab(nb, name="solutions/07_bad.ipynb")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"solutions/07_bad.ipynb: cell 1 (id {nb.cells[1].id})"), message


def test_labs_build_cli_reports_a_bad_marker_in_one_line(tmp_path):
    root = _course_copy(tmp_path)
    bad = _nb(nbformat.v4.new_markdown_cell("#### begin solution"), nbformat.v4.new_code_cell('check("00.x", f)'))
    nbformat.write(bad, root / "solutions" / "01_bad.ipynb")
    proc = _memlab("labs", "build", cwd=root)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "solutions/01_bad.ipynb: cell 0" in line and "markdown cell" in line
    assert list((root / "labs").iterdir()) == []  # nothing written, not even the good lab


def test_labs_check_fails_on_a_leaked_marker(tmp_path, monkeypatch):
    """Even when build and check agree byte for byte (a generator that leaks), a marker in a lab fails."""
    root = _course_copy(tmp_path)
    monkeypatch.setattr(labs, "build_lab", lambda solution, name="nb": solution)  # a leaking generator
    labs.build(root)
    problems = labs.drift(root)
    assert problems and all("solution marker" in p for p in problems), problems
    assert any("labs/00_demo.ipynb: cell 2" in p for p in problems), problems


def test_labs_check_cli_fails_on_a_marker_variant_in_a_lab(tmp_path):
    root = _course_copy(tmp_path)
    assert _memlab("labs", "build", cwd=root).returncode == 0
    lab = root / "labs" / "00_demo.ipynb"
    nb = nbformat.read(lab, as_version=4)
    nb.cells[0].source += "\n\n#### begin solution"
    nbformat.write(nb, lab)
    proc = _memlab("labs", "check", cwd=root)
    assert proc.returncode == 1 and "solution marker '#### begin solution'" in proc.stdout, proc.stdout


# ------------------------------------------------------------------ atomic, all-or-nothing builds


def _two_chapter_course(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A course with two solutions, built once, whose solutions then change (so a rebuild writes
    both labs); returns the root and the labs' bytes before the rebuild."""
    root = _course_copy(tmp_path)
    nbformat.write(_solution(), root / "solutions" / "01_demo.ipynb")
    labs.build(root)
    for name in ("00_demo.ipynb", "01_demo.ipynb"):
        nb = nbformat.read(root / "solutions" / name, as_version=4)
        nb.cells[0].source = "# Lab, second edition"
        nbformat.write(nb, root / "solutions" / name)
    return root, {p.name: p.read_bytes() for p in (root / "labs").iterdir()}


def _labs_state(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / "labs").iterdir()}


def test_a_broken_later_solution_leaves_every_lab_unchanged(tmp_path):
    root, before = _two_chapter_course(tmp_path)
    nb = nbformat.read(root / "solutions" / "01_demo.ipynb", as_version=4)
    nb.cells[2].source += "\n### BEGIN SOLUTION"  # unbalanced
    nbformat.write(nb, root / "solutions" / "01_demo.ipynb")
    with pytest.raises(labs.LabBuildError, match="01_demo.ipynb: cell 2"):
        labs.build(root)
    assert _labs_state(root) == before


def test_a_failed_write_mid_build_leaves_labs_unchanged(tmp_path, monkeypatch):
    """A full disk while writing the second lab: no lab rewritten, no temporary file left."""
    root, before = _two_chapter_course(tmp_path)
    real_fdopen = labs.os.fdopen
    calls = []

    def failing_fdopen(fd, *args, **kwargs):
        calls.append(fd)
        if len(calls) == 2:
            labs.os.close(fd)
            raise OSError(28, "No space left on device")
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(labs.os, "fdopen", failing_fdopen)
    with pytest.raises(OSError, match="No space left"):
        labs.build(root)
    assert _labs_state(root) == before


def test_a_failed_rename_mid_build_restores_the_labs(tmp_path, monkeypatch):
    root, before = _two_chapter_course(tmp_path)
    real_replace = labs.os.replace
    calls = []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(labs.os, "replace", failing_replace)
    with pytest.raises(OSError, match="Input/output"):
        labs.build(root)
    assert _labs_state(root) == before  # the first lab, already renamed, was put back


def test_build_never_overwrites_learner_code_without_force(tmp_path):
    root = _course_copy(tmp_path)
    assert _memlab("labs", "build", cwd=root).returncode == 0
    lab = root / "labs" / "00_demo.ipynb"
    nb = nbformat.read(lab, as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace(
        'raise NotImplementedError("exercise 00.model_state_bytes: replace this line with your code")', "return 2 * x", 1
    )
    nbformat.write(nb, lab)
    mine = lab.read_bytes()
    proc = _memlab("labs", "build", cwd=root)
    assert proc.returncode == 1 and "holds your code for 00.model_state_bytes" in proc.stderr, proc.stderr
    assert "--force" in proc.stderr and lab.read_bytes() == mine
    forced = _memlab("labs", "build", "--force", cwd=root)
    assert forced.returncode == 0 and lab.read_text() == labs.expected_lab(root / "solutions" / "00_demo.ipynb")


def test_metadata_only_changes_are_rebuilt_without_force(tmp_path):
    """A lab whose stubs are all there (e.g. an older kernelspec) is simply regenerated."""
    root = _course_copy(tmp_path)
    labs.build(root)
    lab = root / "labs" / "00_demo.ipynb"
    nb = nbformat.read(lab, as_version=4)
    nb.metadata["kernelspec"]["display_name"] = "Python 3"
    nbformat.write(nb, lab)
    assert labs.build(root) == [lab]
    assert labs.drift(root) == []


def test_labs_carry_jupyterlab_kernelspec():
    lab = labs.build_lab(_solution())
    assert lab.metadata["kernelspec"] == {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    assert lab.metadata["language_info"]["name"] == "python"
    assert lab.metadata["language_info"]["codemirror_mode"] == {"name": "ipython", "version": 3}


def test_drift_ignores_only_the_python_version_jupyterlab_records(tmp_path):
    root = _course_copy(tmp_path)
    labs.build(root)
    lab = root / "labs" / "00_demo.ipynb"
    nb = nbformat.read(lab, as_version=4)
    nb.metadata["language_info"]["version"] = "3.99.0"  # saved by JupyterLab on another Python
    nbformat.write(nb, lab)
    assert labs.drift(root) == []
    nb.metadata["kernelspec"]["display_name"] = "Python 3"
    nbformat.write(nb, lab)
    assert labs.drift(root) != []


# ----------------------------------------------------------------------------- lab commands against faults (issue 25)
LAB = "00_where_the_memory_goes.ipynb"


def _course(tmp_path: Path) -> Path:
    root = tmp_path / "course"
    (root / "labs").mkdir(parents=True)
    shutil.copyfile(ROOT / "labs" / LAB, root / "labs" / LAB)
    return root


def _cli(root: Path, *argv: str, capsys) -> tuple[int, list[str]]:
    rc = labs.main([*argv, "--root", str(root)])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_a_truncated_copy_is_not_kept_as_yours(tmp_path, capsys):
    root = _course(tmp_path)
    (root / "work").mkdir()
    full = (root / "labs" / LAB).read_bytes()
    (root / "work" / LAB).write_bytes(full[: len(full) // 2])  # what a full disk left behind
    # just written: a save may be under way (JupyterLab rewrites the file in place): left to finish
    assert labs.main(["start", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "not a complete notebook yet: changed" in out and "left as it is" in out, out
    assert (root / "work" / LAB).read_bytes() == full[: len(full) // 2]
    os.utime(root / "work" / LAB, (time.time() - 60, time.time() - 60))  # cut short a minute ago
    assert labs.main(["start", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "not a complete notebook (cut short?)" in out
    assert (root / "work" / LAB).read_bytes() == full
    (backup,) = (root / "work" / "backups").glob("00_where_the_memory_goes.incomplete-*.ipynb")
    assert backup.read_bytes() == full[: len(full) // 2]  # nothing of the learner's is deleted
    assert labs.is_complete_notebook(root / "work" / LAB) and not labs.is_complete_notebook(backup)


def test_a_full_disk_mid_copy_leaves_no_partial_notebook(tmp_path, monkeypatch):
    import errno

    root = _course(tmp_path)
    real_fdopen = labs.os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[: len(data) // 3])
            raise OSError(errno.ENOSPC, "No space left on device", str(root / "work"))

    monkeypatch.setattr(labs.os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    with pytest.raises(labs.LabFileError, match=r"No space left on device during labs start; free some disk space"):
        labs.start(root)
    monkeypatch.undo()
    assert not (root / "work" / LAB).exists() and not list((root / "work").glob(".*"))  # no half file, no temp
    copied, _ = labs.start(root)
    assert copied == [root / "work" / LAB] and labs.is_complete_notebook(copied[0])


def test_symlinks_in_work_are_never_followed(tmp_path, capsys):
    root = _course(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "work").mkdir()
    (root / "work" / LAB).symlink_to(outside / "victim.ipynb")  # dangling
    rc, err = _cli(root, "start", capsys=capsys)
    assert rc == 1 and len(err) == 1 and "is a symbolic link" in err[0] and LAB in err[0], err
    rc, err = _cli(root, "reset", "00", capsys=capsys)
    assert rc == 1 and len(err) == 1 and "is a symbolic link" in err[0], err
    assert not list(outside.iterdir())
    # a planted link where the old reset wrote its temp file
    (root / "work" / LAB).unlink()
    (root / "work" / f".{LAB}.tmp").symlink_to(outside / "planted.ipynb")
    fresh, _ = labs.reset("00", root)
    assert fresh.read_bytes() == (root / "labs" / LAB).read_bytes() and not fresh.is_symlink()
    assert not list(outside.iterdir())
    # a backups/ that is a link out of work/ (the copy is edited first: an untouched copy gets no backup)
    nb = json.loads(fresh.read_text())
    nb["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "my notes"})
    fresh.write_text(json.dumps(nb))
    os.utime(fresh, (time.time() - 60, time.time() - 60))  # saved a minute ago (a reset refuses a file changed just now)
    (root / "work" / "backups").symlink_to(outside, target_is_directory=True)
    rc, err = _cli(root, "reset", "00", capsys=capsys)
    assert rc == 1 and "backups: is a symbolic link" in err[0], err
    assert not list(outside.iterdir())


def test_unusable_work_and_labs_folders_are_one_line_errors(tmp_path, capsys, monkeypatch):
    import errno

    root = _course(tmp_path)
    (root / "work").write_text("not a folder")
    for argv in (["start"], ["reset", "00"]):
        rc, err = _cli(root, *argv, capsys=capsys)
        assert rc == 1 and len(err) == 1 and "work: is not a folder" in err[0], err
    (root / "work").unlink()

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(root / "work"))

    monkeypatch.setattr(labs.tempfile, "mkstemp", read_only)
    rc, err = _cli(root, "start", capsys=capsys)
    assert rc == 1 and len(err) == 1 and "Read-only file system" in err[0] and "chmod u+w" in err[0], err
    monkeypatch.undo()
    shutil.rmtree(root / "labs")
    (root / "labs").write_text("x")
    rc, err = _cli(root, "start", capsys=capsys)
    assert rc == 1 and len(err) == 1 and "labs: is not a folder" in err[0], err
