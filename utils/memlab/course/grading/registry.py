"""The exercise registry: what an exercise is, how checks register, time limits as seconds, rows."""
from __future__ import annotations

import importlib
import math
import os
import pkgutil
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

CHECKS_PACKAGE = "memlab.course.checks"
# memlab's own folder (two levels above this package): frames in it are memlab's, not the learner's
MEMLAB_DIR = str(Path(__file__).resolve().parents[2])

STATUSES = ("pass", "fail", "todo", "error", "timeout", "missing", "not run")
DEFAULT_TIMEOUT = 60.0
DEFAULT_NOTEBOOK_TIMEOUT = 1800.0
TIMEOUT_ENV = "MEMLAB_CHECK_TIMEOUT"
GRADING_ENV = "MEMLAB_GRADING"  # set in the kernel that `memlab grade` starts: check() there only marks the cell
RUN_MARK_ENV = "MEMLAB_GRADE_RUN"  # a random mark in that kernel's environment: every process carrying it is stopped
CHECK_GRACE = 5.0  # seconds past a check's own limit before the grader interrupts the kernel
# A check's limit counts its own CPU time (a loaded machine does not make a right answer time out); a check
# that sleeps or blocks is stopped after WALL_FACTOR x its limit of wall-clock time
WALL_FACTOR = 10.0
KILL_GRACE = 3.0  # seconds after an interrupt before the grader kills the kernel's processes
PREPARE_TIMEOUT = 120.0  # seconds for the fresh import of the checks inside the kernel
MAX_SECONDS = 7 * 86400.0  # the longest time limit any option or variable accepts (a week)
#: an exercise id: two digits, a dot, an identifier (``"03.loss_scaler"``)
EXERCISE_ID = re.compile(r"^\d{2}\.[A-Za-z_][\w]*$")


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
        """This result as one row of the report (see :func:`format_row`)."""
        return format_row(self)

    def __str__(self) -> str:
        return self.row()

    def _ipython_display_(self) -> None:
        # check() has already printed the row; as a cell's value, show it only if it has not.
        if not getattr(self, "_printed", False) and self.status != "graded later":
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
    mutates: tuple[str, ...] = ()
    keeps: tuple[str, ...] = ()
    rerun: bool = True


REGISTRY: dict[str, Exercise] = {}
RESULTS: list[CheckResult] = []


def register(
    exercise_id: str,
    *,
    points: float = 1.0,
    timeout: float = DEFAULT_TIMEOUT,
    reference: Callable[[], Any] | None = None,
    title: str = "",
    mutates: tuple[str, ...] = (),
    keeps: tuple[str, ...] = (),
    rerun: bool = True,
) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Decorator for a check function ``fn(obj)`` that raises AssertionError when ``obj`` is wrong;
    it returns the check unchanged.

    ``reference`` returns memlab's own implementation of the exercise; the test suite runs every check
    against it so the package and the grader cannot drift apart. Several checks may be
    registered for one exercise; they run in order and the first failure is reported.

    Args:
        exercise_id: ``"NN.name"``.
        points: the exercise's points (> 0).
        timeout: seconds for all of its checks (> 0).
        title: a short title (default: the check function's name).
        mutates: the reference's parameter names whose values the answer changes on purpose (an in-place
            update); every other argument must be unchanged after each call (:mod:`.harness`).
        keeps: the parameter names whose tensors or modules the answer may keep alive after the check.
        rerun: run the check a second time (fresh instances, the second pass's cases); False only where
            the check's own cases already build fresh instances in two call sequences.

    Raises:
        ValueError: naming the argument, for a malformed id, points or timeout.
    """
    if not EXERCISE_ID.match(exercise_id):
        raise ValueError(f"exercise_id={exercise_id!r} must look like 'NN.name' (two digits, a dot, an identifier)")
    if not (isinstance(points, (int, float)) and math.isfinite(points) and points > 0):
        raise ValueError(f"points={points!r} must be a finite number > 0")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0")

    def deco(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        ex = REGISTRY.get(exercise_id)
        if ex is None:
            ex = REGISTRY[exercise_id] = Exercise(exercise_id, [], points, timeout, reference, title or fn.__name__,
                                                  tuple(mutates), tuple(keeps), rerun)
        ex.checks.append(fn)
        if reference is not None:
            ex.reference = reference
        if mutates or keeps:
            ex.mutates, ex.keeps = tuple(mutates), tuple(keeps)
        return fn

    return deco


def load_chapter(chapter: str) -> None:
    """Import ``memlab.course.checks.chNN`` (``chapter``: two digits, ``"03"``) so that its exercises are registered."""
    importlib.import_module(f"{CHECKS_PACKAGE}.ch{chapter}")


def load_all() -> dict[str, Exercise]:
    """Import every chapter's checks; returns the registry (exercise id -> :class:`Exercise`)."""
    pkg = importlib.import_module(CHECKS_PACKAGE)
    for info in pkgutil.iter_modules(pkg.__path__):
        if re.fullmatch(r"ch\d{2}", info.name):
            importlib.import_module(f"{CHECKS_PACKAGE}.{info.name}")
    return REGISTRY


def chapter_exercises(chapter: str) -> list[Exercise]:
    """The exercises of one chapter (two digits), in the order its module registers them ([] if it has no checks)."""
    try:
        load_chapter(chapter)
    except ModuleNotFoundError as exc:
        if exc.name != f"{CHECKS_PACKAGE}.ch{chapter}":
            raise
    return [ex for key, ex in REGISTRY.items() if key.startswith(f"{chapter}.")]


def get_exercise(exercise_id: str) -> Exercise:
    """The registered exercise ``exercise_id`` (``"NN.name"``); ValueError for a malformed or unknown id,
    listing the known ones."""
    if not isinstance(exercise_id, str) or not EXERCISE_ID.match(exercise_id):
        raise ValueError(f"exercise_id={exercise_id!r} must look like 'NN.name', e.g. '00.activation_bytes'")
    if exercise_id not in REGISTRY:
        chapter_exercises(exercise_id[:2])
    if exercise_id not in REGISTRY:
        known = sorted(k for k in REGISTRY if k.startswith(exercise_id[:3])) or sorted(REGISTRY)
        raise ValueError(f"exercise_id={exercise_id!r} is not a known exercise; known: {', '.join(known) or 'none'}")
    return REGISTRY[exercise_id]


def parse_seconds(name: str, raw: Any) -> float:
    """``raw`` (a number or a string) as seconds in (0, a week]; otherwise ValueError naming ``name``
    (what the value is called: ``--timeout``, ``MEMLAB_CHECK_TIMEOUT``) and the value."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(raw, bool) or not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        raise ValueError(f"{name}={raw!r} is not a time limit; allowed: a number of seconds > 0 and "
                         f"<= {MAX_SECONDS:g} (a week)")
    return value


def timeout_from_env() -> float | None:
    """``MEMLAB_CHECK_TIMEOUT`` in seconds (None when unset); ValueError naming the variable when malformed."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return None
    return parse_seconds(TIMEOUT_ENV, raw.strip())


def shorten(msg: str, limit: int = 800) -> str:
    """``msg`` on one line (whitespace collapsed), at most ``limit`` characters: a long one keeps its
    start (the case a drawn input names) and its end (what was wrong and what is asked), with `` ... ``
    for the middle it leaves out.

    >>> shorten("case " + "x" * 500 + " the exercise asks for a derivation", 60)
    'case xxxxxxxxxxxxxxxxx ... he exercise asks for a derivation'
    """
    msg = " ".join(str(msg).split())
    if len(msg) <= limit:
        return msg
    head = (limit - 5) * 2 // 5
    return msg[:head] + " ... " + msg[len(msg) - (limit - 5 - head):]


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, even when the learner's exception has a broken ``__str__``."""
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001 - a hostile __str__ must not take the grader down
        return f"<{type(exc).__name__} whose str() failed>"


_MARK = {"pass": "PASS", "fail": "FAIL", "todo": "TODO", "error": "ERROR", "timeout": "TIMEOUT",
         "missing": "MISSING", "not run": "NOT RUN"}


def format_row(r: CheckResult) -> str:
    """One row: status, exercise, points and the message."""
    pts = f"{r.points:g}/{r.max_points:g}"
    msg = f"  {r.message}" if r.message else ""
    return f"{_MARK.get(r.status, r.status.upper()):<8}{r.exercise:<34}{pts:>6}{msg}"


def format_table(title: str, results: list[CheckResult]) -> str:
    """The rows of one notebook under ``title`` (its path), and its total."""
    got = sum(r.points for r in results)
    total = sum(r.max_points for r in results)
    lines = [title, "-" * max(len(title), 48)]
    lines += [format_row(r) for r in results]
    lines.append(f"{'total':<42}{f'{got:g}/{total:g}':>6}")
    return "\n".join(lines)



def is_library_file(filename: str) -> bool:
    """Whether a code object's file is an installed library's (site-packages, the standard library), not memlab's."""
    f = filename.replace("\\", "/")
    return ("site-packages/" in f or "dist-packages/" in f or "/lib/python3" in f) and MEMLAB_DIR not in filename


#: the file name of the stand-in code the grader swaps into memlab's reference while an answer runs
#: (memlab.course.grading.provenance): memlab's, never the learner's
STAND_IN_FILE = "<memlab reference stand-in>"


def is_learner_file(filename: str) -> bool:
    """Whether a code object's file name is code the learner wrote (a notebook cell, a script):
    neither memlab's (its files, the grader's stand-in) nor a library's."""
    f = filename.replace("\\", "/")
    return not (f.startswith("<frozen") or filename == STAND_IN_FILE or is_library_file(filename)
                or os.path.realpath(filename).startswith(MEMLAB_DIR + os.sep))
