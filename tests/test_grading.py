"""The grader: statuses, time limits, survival of a learner's worst code, memlab grade."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import nbformat
import pytest

from memlab import accounting
from memlab.grading import CheckResult, check, format_table, get_exercise, grade_notebook, time_limit, CheckTimeout

EX = "00.activation_bytes"


def test_pass_records_and_prints(capsys):
    r = check(EX, accounting.activation_bytes_per_layer)
    assert isinstance(r, CheckResult)
    assert (r.exercise, r.status, r.points, r.max_points) == (EX, "pass", 1.0, 1.0)
    out = capsys.readouterr().out
    assert "PASS" in out and EX in out and "1/1" in out


def test_fail_names_expected_value():
    r = check(EX, lambda s, b, h, a, **kw: 34 * s * b * h, quiet=True)
    assert r.status == "fail" and r.points == 0
    assert "expected 956301312" in r.message


def test_todo_from_stub():
    def stub(*args, **kwargs):
        raise NotImplementedError("exercise 00.activation_bytes: replace this line with your code")

    r = check(EX, stub, quiet=True)
    assert r.status == "todo" and "00.activation_bytes" in r.message


def test_torch_not_implemented_is_an_error_not_a_todo():
    def uses_missing_kernel(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::foo' with arguments from the 'CPU' backend.")

    assert check(EX, uses_missing_kernel, quiet=True).status == "error"


def test_error_shows_learner_frame():
    def buggy(s, b, h, a, **kw):
        table = {}
        return table[s]  # the learner's line

    r = check(EX, buggy, quiet=True)
    assert r.status == "error"
    assert "KeyError" in r.message and "buggy" in r.message and "table[s]" in r.message


def test_timeout_in_main_thread_and_caller_survives():
    def forever(*args, **kwargs):
        while True:
            pass

    t0 = time.perf_counter()
    r = check(EX, forever, timeout=0.5, quiet=True)
    assert r.status == "timeout" and time.perf_counter() - t0 < 5
    # the alarm is disarmed afterwards: a later slow-ish call is not interrupted
    time.sleep(0.7)
    assert check(EX, accounting.activation_bytes_per_layer, quiet=True).status == "pass"


def test_timeout_cannot_be_swallowed_by_except_exception():
    def stubborn(*args, **kwargs):
        while True:
            try:
                while True:
                    pass
            except Exception:
                continue

    assert check(EX, stubborn, timeout=0.3, quiet=True).status == "timeout"


def test_timeout_off_the_main_thread():
    box = {}

    def run():
        box["r"] = check(EX, lambda *a, **k: [None for _ in iter(int, 1)], timeout=0.5, quiet=True)

    th = threading.Thread(target=run)
    th.start()
    th.join(10)
    assert not th.is_alive() and box["r"].status == "timeout"


def test_time_limit_passes_through_fast_code():
    with time_limit(5):
        x = sum(range(1000))
    assert x == 499500
    with pytest.raises(CheckTimeout):
        with time_limit(0.2):
            while True:
                pass


def test_unknown_exercise_lists_known():
    with pytest.raises(ValueError, match="00.activation_bytes"):
        check("00.no_such_thing", print)
    with pytest.raises(ValueError, match="NN.name"):
        check("activation", print)


def test_results_file(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    monkeypatch.setenv("MEMLAB_GRADE_RESULTS", str(path))
    check(EX, accounting.activation_bytes_per_layer, quiet=True)
    assert '"status": "pass"' in path.read_text()


def test_table_totals():
    rows = [CheckResult("00.a", "pass", 1, 1), CheckResult("00.b", "todo", 0, 2, "stub")]
    text = format_table("lab", rows)
    assert "1/3" in text and "TODO" in text


# ---------------------------------------------------------------- memlab grade on a hostile notebook
def _nb(cells: list[str]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    return nb


HOSTILE = [
    "from memlab.grading import check\nfrom memlab import accounting",
    # pass
    "check('00.activation_bytes', accounting.activation_bytes_per_layer)",
    # todo
    "def model_state_bytes(n, recipe):\n    raise NotImplementedError('exercise 00.model_state_bytes: replace this line')",
    "check('00.model_state_bytes', model_state_bytes)",
    # error inside the learner's function
    "def optimizer_state_bytes(opt):\n    return opt.nope",
    "check('00.optimizer_state_bytes', optimizer_state_bytes)",
    # infinite loop inside the function: timeout, and the next cells still run
    "def saved_bytes(fn, *args):\n    while True:\n        pass",
    "check('00.saved_bytes', saved_bytes)",
]


def test_grade_hostile_notebook(tmp_path):
    path = tmp_path / "hostile.ipynb"
    nbformat.write(_nb(HOSTILE), path)
    results = {r.exercise: r for r in grade_notebook(path, timeout=8)}  # generous: a loaded CI box is slow
    assert [results[k].status for k in ("00.activation_bytes", "00.model_state_bytes", "00.optimizer_state_bytes", "00.saved_bytes")] == [
        "pass", "todo", "error", "timeout"]
    assert "AttributeError" in results["00.optimizer_state_bytes"].message


def test_grade_survives_a_dead_kernel_and_a_broken_cell(tmp_path):
    cells = [
        "from memlab.grading import check\nfrom memlab import accounting",
        "check('00.activation_bytes', accounting.activation_bytes_per_layer)",
        "this is not python",
        "check('00.model_state_bytes', model_state_bytes)",  # NameError: its definition cell broke
        "import os\nos._exit(3)",  # the kernel dies
        "check('00.saved_bytes', accounting.saved_activation_bytes)",
    ]
    path = tmp_path / "crash.ipynb"
    nbformat.write(_nb(cells), path)
    results = {r.exercise: r for r in grade_notebook(path, timeout=5)}
    assert results["00.activation_bytes"].status == "pass"
    assert results["00.model_state_bytes"].status == "error" and "NameError" in results["00.model_state_bytes"].message
    assert results["00.saved_bytes"].status == "error" and "kernel died" in results["00.saved_bytes"].message


def test_cli_grade_exit_codes(tmp_path):
    good = tmp_path / "good.ipynb"
    nbformat.write(_nb(HOSTILE[:2]), good)
    bad = tmp_path / "bad.ipynb"
    nbformat.write(_nb(HOSTILE[:4]), bad)
    memlab = [sys.executable, "-m", "memlab", "grade"]
    ok = subprocess.run(memlab + [str(good)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "total" in ok.stdout and "1/1" in ok.stdout
    ko = subprocess.run(memlab + [str(bad)], capture_output=True, text=True, timeout=300)
    assert ko.returncode == 1 and "TODO" in ko.stdout and "1/2" in ko.stdout
    missing = subprocess.run(memlab + [str(tmp_path / "nope.ipynb")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nope.ipynb" in missing.stderr


def test_every_exercise_has_a_reference():
    from memlab.grading import load_all

    for ex_id, ex in load_all().items():
        assert ex.reference is not None, f"{ex_id} has no reference implementation"
        assert get_exercise(ex_id) is ex
