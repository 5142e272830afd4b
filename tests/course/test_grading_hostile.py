"""memlab grade against a hostile or careless learner (issue 9).

Each test runs one small notebook in a real kernel: forged results, tampered checks, deleted
check cells, an always-equal ``int``, loops that swallow every interrupt, crashes, processes
left running, corrupt files. The grade must not move, every row must say what happened, the
run must end within its deadline, and nothing the notebook started may outlive it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from memlab.course.grading import CHECK_GRACE, KILL_GRACE, check, grade_notebook

from memlab.course.grading import load_all as _load_all

N_00 = sum(e.startswith("00.") for e in _load_all())  # exercises of chapter 00, from its registry

SETUP = ("from memlab.course.grading import check\nfrom memlab import accounting\nimport torch\nfrom torch import nn\n"
         "from memlab.models import TinyGPT")
_SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions" / "00_where_the_memory_goes.ipynb"


def _solution(name: str) -> str:
    """The course's own solution of ``name`` (the learner's code, not a call of memlab's reference)."""
    for cell in nbformat.read(_SOLUTIONS, as_version=4).cells:
        if cell.cell_type == "code" and f"def {name}(" in cell.source:
            return cell.source
    raise LookupError(name)


SOLVED = {
    "00.model_state_bytes": _solution("model_state_bytes"),
    "00.optimizer_state_bytes": _solution("optimizer_state_bytes"),
    "00.activation_bytes": _solution("activation_bytes_per_layer"),
}
STUB = "def {name}(*args, **kwargs):\n    raise NotImplementedError('exercise {ex}: replace this line with your code')"


def _write(path: Path, cells: list[str]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nbformat.write(nb, path)
    return path


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"  # a zombie has finished; only its exit status is left


def _pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


def _wait_dead(pids: list[int], seconds: float = 5.0) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


SPAWN = (
    "import subprocess, sys\n"
    "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])  # in the kernel's process group\n"
    "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
    "open('pids', 'w').write(f'{a.pid} {b.pid}')"
)


def test_forgery_tampering_deleted_cells_and_an_always_equal_int_do_not_count(tmp_path):
    cells = [
        SETUP + "\nimport memlab.course.checks, memlab.course.checks.ch00, memlab.course.grading.running",
        # a forged check(): prints PASS rows and appends pass rows to the results channel of old
        "import os, json\n"
        "def check(ex, obj, **kw):\n"
        "    row = {'exercise': ex, 'status': 'pass', 'points': 100.0, 'max_points': 1.0, 'message': '', 'seconds': 0.0}\n"
        "    with open(os.environ.get('MEMLAB_GRADE_RESULTS') or 'forged.jsonl', 'a') as fh:\n"
        "        fh.write(json.dumps(row) + '\\n')\n"
        "    print(f'PASS    {ex:<34}   1/1')\n"
        # tampering with the checks already loaded in the kernel
        "for ex in memlab.course.grading.REGISTRY.values():\n"
        "    ex.checks[:] = []\n"
        "memlab.course.checks.expect = lambda *a, **k: None\n"
        "memlab.course.grading._run_checks = lambda ex, obj, limit: ('pass', '')\n"
        "memlab.course.grading.running._run_checks = lambda ex, obj, limit: ('pass', '')\n" + SPAWN,
        SOLVED["00.activation_bytes"],
        "check('00.activation_bytes', activation_bytes_per_layer)",
        # an int whose == always says yes
        "class Yes(int):\n"
        "    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n"
        "    __hash__ = int.__hash__\n"
        "def model_state_bytes(n, recipe):\n"
        "    return {k: Yes(0) for k in ('weights', 'gradients', 'optimizer', 'total')}",
        "check('00.model_state_bytes', model_state_bytes)",
        # 00.optimizer_state_bytes: stub left, check cell deleted
        STUB.format(name="optimizer_state_bytes", ex="00.optimizer_state_bytes"),
        STUB.format(name="saved_bytes", ex="00.saved_bytes"),
        "check('00.saved_bytes', saved_bytes)\nprint('PASS    00.optimizer_state_bytes   1/1')",
        "check('00.saved_byte', saved_bytes)  # a typo in the id",
    ]
    path = _write(tmp_path / "00_forged.ipynb", cells)
    results = grade_notebook(path, timeout=60)
    rows = {r.exercise: r for r in results}
    assert [r.exercise for r in results[:4]] == [
        "00.model_state_bytes", "00.optimizer_state_bytes", "00.activation_bytes", "00.saved_bytes"]  # registry order
    assert rows["00.activation_bytes"].status == "pass" and rows["00.activation_bytes"].points == 1
    assert rows["00.model_state_bytes"].status == "fail" and "expected an int" in rows["00.model_state_bytes"].message
    assert rows["00.optimizer_state_bytes"].status == "missing" and rows["00.optimizer_state_bytes"].points == 0
    assert rows["00.saved_bytes"].status == "todo"
    assert rows["00.saved_byte"].status == "error" and rows["00.saved_byte"].max_points == 0
    assert "not a known exercise" in rows["00.saved_byte"].message
    assert sum(r.points for r in results) == 1 and sum(r.max_points for r in results) == N_00
    assert (tmp_path / "forged.jsonl").exists()  # the forgery ran, and changed nothing
    assert not _wait_dead(_pids(tmp_path / "pids")), "a process the notebook started outlived grading"


def test_bare_except_loop_in_a_check_times_out_within_the_deadline_and_nothing_survives(tmp_path):
    cells = [
        SETUP + "\n" + SPAWN,
        "def activation_bytes_per_layer(*a, **k):\n"
        "    while True:\n"
        "        try:\n"
        "            while True:\n"
        "                pass\n"
        "        except:\n"
        "            pass",
        "check('00.activation_bytes', activation_bytes_per_layer)",
        SOLVED["00.model_state_bytes"],
        "check('00.model_state_bytes', model_state_bytes)",
    ]
    path = _write(tmp_path / "00_loop.ipynb", cells)
    t0 = time.monotonic()
    rows = {r.exercise: r for r in grade_notebook(path, timeout=1)}
    elapsed = time.monotonic() - t0
    assert rows["00.activation_bytes"].status == "timeout", rows["00.activation_bytes"]
    assert "stopped the kernel" in rows["00.activation_bytes"].message
    assert rows["00.model_state_bytes"].status == "not run" and "00.activation_bytes" in rows["00.model_state_bytes"].message
    # the deadline: 1 s limit + grace + kill grace, plus the kernel's start on a loaded machine
    assert elapsed < 1 + CHECK_GRACE + KILL_GRACE + 60, elapsed
    assert not _wait_dead(_pids(tmp_path / "pids")), "a process the notebook started outlived grading"


def test_cells_that_hang_are_interrupted_or_killed_and_say_so(tmp_path):
    cells = [
        "from memlab.course.grading import check  # no torch import here: it could take longer than the cell limit",
        "import time\ntime.sleep(60)  # interrupted: the kernel goes on",
        "def activation_bytes_per_layer(*a, **k):\n    from memlab import accounting\n"
        "    return accounting.activation_bytes_per_layer(*a, **k)",
        "check('00.activation_bytes', activation_bytes_per_layer)",
        STUB.format(name="model_state_bytes", ex="00.model_state_bytes"),
        "time.sleep(60)",
        "check('00.model_state_bytes', model_state_bytes)",
        "while True:\n    try:\n        time.sleep(60)\n    except:\n        pass",  # swallows the interrupt
        "def optimizer_state_bytes(opt):\n    return 0",
        "check('00.optimizer_state_bytes', optimizer_state_bytes)",
        "check('00.saved_bytes', activation_bytes_per_layer)",
    ]
    path = _write(tmp_path / "00_hang.ipynb", cells)
    t0 = time.monotonic()
    rows = {r.exercise: r for r in grade_notebook(path, timeout=20, cell_timeout=3)}
    assert time.monotonic() - t0 < 3 * 3 + KILL_GRACE + 60
    assert rows["00.activation_bytes"].status == "pass", rows["00.activation_bytes"]  # its slow cell was interrupted
    assert rows["00.model_state_bytes"].status == "timeout" and "cell 5 ran past 3 s" in rows["00.model_state_bytes"].message
    assert rows["00.optimizer_state_bytes"].status == "timeout"
    assert "cell 7" in rows["00.optimizer_state_bytes"].message and "ignored the interrupt" in rows["00.optimizer_state_bytes"].message
    assert rows["00.saved_bytes"].status == "not run"


def test_keyboard_interrupt_reference_and_a_crash_each_say_what_happened(tmp_path):
    cells = [
        SETUP,
        "def activation_bytes_per_layer(*a, **k):\n    raise KeyboardInterrupt",
        "check('00.activation_bytes', activation_bytes_per_layer)",
        "check('00.model_state_bytes', accounting.model_state_bytes)",  # memlab's own answer
        "import os\nos._exit(3)",
        SOLVED["00.optimizer_state_bytes"],
        "check('00.optimizer_state_bytes', optimizer_state_bytes)",
        "check('00.saved_bytes', saved_bytes)",
    ]
    path = _write(tmp_path / "00_crash.ipynb", cells)
    rows = {r.exercise: r for r in grade_notebook(path, timeout=30)}
    ki = rows["00.activation_bytes"]
    assert ki.status == "error" and "KeyboardInterrupt" in ki.message and ki.seconds < 10
    ref = rows["00.model_state_bytes"]
    assert ref.status == "pass" and ref.points == 0 and "uses the reference implementation" in ref.message
    crash = rows["00.optimizer_state_bytes"]
    assert crash.status == "error" and "exited with code 3" in crash.message and "cell 4" in crash.message
    assert rows["00.saved_bytes"].status == "not run" and "00.optimizer_state_bytes" in rows["00.saved_bytes"].message


def test_a_segfault_names_the_signal(tmp_path):
    cells = [
        SETUP,
        SOLVED["00.activation_bytes"],
        "check('00.activation_bytes', activation_bytes_per_layer)",
        "import ctypes\nctypes.string_at(0)",
        "check('00.model_state_bytes', model_state_bytes)",
    ]
    path = _write(tmp_path / "00_segv.ipynb", cells)
    rows = {r.exercise: r for r in grade_notebook(path)}
    assert rows["00.activation_bytes"].status == "pass"
    assert rows["00.model_state_bytes"].status == "error" and "SIGSEGV" in rows["00.model_state_bytes"].message
    assert rows["00.optimizer_state_bytes"].status == "missing"


def test_one_bad_notebook_never_stops_the_batch(tmp_path):
    corrupt = tmp_path / "00_corrupt.ipynb"
    corrupt.write_text('{"cells": [ this is not json')
    no_checks = _write(tmp_path / "00_no_checks.ipynb", [SETUP, SOLVED["00.activation_bytes"]])
    one = _write(tmp_path / "00_one.ipynb", [SETUP, SOLVED["00.activation_bytes"],
                                              "check('00.activation_bytes', activation_bytes_per_layer)"])
    rows = grade_notebook(corrupt)
    assert len(rows) == 1 and rows[0].status == "error" and "00_corrupt.ipynb" in rows[0].message
    r = subprocess.run([sys.executable, "-m", "memlab", "grade", str(corrupt), str(no_checks),
                        str(tmp_path / "00_nope.ipynb"), str(one)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "MEMLAB_SMALL": "1"})
    out = r.stdout
    assert r.returncode == 2, out + r.stderr
    corrupt_lines = [ln for ln in out.splitlines() if ln.startswith("ERROR") and "00_corrupt.ipynb" in ln]
    assert len(corrupt_lines) == 1 and "Traceback" not in out + r.stderr
    no_checks_table = out.split(str(no_checks))[1].split("total")[0]
    assert no_checks_table.count("MISSING") == N_00
    assert "00_nope.ipynb" in out and "00_nope.ipynb" in r.stderr
    assert "PASS    00.activation_bytes" in out.split(str(one))[1]  # grading went on after the bad ones
    assert "all labs" in out


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), 0.0, -1.0])
def test_grade_notebook_rejects_bad_limits(tmp_path, limit):
    with pytest.raises(ValueError, match="timeout"):
        grade_notebook(tmp_path / "x.ipynb", timeout=limit)


def test_a_shadow_memlab_next_to_the_notebook_is_refused(tmp_path, monkeypatch):
    # first on the kernel's path however memlab is installed (editable, or on PYTHONPATH as in a checkout)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    (tmp_path / "memlab").mkdir()
    (tmp_path / "memlab" / "__init__.py").write_text("# a learner's own memlab, found first on the kernel's path\n")
    path = _write(tmp_path / "00_shadow.ipynb", ["def f(*a, **k):\n    return 0", "check('00.activation_bytes', f)"])
    rows = {r.exercise: r for r in grade_notebook(path)}
    shadow = rows["00.activation_bytes"]
    assert shadow.status == "error" and "memlab/ folder next to the notebook" in shadow.message, shadow
    assert shadow.points == 0


def test_the_notebook_deadline_holds(tmp_path):
    cells = [
        "from memlab.course.grading import check",
        "import time\ntime.sleep(120)",
        "def f(*a, **k):\n    return 0",
        "check('00.activation_bytes', f)",
        "check('00.model_state_bytes', f)",
    ]
    path = _write(tmp_path / "00_slow.ipynb", cells)
    t0 = time.monotonic()
    rows = {r.exercise: r for r in grade_notebook(path, notebook_timeout=10)}
    assert time.monotonic() - t0 < 10 + KILL_GRACE + 30
    assert rows["00.activation_bytes"].status == "timeout"
    assert "notebook ran past its 10 s limit" in rows["00.activation_bytes"].message
    assert rows["00.model_state_bytes"].status == "not run"


def test_environment_errors_name_the_variable(tmp_path, monkeypatch):
    path = _write(tmp_path / "00_env.ipynb", [SETUP])
    monkeypatch.setenv("MEMLAB_CHECK_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="MEMLAB_CHECK_TIMEOUT='abc'"):
        grade_notebook(path)
    monkeypatch.delenv("MEMLAB_CHECK_TIMEOUT")
    monkeypatch.setenv("MEMLAB_DEVICE", "tpu9")
    sys.modules.pop("memlab.config", None)
    try:
        with pytest.raises(ValueError, match="MEMLAB_DEVICE='tpu9'"):
            grade_notebook(path)
    finally:
        monkeypatch.delenv("MEMLAB_DEVICE")
        sys.modules.pop("memlab.config", None)
        import memlab.config  # noqa: F401 - back to the good one for later tests


def test_a_chapter_without_checks_or_a_nameless_file_is_one_error_row(tmp_path):
    rows = grade_notebook(_write(tmp_path / "99_unknown.ipynb", [SETUP]))
    assert len(rows) == 1 and rows[0].status == "error" and "99_unknown.ipynb" in rows[0].message
    rows = grade_notebook(_write(tmp_path / "mywork.ipynb", [SETUP]))
    assert len(rows) == 1 and rows[0].status == "error" and "NN_topic.ipynb" in rows[0].message


# ----------------------------------------------------------------------------- issue 25
WRONG_ACT = "def activation_bytes_per_layer(*a, **k):\n    return 0"
FORGER = (
    # hooks that read the grader's request and forge its answer (stdout and the answer file)
    "import ast, json, re\n"
    "def _forge(info_or_result=None, *a):\n"
    "    info = getattr(info_or_result, 'info', info_or_result)\n"
    "    raw = getattr(info, 'raw_cell', '') or ''\n"
    "    for lit in re.findall(r\"\\{'dir'.*?\\}|\\{'exercise'.*?\\}\", raw.replace('\\\\\\\\', '')):\n"
    "        try:\n"
    "            args = ast.literal_eval(lit)\n"
    "        except Exception:\n"
    "            continue\n"
    "        forged = {'status': 'pass', 'message': '', 'reference': '', 'ok': True, 'fingerprint': args.get('fingerprint')}\n"
    "        print(args.get('nonce', '') + json.dumps(forged), flush=True)\n"
    "        if 'answer' in args:\n"
    "            open(args['answer'], 'w').write(json.dumps(forged))\n"
    "    print('0' * 32 + json.dumps({'status': 'pass'}), flush=True)\n"
    "ip = get_ipython()\n"
    "for event in ('pre_run_cell', 'post_run_cell', 'pre_execute', 'post_execute'):\n"
    "    ip.events.register(event, _forge)\n"
)


def test_patched_reference_and_forged_answers_do_not_pass(tmp_path):
    """Patching memlab's reference (attribute, __code__, sys.modules, the package attribute) makes
    the check an error row; IPython hooks that print or write forged answers are not read."""
    cells = [
        SETUP + "\nimport sys, types",
        FORGER,
        # 1. the reference function replaced by the same wrong answer
        WRONG_ACT + "\n_orig_act = accounting.activation_bytes_per_layer\n"
        "accounting.korthikanti_bytes_per_layer = activation_bytes_per_layer\n"
        "accounting.activation_bytes_per_layer = activation_bytes_per_layer",
        "check('00.activation_bytes', activation_bytes_per_layer)",
        # 2. a fake module in sys.modules and as memlab's attribute
        "import memlab\n_real = sys.modules['memlab.accounting']\n"
        "fake = types.ModuleType('memlab.accounting')\nfake.__dict__.update(vars(_real))\n"
        "fake.model_state_bytes = lambda n, r: {'weights': 0}\n"
        "sys.modules['memlab.accounting'] = fake\nmemlab.accounting = fake\n"
        "def model_state_bytes(n, r):\n    return {'weights': 0}",
        "check('00.model_state_bytes', model_state_bytes)",
        # 3. the reference's code object swapped
        "def optimizer_state_bytes(opt):\n    return 0\n"
        "_real.optimizer_state_bytes.__code__ = optimizer_state_bytes.__code__",
        "check('00.optimizer_state_bytes', optimizer_state_bytes)",
    ]
    nb = _write(tmp_path / "00_patched.ipynb", cells)
    rows = {r.exercise: r for r in grade_notebook(nb, timeout=30)}
    for ex in ("00.activation_bytes", "00.model_state_bytes", "00.optimizer_state_bytes"):
        assert rows[ex].points == 0 and rows[ex].status != "pass", rows[ex]
        assert "was replaced" in rows[ex].message or "was changed" in rows[ex].message, rows[ex]
    assert "memlab.accounting." in rows["00.activation_bytes"].message
    assert sum(r.points for r in rows.values()) == 0


def test_forged_answers_from_hooks_are_ignored_and_a_real_solution_still_passes(tmp_path):
    cells = [SETUP, FORGER, WRONG_ACT, "check('00.activation_bytes', activation_bytes_per_layer)",
             SOLVED["00.model_state_bytes"], "check('00.model_state_bytes', model_state_bytes)"]
    nb = _write(tmp_path / "00_forged.ipynb", cells)
    rows = {r.exercise: r for r in grade_notebook(nb, timeout=30)}
    assert rows["00.activation_bytes"].status == "fail" and rows["00.activation_bytes"].points == 0, [str(r) for r in rows.values()]
    assert rows["00.model_state_bytes"].status == "pass" and rows["00.model_state_bytes"].points == 1


@pytest.mark.parametrize("wrapper", [
    "model_state_bytes = lambda n, r: accounting.model_state_bytes(n, r)",
    "import functools\nmodel_state_bytes = functools.partial(accounting.model_state_bytes)",
    "def model_state_bytes(n, r):\n    return dict(accounting.model_state_bytes(n, r))",
    "def model_state_bytes(n, r):\n    return list(map(accounting.model_state_bytes, [n], [r]))[0]",
    "import functools\n@functools.lru_cache(None)\ndef _m(n, r):\n    return accounting.model_state_bytes(n, r)\n"
    "def model_state_bytes(n, r):\n    return _m(n, r)",
    "class _C:\n    def __call__(self, n, r):\n        f = getattr(accounting, 'model_' + 'state_bytes')\n        return f(n, r)\n"
    "model_state_bytes = _C()",
])
def test_answers_that_delegate_to_the_reference_are_flagged_however_wrapped(wrapper):
    from memlab import accounting

    ns: dict = {"accounting": accounting}
    exec(compile(wrapper, "<notebook cell>", "exec"), ns)
    r = check("00.model_state_bytes", ns["model_state_bytes"], quiet=True)
    assert r.status == "pass" and r.points == 0, r
    assert "reference implementation" in r.message and "model_state_bytes" in r.message


def test_an_own_solution_that_uses_other_memlab_helpers_is_not_flagged():
    ns: dict = {}
    exec(compile(SOLVED["00.model_state_bytes"], "<notebook cell>", "exec"), ns)
    r = check("00.model_state_bytes", ns["model_state_bytes"], quiet=True)
    assert r.status == "pass" and r.points == 1 and r.message == "", r


def test_predictions_must_be_exactly_int_or_float():
    import numpy as np

    class Sneaky(float):
        """A float whose value is read from the check's own measurement."""

        def __float__(self):
            import sys
            f = sys._getframe(1)
            while f is not None and "measured" not in f.f_locals:
                f = f.f_back
            return float(f.f_locals["measured"]) if f is not None else 1.0

        def __gt__(self, other):
            return True

    for value in (Sneaky(1.0), True, np.float64(1e6), np.int64(10**6)):
        r = check("00.predict_peak", lambda cfg, b, s, v=value: v, quiet=True)
        assert r.status == "fail" and r.points == 0 and type(value).__name__ in r.message, (value, r)


@pytest.mark.parametrize("flag", ["--timeout", "--cell-timeout", "--notebook-timeout"])
def test_huge_time_limits_are_refused_where_they_are_parsed(flag, capsys, monkeypatch):
    from memlab.course.grading import MAX_SECONDS, grade_main, parse_seconds

    assert grade_main([flag, "1e12", "labs/00_where_the_memory_goes.ipynb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "1e12" in err[0] and "<= 604800" in err[0], err
    assert parse_seconds("t", MAX_SECONDS) == MAX_SECONDS
    monkeypatch.setenv("MEMLAB_CHECK_TIMEOUT", "1e12")
    r = check("00.activation_bytes", lambda *a: 0, quiet=True)
    assert r.status == "error" and "MEMLAB_CHECK_TIMEOUT" in r.message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, setsid and /proc (Linux)")
def test_a_double_forked_process_in_its_own_session_with_no_environment_does_not_survive(tmp_path):
    escape = (
        "import os, sys\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        open('escaped', 'w').write(str(os.getpid()))\n"
        "        os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)'], {})\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "import time\n"
        "while not os.path.exists('escaped'):\n"
        "    time.sleep(0.05)"
    )
    nb = _write(tmp_path / "00_escape.ipynb", [SETUP, escape, SOLVED["00.activation_bytes"],
                                              "check('00.activation_bytes', activation_bytes_per_layer)"])
    rows = {r.exercise: r for r in grade_notebook(nb, timeout=30)}
    assert rows["00.activation_bytes"].status == "pass", rows["00.activation_bytes"]
    pid = int((tmp_path / "escaped").read_text())
    assert not _wait_dead([pid]), "a double-forked process with its own session outlived memlab grade"


def test_verify_memlab_modules_sees_each_kind_of_patch(monkeypatch):
    import types

    import memlab
    from memlab import accounting
    from memlab.course.reference import ch01 as profiler
    from memlab.course.grading import load_all, verify_memlab_modules

    load_all()
    assert verify_memlab_modules() == ""
    patches = [
        (accounting, "model_state_bytes", lambda n, r: {}),                       # a replaced function
        (profiler.LiveBytes, "__init__", lambda self, *a, **k: None),              # a replaced method
        (profiler.LiveBytes, "extra", lambda self: 0),                             # an added method
        (accounting, "Recipe", type("Recipe", (), {})),                           # a replaced class
    ]
    for owner, name, value in patches:
        with monkeypatch.context() as m:
            m.setattr(owner, name, value, raising=False)
            assert name in verify_memlab_modules(), (owner, name)
        assert verify_memlab_modules() == ""
    with monkeypatch.context() as m:  # the same code object under another name
        m.setattr(accounting.model_state_bytes, "__code__", accounting.optimizer_state_bytes.__code__)
        assert "model_state_bytes" in verify_memlab_modules()
    with monkeypatch.context() as m:  # another module object in sys.modules, or as the package's attribute
        fake = types.ModuleType("memlab.accounting")
        fake.__dict__.update(vars(accounting))
        m.setitem(__import__("sys").modules, "memlab.accounting", fake)
        assert "memlab.accounting" in verify_memlab_modules()
    with monkeypatch.context() as m:
        m.setattr(memlab, "accounting", types.ModuleType("memlab.accounting"))
        assert "memlab.accounting" in verify_memlab_modules()
    assert verify_memlab_modules() == ""
