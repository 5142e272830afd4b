"""The learner's workflow, played end to end in a copy of the course: ``memlab labs start`` copies
the labs into work/, the learner solves an exercise there, ``memlab grade`` (no path) grades
work/, the drift checks stay green, ``memlab labs build`` leaves work/ and labs/ alone, and
``memlab labs reset`` keeps a backup. Also: README and packaging facts that must stay true."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest

from memlab import labs

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "00_where_the_memory_goes.ipynb"
MARKER = re.compile(r"^\s*#+\s*(begin|end)[\s_-]+solution\s*$", re.IGNORECASE)


def _memlab(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memlab", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _solve_first_exercise(work_nb: Path, solution_nb: Path) -> str:
    """Put the first exercise's solution body (from solutions/) into the learner's copy, in place
    of its stub; return the exercise id."""
    sol = nbformat.read(solution_nb, as_version=4)
    mine = nbformat.read(work_nb, as_version=4)
    by_id = {cell.id: cell for cell in mine.cells}
    for cell in sol.cells:
        if cell.cell_type == "code" and any(MARKER.match(line) for line in cell.source.split("\n")):
            stub = re.search(r'raise NotImplementedError\("exercise (\d{2}\.\w+)', by_id[cell.id].source)
            assert stub, "the lab's exercise cell has a stub"
            by_id[cell.id].source = "\n".join(line for line in cell.source.split("\n") if not MARKER.match(line))
            nbformat.write(mine, work_nb)
            return stub.group(1)
    raise AssertionError(f"{solution_nb} has no solution block")


def _rows(stdout: str) -> dict[str, str]:
    """``{exercise id: status}`` from a ``memlab grade`` table."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"^(PASS|FAIL|TODO|ERROR|TIMEOUT|MISSING|NOT RUN)\s+(\d{2}\.\w+)", line)
        if m:
            rows[m.group(2)] = m.group(1)
    return rows


@pytest.mark.slow
def test_learner_workflow(tmp_path):
    root = tmp_path / "course"
    root.mkdir()
    for folder in ("labs", "solutions"):
        shutil.copytree(ROOT / folder, root / folder)
    labs_before = {p.name: p.read_bytes() for p in (root / "labs").iterdir()}

    # 1. start: every lab copied into work/
    started = _memlab("labs", "start", cwd=root)
    assert started.returncode == 0, started.stderr
    work = root / "work"
    assert sorted(p.name for p in work.glob("*.ipynb")) == sorted(labs_before)

    # 2. solve one exercise in work/ with the body from solutions/
    exercise = _solve_first_exercise(work / CHAPTER, root / "solutions" / CHAPTER)
    solved = (work / CHAPTER).read_bytes()

    # 3. a second start copies only what is missing and never overwrites the learner's copy
    for p in work.glob("*.ipynb"):
        if p.name != CHAPTER:
            p.unlink()  # (also keeps the grade below to one notebook)
    again = _memlab("labs", "start", cwd=root)
    assert again.returncode == 0 and f"kept   work/{CHAPTER}" in again.stdout, again.stdout
    assert (work / CHAPTER).read_bytes() == solved
    for p in work.glob("*.ipynb"):
        if p.name != CHAPTER:
            p.unlink()

    # 4. grade with no path: work/ is graded, the solved exercise passes, the others are todo
    graded = _memlab("grade", cwd=root)
    assert f"work/{CHAPTER}" in graded.stdout and "labs/" not in graded.stdout, graded.stdout + graded.stderr
    rows = _rows(graded.stdout)
    assert rows.pop(exercise) == "PASS", graded.stdout
    assert rows and set(rows.values()) == {"TODO"}, graded.stdout
    assert graded.returncode == 1  # not full marks yet

    # 5. the drift checks stay green: labs/ is untouched
    check = _memlab("labs", "check", cwd=root)
    assert check.returncode == 0, check.stdout + check.stderr
    assert labs.drift(root) == []

    # 6. labs build: labs/ unchanged, work/ intact
    built = _memlab("labs", "build", cwd=root)
    assert built.returncode == 0, built.stderr
    assert {p.name: p.read_bytes() for p in (root / "labs").iterdir()} == labs_before
    assert (work / CHAPTER).read_bytes() == solved

    # 7. reset: the solved copy is backed up with a timestamp, a fresh lab takes its place
    reset = _memlab("labs", "reset", "00", cwd=root)
    assert reset.returncode == 0, reset.stderr
    (backup,) = (work / "backups").glob("00_where_the_memory_goes.*.ipynb")
    assert re.fullmatch(r"00_where_the_memory_goes\.\d{8}-\d{6}\.ipynb", backup.name)
    assert backup.read_bytes() == solved
    assert (work / CHAPTER).read_bytes() == labs_before[CHAPTER]
    # a second reset of the still untouched fresh copy makes no backup (issue 26); an edited one does
    assert _memlab("labs", "reset", "0", cwd=root).returncode == 0
    assert len(list((work / "backups").glob("00_where_the_memory_goes.*.ipynb"))) == 1
    (work / CHAPTER).write_bytes(solved)
    assert _memlab("labs", "reset", "0", cwd=root).returncode == 0
    assert len(list((work / "backups").glob("00_where_the_memory_goes.*.ipynb"))) == 2


def test_reset_names_the_allowed_chapters(tmp_path):
    shutil.copytree(ROOT / "labs", tmp_path / "labs")
    proc = _memlab("labs", "reset", "42", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "chapter='42' names no lab; allowed: 00, 01" in line, line
    assert not (tmp_path / "work").exists() or not list((tmp_path / "work").glob("*.ipynb"))


def test_default_notebooks_prefer_work(tmp_path):
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "00_a.ipynb").write_text("{}")
    assert labs.default_notebooks(tmp_path) == (tmp_path / "labs", [tmp_path / "labs" / "00_a.ipynb"])
    (tmp_path / "work").mkdir()
    assert labs.default_notebooks(tmp_path) == (tmp_path / "work", [])
    copied, kept = labs.start(tmp_path)
    assert copied == [tmp_path / "work" / "00_a.ipynb"] and kept == []
    assert labs.default_notebooks(tmp_path)[1] == copied


def test_work_is_git_ignored():
    assert "/work/" in (ROOT / ".gitignore").read_text().split("\n")


def _bounds(requirements: list[str]) -> dict[str, str]:
    out = {}
    for req in requirements:
        req = req.split("#")[0].strip()
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(>=\s*[\w.]+)?", req)
        if m and not req.startswith("-"):
            out[m.group(1).lower()] = (m.group(2) or "").replace(" ", "")
    return out


def test_pyproject_lower_bounds_equal_requirements():
    project = tomllib.loads((ROOT / "utils" / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    declared = _bounds(project["dependencies"])
    for extra in ("hf", "grade"):
        declared.update(_bounds(project["optional-dependencies"][extra]))
    assert "bitsandbytes" in _bounds(project["optional-dependencies"]["hf"])
    required = _bounds((ROOT / "requirements.txt").read_text().splitlines())
    for name, bound in declared.items():
        assert name in required, f"{name} is in utils/pyproject.toml but not in requirements.txt"
        assert bound == required[name], f"{name}: pyproject {bound or 'no bound'}, requirements.txt {required[name] or 'no bound'}"
    build = tomllib.loads((ROOT / "utils" / "pyproject.toml").read_text())["build-system"]["requires"]
    assert "setuptools>=77" in build  # an SPDX license string needs setuptools 77


def test_contributing_names_only_what_exists():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for path in re.findall(r"`((?:tests|tools|utils|solutions|notebooks|labs)/[\w./-]+\.(?:py|sh|cfg))`", text):
        if "NN" in path:  # a template such as utils/memlab/checks/chNN.py
            continue
        assert (ROOT / path).exists(), f"CONTRIBUTING.md names {path}, which does not exist"
    assert "DESIGN` in the README" not in text
