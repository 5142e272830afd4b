"""The learner's workflow, played end to end in a copy of the course: ``memlab labs start`` copies
the labs into work/, the learner solves an exercise there, ``memlab grade`` (no path) grades
work/, the drift checks stay green, ``memlab labs build`` leaves work/ and labs/ alone, and
``memlab labs reset`` keeps a backup. Also: README and packaging facts that must stay true."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import nbformat
import pytest

from memlab.course import labs

ROOT = Path(__file__).resolve().parents[2]
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
            p.unlink()
    again = _memlab("labs", "start", cwd=root)
    assert again.returncode == 0 and f"kept   work/{CHAPTER}" in again.stdout, again.stdout
    assert f"copied work/{CHAPTER}" not in again.stdout and again.stdout.count("copied work/") == len(labs_before) - 1
    assert (work / CHAPTER).read_bytes() == solved

    # 4. grade with no path: work/ is graded, only the lab changed since it was copied; its solved
    # exercise passes, the others are todo; the labs left as copied are named, not run (issue 40)
    graded = _memlab("grade", cwd=root)
    assert f"work/{CHAPTER}" in graded.stdout and "labs/" not in graded.stdout, graded.stdout + graded.stderr
    rows = _rows(graded.stdout)
    assert rows.pop(exercise) == "PASS", graded.stdout
    assert rows and set(rows.values()) == {"TODO"}, graded.stdout
    assert {r[:2] for r in rows} == {CHAPTER[:2]}, graded.stdout  # no other lab was run
    (skipped,) = [ln for ln in graded.stdout.splitlines() if ln.startswith("not graded, unchanged since copied")]
    assert all(name in skipped for name in labs_before if name != CHAPTER) and CHAPTER not in skipped
    assert graded.returncode == 1  # not full marks yet
    for p in work.glob("*.ipynb"):
        if p.name != CHAPTER:
            p.unlink()

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
    _saved_a_minute_ago(work / CHAPTER)
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
    just_saved = _memlab("labs", "reset", "0", cwd=root)  # a file changed a moment ago may be being saved
    assert just_saved.returncode == 1 and "s ago (a save may be under way)" in just_saved.stderr, just_saved.stderr
    assert (work / CHAPTER).read_bytes() == solved
    _saved_a_minute_ago(work / CHAPTER)
    assert _memlab("labs", "reset", "0", cwd=root).returncode == 0
    assert len(list((work / "backups").glob("00_where_the_memory_goes.*.ipynb"))) == 2


def _saved_a_minute_ago(path: Path) -> None:
    """Date ``path`` a minute back: a reset refuses a file changed in the last seconds (a save under way)."""
    old = time.time() - 60
    os.utime(path, (old, old))


@pytest.mark.parametrize("chapter", ["42", "99", "²", "xx"])
def test_reset_names_the_allowed_chapters(tmp_path, chapter):
    """An argument error exits 2 (README), in one line naming the value and the chapters there are."""
    shutil.copytree(ROOT / "labs", tmp_path / "labs")
    proc = _memlab("labs", "reset", chapter, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"chapter={chapter!r} names no lab; allowed: 00, 01" in line, line
    assert "invalid literal" not in line
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
        if "NN" in path:  # a template such as utils/memlab/course/checks/chNN.py
            continue
        assert (ROOT / path).exists(), f"CONTRIBUTING.md names {path}, which does not exist"
    assert "DESIGN` in the README" not in text


# ----------------------------------------------------------------------------- hostile estimator / planner input
def _rc(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's refusal
        return int(exc.code)


@pytest.mark.parametrize("argv,needle", [
    (["--world-size", "100000", "--zero-stage", "3"], "--world-size: '100000' is too large"),
    (["--set", "num_hidden_layers=1000000000"], "num_hidden_layers=1000000000 is invalid"),
    (["--batch-size", "99999999999999999999999"], "--batch-size: '99999999999999999999999' is too large"),
    (["--set", "num_attention_heads=0"], "num_attention_heads=0 is invalid"),
    (["--set", "hidden_size=100", "--set", "num_attention_heads=3"], "hidden_size=100 is not divisible by num_attention_heads=3"),
    (["--set", "hidden_size=-5"], "hidden_size=-5 is invalid"),
    (["--set", "hidden_size=big"], "hidden_size='big' is invalid"),
    (["--set", "vocab_size=0"], "vocab_size=0 is invalid"),
    (["--set", "num_key_value_heads=3"], "num_key_value_heads=3 does not divide num_attention_heads=14"),
])
def test_estimate_refuses_hostile_sizes_in_one_line_before_any_work(argv, needle, capsys):
    import time

    from memlab.cli.estimate import main

    t0 = time.monotonic()
    assert _rc(main, ["qwen2.5-0.5b", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and "Traceback" not in "\n".join(err), err
    assert time.monotonic() - t0 < 20


def test_config_files_are_read_with_a_limit(tmp_path):
    from memlab.estimate import load_config
    from memlab.estimate.recipes import MAX_CONFIG_BYTES

    with pytest.raises(ValueError, match=r"'/dev/zero' is not a regular file"):
        load_config("/dev/zero")
    big = tmp_path / "config.json"
    big.write_text(" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match="larger than 4 MiB"):
        load_config(big)
    cfg = tmp_path / "c.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 0, '
                   '"vocab_size": 10}')
    with pytest.raises(ValueError, match=r"c\.json'?: num_attention_heads=0 is invalid; allowed: an int from 1"):
        load_config(cfg)


def test_plan_bounds_batch_and_finds_divisors_fast(capsys):
    import time

    from memlab.cli.plan import main
    from memlab.plan.search import _divisors

    t0 = time.monotonic()
    assert _divisors(2**20) == [2**k for k in range(21)] and _divisors(1_000_003) == [1, 1_000_003]
    assert _divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert time.monotonic() - t0 < 1
    assert _rc(main, ["qwen2.5-0.5b", "--batch-size", "999999999999999999999999", "--seq-len", "64"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    from memlab.plan import plan

    with pytest.raises(ValueError, match=r"batch_size=1073741824 is invalid; allowed: an int from 1 to 1,048,576"):
        plan("qwen2.5-0.5b", "24GiB", batch_size=2**30, seq_len=64)


# ----------------------------------------------------------------------------- launch(): processes
def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _spawn_grandchildren(rank, world_size, path, fail):
    import os
    import subprocess
    import sys

    a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    with open(f"{path}.{rank}", "w") as f:
        f.write(f"{a.pid} {b.pid}")
    if fail and rank == 0:
        raise RuntimeError("rank 0 fails after starting two processes")
    return os.getpid()


def _rank1_exits(rank, world_size):
    import os

    import torch
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))
    return rank


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc (Linux)")
@pytest.mark.parametrize("fail", [False, True])
def test_launch_leaves_no_grandchildren(tmp_path, fail):
    import time

    from memlab.distributed import RankError, launch

    path = tmp_path / "pids"
    if fail:
        with pytest.raises(RankError, match="rank 0 fails"):
            launch(_spawn_grandchildren, 2, str(path), fail, timeout=60)
    else:
        launch(_spawn_grandchildren, 2, str(path), fail, timeout=60)
    pids = [int(p) for r in range(2) if Path(f"{path}.{r}").exists() for p in Path(f"{path}.{r}").read_text().split()]
    assert pids
    end = time.monotonic() + 5
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "a process started by a rank outlived launch()"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork (Linux)")
def test_launch_blames_the_rank_that_died_and_refuses_an_infinite_timeout():
    from memlab.distributed import RankError, launch

    with pytest.raises(RankError, match=r"rank 1 of 2 died without a result: it exited with code 3") as info:
        launch(_rank1_exits, 2, timeout=60)
    assert info.value.rank == 1
    for bad in (float("inf"), float("nan"), 0, -1, 1e12, True):
        with pytest.raises(ValueError, match=r"timeout=.* is invalid; allowed: a finite number of seconds"):
            launch(_rank1_exits, 2, timeout=bad)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork (Linux)")
def test_launch_kills_started_ranks_when_a_later_rank_cannot_start(monkeypatch):
    import multiprocessing.process as mpp
    import time

    from memlab.distributed import launch

    real_start, started = mpp.BaseProcess.start, []

    def start(self):
        if started:
            raise OSError(11, "Resource temporarily unavailable (fork)")
        real_start(self)
        started.append(self.pid)

    monkeypatch.setattr(mpp.BaseProcess, "start", start)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        launch(_rank1_exits, 2, timeout=60)
    end = time.monotonic() + 5
    while time.monotonic() < end and _alive(started[0]):
        time.sleep(0.05)
    assert not _alive(started[0])
