"""The grader: statuses, time limits, survival of a learner's worst code, memlab grade.

Hostile and careless notebooks (forgery, deleted check cells, hangs, crashes) are in
test_grading_hostile.py."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from memlab import accounting
from memlab.course.grading import CheckResult, CheckTimeout, check, format_table, get_exercise, grade_notebook, load_all, time_limit

EX = "00.activation_bytes"


def mine(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):  # the learner's own function
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    return s * b * h * (16 * e + 2 * m) + a * s * s * b * ((2 * e + m) if m else e)  # no dropout: softmax kept once


def test_pass_records_and_prints(capsys):
    r = check(EX, mine)
    assert isinstance(r, CheckResult)
    assert (r.exercise, r.status, r.points, r.max_points) == (EX, "pass", 1.0, 1.0)
    out = capsys.readouterr().out
    assert "PASS" in out and EX in out and "1/1" in out
    assert out.count("\n") == 1  # one line, as in JupyterLab


def test_reference_implementation_is_flagged_with_no_points():
    r = check(EX, accounting.activation_bytes_per_layer, quiet=True)
    assert r.status == "pass" and r.points == 0
    assert "uses the reference implementation" in r.message and "activation_bytes_per_layer" in r.message
    from memlab.course.reference.ch01 import LiveBytes

    class Mine(LiveBytes):  # a subclass is memlab's code too
        pass

    r = check("01.live_bytes", Mine, quiet=True)
    assert r.points == 0 and "uses the reference implementation" in r.message


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
    assert check(EX, mine, quiet=True).status == "pass"


def test_keyboard_interrupt_is_an_error_not_a_timeout():
    def interrupts(*args, **kwargs):
        raise KeyboardInterrupt

    t0 = time.perf_counter()
    r = check(EX, interrupts, timeout=30, quiet=True)
    assert r.status == "error" and "KeyboardInterrupt" in r.message and time.perf_counter() - t0 < 5


def test_sys_exit_and_hostile_exceptions_are_rows():
    def exits(*args, **kwargs):
        raise SystemExit(3)

    class Nasty(Exception):
        def __str__(self):
            raise RuntimeError("no")

    def nasty(*args, **kwargs):
        raise Nasty()

    assert check(EX, exits, quiet=True).status == "error"
    r = check(EX, nasty, quiet=True)
    assert r.status == "error" and "Nasty" in r.message


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


def _burn(seconds: float) -> None:
    """Spin until this thread has used ``seconds`` of CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def loaded_machine():
    """Three busy processes on top of whatever else runs: a check gets at most half a core of 2."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    time.sleep(0.3)
    yield
    for h in hogs:
        h.kill()
        h.wait()


def test_time_limit_counts_the_checks_cpu_time_not_the_wall_clock(loaded_machine):
    # 0.6 s of CPU under a 1 s limit takes well over 1 s of wall-clock time on this loaded machine: it passes
    t0, c0 = time.monotonic(), time.thread_time()
    with time_limit(1.0):
        _burn(0.6)
        time.sleep(0.5)  # waiting is not CPU time either
    wall, cpu = time.monotonic() - t0, time.thread_time() - c0
    assert wall > 1.0 > cpu, (wall, cpu)
    # a correct answer that is slow to compute passes under load, off the main thread too
    def slow_mine(*args, **kwargs):
        _burn(0.02)
        return mine(*args, **kwargs)

    r = check(EX, slow_mine, timeout=5, quiet=True)
    assert r.status == "pass", r
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", check(EX, slow_mine, timeout=5, quiet=True)))
    th.start()
    th.join(60)
    assert box["r"].status == "pass", box["r"]
    # an infinite loop still ends as a timeout, within a few seconds of wall clock even under load
    t0 = time.monotonic()
    r = check(EX, lambda *a, **k: [None for _ in iter(int, 1)], timeout=0.5, quiet=True)
    assert r.status == "timeout" and "CPU time" in r.message and time.monotonic() - t0 < 5 + 0.5 * 10, r


def test_time_limit_has_a_wall_clock_backstop():
    # a check that sleeps uses no CPU: the backstop (wall_factor x the limit) ends it
    t0 = time.monotonic()
    with pytest.raises(CheckTimeout, match="wall-clock"):
        with time_limit(0.2, wall_factor=5):
            time.sleep(30)
    assert time.monotonic() - t0 < 3


def test_unknown_exercise_is_an_error_row_listing_known():
    r = check("00.no_such_thing", print, quiet=True)
    assert r.status == "error" and r.max_points == 0 and "00.activation_bytes" in r.message
    r = check("activation", print, quiet=True)
    assert r.status == "error" and "NN.name" in r.message
    assert check(None, print, quiet=True).status == "error"  # type: ignore[arg-type]


def test_bad_check_timeout_env_is_a_row_naming_it(monkeypatch):
    monkeypatch.setenv("MEMLAB_CHECK_TIMEOUT", "abc")
    r = check(EX, mine, quiet=True)
    assert r.status == "error" and "MEMLAB_CHECK_TIMEOUT='abc'" in r.message
    monkeypatch.setenv("MEMLAB_CHECK_TIMEOUT", "2.5")
    assert check(EX, mine, quiet=True).status == "pass"


def test_no_results_file_is_written(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    monkeypatch.setenv("MEMLAB_GRADE_RESULTS", str(path))
    check(EX, mine, quiet=True)
    assert not path.exists()  # the grader computes results itself: there is no channel to forge


def test_parse_seconds_rejects_nan_inf_and_non_positive():
    from memlab.course.grading import parse_seconds

    assert parse_seconds("--timeout", "1.5") == 1.5
    for bad in ("nan", "inf", "-inf", "0", "-3", "abc", None, True):
        with pytest.raises(ValueError, match="--timeout"):
            parse_seconds("--timeout", bad)


def test_fingerprint_is_stable_and_per_chapter():
    from memlab.course.grading import chapter_fingerprint

    a = chapter_fingerprint("00")
    assert len(a) == 64 and a == chapter_fingerprint("00") and a != chapter_fingerprint("01")


def test_kernel_side_rejects_other_checks():
    """Inside the kernel, a fingerprint that differs from the grader's is an error, and memlab's
    modules are put back as they were."""
    import sys

    from memlab.course.grading import inkernel
    from memlab.course.grading.running import MEMLAB_DIR

    before = {k: v for k, v in sys.modules.items() if k == "memlab" or k.startswith("memlab.")}
    args = {"chapter": "00", "fingerprint": "0" * 64, "nonce": "n", "dir": MEMLAB_DIR}
    out = inkernel.prepare(args, dict(before))
    assert out["ok"] is False and "fingerprint" in out["message"]
    assert all(sys.modules[k] is v for k, v in before.items())


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
    "from memlab.course.grading import check\nfrom memlab import accounting",
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


def _solution(name: str) -> str:
    """The course's own solution of ``name`` from solutions/00 (learner code, not a call of memlab's reference)."""
    path = Path(__file__).resolve().parents[2] / "solutions" / "00_where_the_memory_goes.ipynb"
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code" and f"def {name}(" in cell.source:
            return cell.source
    raise LookupError(name)


SOLVED_00 = [
    "from memlab.course.grading import check\nimport torch\nfrom torch import nn\nfrom memlab.models import TinyGPT",
    _solution("model_state_bytes"),
    "check('00.model_state_bytes', model_state_bytes)",
    _solution("optimizer_state_bytes"),
    "check('00.optimizer_state_bytes', optimizer_state_bytes)",
    _solution("activation_bytes_per_layer"),
    "check('00.activation_bytes', activation_bytes_per_layer)",
    _solution("saved_bytes"),
    "check('00.saved_bytes', saved_bytes)",
    _solution("predict_peak"),
    "check('00.predict_peak', predict_peak)",
]


def _memlab(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "memlab", "grade", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_cli_grade_exit_codes(tmp_path):
    good = tmp_path / "good.ipynb"
    nbformat.write(_nb(SOLVED_00), good)
    bad = tmp_path / "bad.ipynb"
    nbformat.write(_nb(HOSTILE[:4]), bad)
    ok = _memlab(str(good))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    n00 = sum(e.startswith("00.") for e in load_all())
    assert "total" in ok.stdout and f"{n00}/{n00}" in ok.stdout
    assert "TCP" not in ok.stderr and "encryption" not in ok.stderr, ok.stderr  # ipc transport: no warning
    ko = _memlab(str(bad))
    assert ko.returncode == 1 and "TODO" in ko.stdout and "MISSING" in ko.stdout
    assert "uses the reference implementation" in ko.stdout and f"0/{n00}" in ko.stdout  # memlab's own answer earns nothing
    missing = _memlab(str(tmp_path / "nope.ipynb"), timeout=60)
    assert missing.returncode == 2 and "nope.ipynb" in missing.stderr


@pytest.mark.parametrize("flag", ["--timeout", "--cell-timeout", "--notebook-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "abc"])
def test_cli_rejects_bad_time_limits_in_one_line(flag, value):
    import contextlib
    import io

    from memlab.course.grading import grade_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = grade_main([f"{flag}={value}", "labs/00_where_the_memory_goes.ipynb"])
    assert rc == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and repr(value) in lines[0], err.getvalue()


@pytest.mark.parametrize("var,value", [("MEMLAB_CHECK_TIMEOUT", "abc"), ("MEMLAB_CHECK_TIMEOUT", "nan"),
                                       ("MEMLAB_DEVICE", "tpu9"), ("MEMLAB_SMALL", "maybe")])
def test_cli_names_a_bad_environment_variable(var, value):
    r = _memlab("labs/00_where_the_memory_goes.ipynb", env={var: value}, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{var}={value!r}" in lines[0], r.stderr


def test_every_exercise_has_a_reference():
    from memlab.course.grading import load_all

    for ex_id, ex in load_all().items():
        assert ex.reference is not None, f"{ex_id} has no reference implementation"
        assert get_exercise(ex_id) is ex


def test_check_calls_read_from_the_notebook():
    from memlab.course.grading import check_calls

    cells = ['check(\n    "00.a",\n    f)', '# check("00.b", g)', 'r = check("00.c", mod.fn, timeout=3)',
             'check("00.d", lambda: 1)', 'check("typo", f)']
    calls = check_calls(_nb(cells))
    assert [(c.exercise, c.name, c.cell) for c in calls] == [
        ("00.a", "f", 0), ("00.c", "mod.fn", 2), ("00.d", None, 3), ("typo", "f", 4)]


def test_expect_equal_compares_exact_types_through_the_reference():
    import collections

    import torch

    from memlab.course.checks import expect_close, expect_equal, same_value

    class Yes(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    assert not same_value(Yes("x"), "parameters") and not same_value(True, 1) and not same_value(1.0, 1)
    assert same_value(1, 1.0)  # an int is an acceptable float, never the other way round
    assert same_value(collections.defaultdict(int, a=1), {"a": 1})  # the standard library's dicts count
    assert not same_value({Yes("a"): 1}, {"a": 1})  # keys through the reference's type too
    assert not same_value((1, 2), [1, 2]) and same_value([1, (2, "x")], [1, (2, "x")])

    class Liar(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return True

    assert same_value(torch.nn.Parameter(torch.ones(2)), torch.ones(2))
    assert not same_value(torch.ones(2).as_subclass(Liar), torch.zeros(2))
    with pytest.raises(AssertionError, match=r"x\['a'\]: expected an int, got float"):
        expect_equal("x", {"a": 1.0}, {"a": 1})
    with pytest.raises(AssertionError, match="expected a number"):
        expect_close("y", "0.5", 0.5)
    with pytest.raises(AssertionError, match=r"\.item\(\)"):
        expect_close("y", torch.tensor(0.5), 0.5)


# ---------------------------------------------------------------- every memlab module
def _every_memlab_module() -> list[str]:
    """Every module of the installed memlab, found by walking the package (new sub-packages included)."""
    import pkgutil

    import memlab

    return sorted(info.name for info in pkgutil.walk_packages(memlab.__path__, "memlab.")
                  if not info.name.endswith("__main__"))


def test_verify_covers_every_memlab_module(monkeypatch):
    """With every memlab module imported, verify_memlab_modules finds nothing
    wrong; replacing a top-level function of any of them is found, naming it."""
    import importlib
    import sys
    import types

    from memlab.course.grading import is_grader_module, verify_memlab_modules

    names = _every_memlab_module()
    assert "memlab.course.grading.verify" in names and "memlab.core.units" in names
    imported = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency this environment lacks
            continue
        imported.append(name)
    assert verify_memlab_modules() == ""
    patched = 0
    for name in imported:
        mod = sys.modules[name]
        if mod.__name__ != name or is_grader_module(name):
            continue  # the grader's own modules are re-imported fresh instead
        fname = next((k for k, v in sorted(vars(mod).items()) if isinstance(v, types.FunctionType)
                      and v.__module__ == name and v.__name__ == k and not k.startswith("__")), None)
        if fname is None:
            continue
        with monkeypatch.context() as m:
            m.setattr(mod, fname, lambda *a, **k: None)
            assert f"{name}.{fname}" in verify_memlab_modules(), name
        patched += 1
    assert verify_memlab_modules() == "" and patched > 20


def test_verify_refuses_a_module_name_holding_another_module(monkeypatch):
    """A name in sys.modules that holds another memlab module is found."""
    import sys

    import memlab.core.gpus  # noqa: F401
    from memlab import accounting
    from memlab.course.grading import verify_memlab_modules

    assert verify_memlab_modules() == ""
    monkeypatch.setitem(sys.modules, "memlab.core.gpus", accounting)
    assert "memlab.core.gpus" in verify_memlab_modules()


def test_grading_leaves_no_hypothesis_folder_in_the_learners_directory(tmp_path, monkeypatch):
    """hypothesis caches (its unicode tables, the constants it collects) in ./.hypothesis: a learner's
    labs folder gained one at every grading. The harness points it at the temporary directory."""
    from memlab import quant
    from memlab.course.grading import check

    monkeypatch.chdir(tmp_path)
    r = check("06.pack_nibbles", quant.pack_nibbles, quiet=True)
    assert r.status == "pass", r.message
    assert not (tmp_path / ".hypothesis").exists()
