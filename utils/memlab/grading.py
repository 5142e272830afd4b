"""The course's grader.

Two halves:

* ``check(exercise_id, obj)`` runs inside a notebook (or anywhere): it looks up the checks
  registered for that exercise in ``memlab.checks``, runs them against ``obj`` under a time
  limit, prints one row and returns a ``CheckResult``. Whatever the learner's code does (raise,
  loop forever, leave a ``NotImplementedError`` stub) becomes a row, never a dead kernel.
* ``grade_notebook(path)`` executes a lab headless with nbclient in the current interpreter,
  collects the rows that each ``check`` wrote, and fills in the exercises that never reported
  (their cell failed, timed out or the kernel died). ``memlab grade`` is its command line.

Statuses: ``pass`` (full points), ``fail`` (a check's assertion did not hold: its message says
what was expected), ``todo`` (the stub still raises NotImplementedError), ``error`` (any other
exception, shown with the frame of your code that raised it), ``timeout``.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import pkgutil
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from memlab._optional import needs, require_installed

STATUSES = ("pass", "fail", "todo", "error", "timeout")
DEFAULT_TIMEOUT = 60.0
RESULTS_ENV = "MEMLAB_GRADE_RESULTS"
TIMEOUT_ENV = "MEMLAB_CHECK_TIMEOUT"
_ID_RE = re.compile(r"^\d{2}\.[A-Za-z_][\w]*$")


@dataclass
class CheckResult:
    """One graded exercise."""

    exercise: str
    status: str
    points: float
    max_points: float
    message: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def row(self) -> str:
        return format_row(self)

    def __str__(self) -> str:
        return self.row()

    def _ipython_display_(self) -> None:
        # check() has already printed the row; as a cell's value, show it only if it has not.
        if not getattr(self, "_printed", False):
            print(self.row())


@dataclass
class Exercise:
    """An exercise: its checks, its points, its time limit and memlab's own answer."""

    id: str
    checks: list[Callable[[Any], Any]] = field(default_factory=list)
    points: float = 1.0
    timeout: float = DEFAULT_TIMEOUT
    reference: Callable[[], Any] | None = None
    title: str = ""


REGISTRY: dict[str, Exercise] = {}
RESULTS: list[CheckResult] = []


def register(
    exercise_id: str,
    *,
    points: float = 1.0,
    timeout: float = DEFAULT_TIMEOUT,
    reference: Callable[[], Any] | None = None,
    title: str = "",
) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Decorator for a check function ``fn(obj)`` that raises AssertionError when ``obj`` is wrong.

    ``reference`` returns memlab's own implementation of the exercise; tests/ run every check
    against it so the package and the grader cannot drift apart. Several checks may be
    registered for one exercise; they run in order and the first failure is reported.
    """
    if not _ID_RE.match(exercise_id):
        raise ValueError(f"exercise_id={exercise_id!r} must look like 'NN.name' (two digits, a dot, an identifier)")
    if points <= 0:
        raise ValueError(f"points={points!r} must be > 0")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")

    def deco(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        ex = REGISTRY.get(exercise_id)
        if ex is None:
            ex = REGISTRY[exercise_id] = Exercise(exercise_id, [], points, timeout, reference, title or fn.__name__)
        ex.checks.append(fn)
        if reference is not None:
            ex.reference = reference
        return fn

    return deco


def load_chapter(chapter: str) -> None:
    """Import ``memlab.checks.chNN`` so that its exercises are registered."""
    importlib.import_module(f"memlab.checks.ch{chapter}")


def load_all() -> dict[str, Exercise]:
    """Import every chapter's checks and return the registry."""
    import memlab.checks as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if re.fullmatch(r"ch\d{2}", info.name):
            importlib.import_module(f"memlab.checks.{info.name}")
    return REGISTRY


def get_exercise(exercise_id: str) -> Exercise:
    if not isinstance(exercise_id, str) or not _ID_RE.match(exercise_id):
        raise ValueError(f"exercise_id={exercise_id!r} must look like 'NN.name', e.g. '00.adam_state_bytes'")
    if exercise_id not in REGISTRY:
        try:
            load_chapter(exercise_id[:2])
        except ModuleNotFoundError:
            pass
    if exercise_id not in REGISTRY:
        known = sorted(k for k in REGISTRY if k.startswith(exercise_id[:3])) or sorted(REGISTRY)
        raise ValueError(f"exercise_id={exercise_id!r} is not a known exercise; known: {', '.join(known) or 'none'}")
    return REGISTRY[exercise_id]


# ----------------------------------------------------------------------------- time limits
class CheckTimeout(BaseException):
    """Raised inside a check that ran past its limit (a BaseException so `except Exception` can't eat it)."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise CheckTimeout in the current thread after ``seconds``.

    On the main thread of a POSIX process this is a SIGALRM timer; elsewhere a watchdog thread
    injects the exception with PyThreadState_SetAsyncExc. Both interrupt Python code; a single
    long C call (one huge matmul) is interrupted when it returns.
    """
    if not seconds or seconds <= 0:
        yield
        return
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():

        def _alarm(signum: int, frame: Any) -> None:
            raise CheckTimeout(f"ran longer than the {seconds:g} s limit")

        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return

    target = threading.get_ident()
    done = threading.Event()

    def _watchdog() -> None:
        if not done.wait(seconds):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(CheckTimeout))

    watchdog = threading.Thread(target=_watchdog, daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()


# ----------------------------------------------------------------------------- check()
_OWN_DIR = str(Path(__file__).resolve().parent)
_TORCH_NOT_IMPLEMENTED = ("Could not run 'aten::", "not implemented for '", "NYI")


def _is_library_frame(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return ("site-packages/" in f or "dist-packages/" in f or "/lib/python3" in f) and _OWN_DIR not in filename


def _learner_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The deepest frame that is neither the grader, a check, nor a library: the learner's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if not fr.filename.startswith(_OWN_DIR) and not _is_library_frame(fr.filename):
            return fr
    return frames[-1] if frames else None


def _where(fr: traceback.FrameSummary | None) -> str:
    if fr is None:
        return ""
    name = Path(fr.filename).name
    if name.startswith("<ipython-input") or "ipykernel_" in fr.filename:
        name = "your cell"
    code = f": {fr.line.strip()}" if fr.line else ""
    return f" (in {fr.name}, {name} line {fr.lineno}{code})"


def _short(msg: str, limit: int = 400) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _record(result: CheckResult) -> None:
    RESULTS.append(result)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(result)) + "\n")


def check(exercise_id: str, obj: Any, *, timeout: float | None = None, quiet: bool = False) -> CheckResult:
    """Grade ``obj`` (your function or class) for ``exercise_id``; print and return the row.

    Never raises for anything ``obj`` does: an exception becomes ``error``, a leftover
    ``NotImplementedError`` stub ``todo``, an assertion of the check ``fail``, and running past
    the time limit ``timeout``.
    """
    ex = get_exercise(exercise_id)
    limit = timeout if timeout is not None else float(os.environ.get(TIMEOUT_ENV, ex.timeout))
    start = time.perf_counter()
    status, message = "pass", ""
    try:
        try:
            with time_limit(limit):
                for fn in ex.checks:
                    fn(obj)
        except CheckTimeout:
            status, message = "timeout", f"ran longer than the {limit:g} s limit: look for a loop that never ends"
        except NotImplementedError as exc:
            if any(marker in str(exc) for marker in _TORCH_NOT_IMPLEMENTED):
                # torch itself said "not implemented" (an op for a dtype/device): a bug, not a stub
                status, message = "error", _short(f"NotImplementedError: {exc}") + _where(_learner_frame(exc))
            else:
                status, message = "todo", _short(str(exc) or "not implemented yet")
        except AssertionError as exc:
            status, message = "fail", _short(str(exc) or "a check did not hold") + _where(_learner_frame(exc) if not str(exc) else None)
        except Exception as exc:  # the learner's code raised
            status, message = "error", _short(f"{type(exc).__name__}: {exc}") + _where(_learner_frame(exc))
    except CheckTimeout:  # the alarm fired between the end of the check and disarming the timer
        status, message = "timeout", f"ran longer than the {limit:g} s limit"
    points = ex.points if status == "pass" else 0.0
    result = CheckResult(exercise_id, status, points, ex.points, message, round(time.perf_counter() - start, 3))
    _record(result)
    if not quiet:
        print(result.row(), flush=True)
        result._printed = True  # type: ignore[attr-defined]
    return result


_MARK = {"pass": "PASS", "fail": "FAIL", "todo": "TODO", "error": "ERROR", "timeout": "TIMEOUT"}


def format_row(r: CheckResult) -> str:
    pts = f"{r.points:g}/{r.max_points:g}"
    msg = f"  {r.message}" if r.message else ""
    return f"{_MARK.get(r.status, r.status.upper()):<8}{r.exercise:<34}{pts:>6}{msg}"


def format_table(title: str, results: list[CheckResult]) -> str:
    got = sum(r.points for r in results)
    total = sum(r.max_points for r in results)
    lines = [title, "-" * max(len(title), 48)]
    lines += [format_row(r) for r in results]
    lines.append(f"{'total':<42}{f'{got:g}/{total:g}':>6}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- grading notebooks
_CHECK_CALL = re.compile(r"""\bcheck\(\s*["'](\d{2}\.\w+)["']""")


def exercises_in(nb: Any) -> list[tuple[str, int]]:
    """(exercise id, index of the cell that checks it), in notebook order."""
    found: list[tuple[str, int]] = []
    seen: set[str] = set()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for m in _CHECK_CALL.finditer(cell.source):
            if m.group(1) not in seen:
                seen.add(m.group(1))
                found.append((m.group(1), i))
    return found


def _current_env_kernel_manager() -> Any:
    """A kernel manager that starts ipykernel in *this* interpreter, whatever kernelspecs exist."""
    with needs("memlab grade"):
        from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
        from jupyter_client.manager import AsyncKernelManager
    require_installed("ipykernel", "memlab grade")

    class _CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: D401
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name=f"Python ({sys.executable})",
                language="python",
                resource_dir="",
            )

    return AsyncKernelManager(kernel_name="memlab-current-env", kernel_spec_manager=_CurrentEnvSpecs())


def _cell_error(cell: Any) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {out.get('evalue')}"
    return None


def grade_notebook(path: str | os.PathLike, *, full: bool = False, timeout: float | None = None) -> list[CheckResult]:
    """Execute a lab headless in the current interpreter and return one result per exercise."""
    with needs("memlab grade"):
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no such notebook")
    nb = nbformat.read(path, as_version=4)
    expected = exercises_in(nb)
    if not expected:
        raise ValueError(f"path={str(path)!r} has no check(\"NN.name\", ...) cell: nothing to grade")
    load_all()
    limit = timeout if timeout is not None else None

    fd, results_path = tempfile.mkstemp(prefix="memlab-grade-", suffix=".jsonl")
    os.close(fd)
    saved_env = {k: os.environ.get(k) for k in (RESULTS_ENV, TIMEOUT_ENV, "MEMLAB_SMALL")}
    os.environ[RESULTS_ENV] = results_path
    if limit is not None:
        os.environ[TIMEOUT_ENV] = str(limit)
    if not full:
        os.environ["MEMLAB_SMALL"] = "1"
    crash = None
    per_check = max((get_exercise(e).timeout for e, _ in expected), default=DEFAULT_TIMEOUT)
    cell_timeout = int(max(300, 2 * (limit or per_check)))
    try:
        client = NotebookClient(
            nb,
            km=_current_env_kernel_manager(),
            timeout=cell_timeout,
            allow_errors=True,
            interrupt_on_timeout=True,
            resources={"metadata": {"path": str(path.parent.resolve())}},
        )
        try:
            client.execute()
        except DeadKernelError as exc:
            crash = f"the kernel died ({_short(str(exc), 120)}): look for code that crashes Python or exhausts memory"
        except CellTimeoutError as exc:  # pragma: no cover - interrupt_on_timeout normally handles it
            crash = f"a cell ran past {cell_timeout} s: {_short(str(exc), 120)}"
        with open(results_path, encoding="utf-8") as fh:
            rows = [CheckResult(**json.loads(line)) for line in fh if line.strip()]
    finally:
        os.unlink(results_path)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    last = {r.exercise: r for r in rows}
    results = []
    for ex_id, cell_idx in expected:
        if ex_id in last:
            results.append(last[ex_id])
            continue
        ex = get_exercise(ex_id)
        cell = nb.cells[cell_idx]
        err = _cell_error(cell)
        if err and ("KeyboardInterrupt" in err or "CellTimeout" in err):
            status, msg = "timeout", f"its cell ran past {cell_timeout} s"
        elif err:
            status, msg = "error", _short(f"the check cell failed: {err}")
        elif crash:
            status, msg = "error", crash
        else:
            status, msg = "error", "the check never ran (was its cell deleted or changed?)"
        results.append(CheckResult(ex_id, status, 0.0, ex.points, msg))
    return results


def grade_main(argv: list[str] | None = None) -> int:
    """``memlab grade [PATH ...] [--full] [--timeout S]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="memlab grade", description="Run lab notebooks headless and grade every exercise.")
    ap.add_argument("paths", nargs="*", help="lab notebooks (default: every work/*.ipynb, or labs/*.ipynb when there is no work/)")
    ap.add_argument("--full", action="store_true", help="full scale (default: MEMLAB_SMALL=1)")
    ap.add_argument("--timeout", type=float, default=None, metavar="S", help="time limit per check in seconds")
    args = ap.parse_args(argv)
    if args.timeout is not None and args.timeout <= 0:
        ap.error(f"--timeout={args.timeout} must be > 0 seconds")
    paths = [Path(p) for p in args.paths]
    if not paths:
        from memlab.labs import default_notebooks

        folder, paths = default_notebooks()
        if not paths:
            ap.error(f"no PATH given and no {folder}/*.ipynb here: run from the course's root or name a notebook")
    for p in paths:
        if not p.is_file() or p.suffix != ".ipynb":
            ap.error(f"path={str(p)!r} is not a notebook file (.ipynb)")
    got = total = 0.0
    for p in paths:
        results = grade_notebook(p, full=args.full, timeout=args.timeout)
        print(format_table(str(p), results))
        print()
        got += sum(r.points for r in results)
        total += sum(r.max_points for r in results)
    if len(paths) > 1:
        print(f"{'all labs':<42}{f'{got:g}/{total:g}':>6}")
    return 0 if got == total else 1


__all__ = [
    "CheckResult",
    "Exercise",
    "REGISTRY",
    "RESULTS",
    "check",
    "register",
    "load_all",
    "get_exercise",
    "grade_notebook",
    "grade_main",
    "time_limit",
    "CheckTimeout",
]
