"""The course's grader.

Two halves:

* ``check(exercise_id, obj)`` runs inside a notebook (or anywhere): it looks up the checks
  registered for that exercise in ``memlab.checks``, runs them against ``obj`` under a time
  limit, prints one row and returns a ``CheckResult``. Whatever the learner's code does (raise,
  loop forever, leave a ``NotImplementedError`` stub) becomes a row, never a dead kernel.
* ``grade_notebook(path)`` executes a lab headless in a kernel of the current interpreter and
  computes every result itself. The exercises and their points come from the chapter's
  registry, never from the notebook: an exercise whose check cell was deleted scores 0
  (``missing``). Right after an exercise's check cell has run, the grader imports memlab's
  checks (``memlab.grading``, ``memlab.checks``) afresh inside the kernel from its own files,
  verifies their fingerprint against its own, and runs them on the learner's object, looked up
  by the name the check cell passes, under its own time limit. The reference modules the checks
  compare with (``memlab.accounting`` ...) are the kernel's own, so objects the learner built
  with them keep their classes; before and after each check :func:`verify_memlab_modules`
  compares every one of them with its source file (replaced or wrapped functions, a swapped
  ``__code__``, another module in ``sys.modules`` make the row an error). The requests run as
  silent executions and write their answer to a new file in the grader's private folder: nothing
  the notebook prints counts as a result. ``memlab grade`` is its command line.

Threat model: tampering from the notebook (a redefined ``check``, forged rows or answers, IPython
hooks, deleted check cells, an ``int`` whose ``==`` is always true, a prediction that is not
exactly an int or a float, a patched reference, a wrapper of the reference, a
``while True: try: ... except: pass`` loop, processes left running, double-forked ones included)
has no effect on the grade. A determined learner still owns their kernel (they can patch the
interpreter the checks run in, or rewrite the answer file from a background thread); the grader
does not claim to stop them.

Statuses: ``pass`` (full points), ``fail`` (a check's assertion did not hold: its message says
what was expected), ``todo`` (the stub still raises NotImplementedError), ``error`` (any other
exception, shown with the frame of your code that raised it), ``timeout``; ``memlab grade``
adds ``missing`` (no check cell) and ``not run`` (the kernel died or was stopped earlier).
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import keyword
import math
import os
import pkgutil
import queue
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from memlab.procs import child_subreaper
from memlab.optional import needs, require_installed

STATUSES = ("pass", "fail", "todo", "error", "timeout", "missing", "not run")
DEFAULT_TIMEOUT = 60.0
DEFAULT_NOTEBOOK_TIMEOUT = 1800.0
TIMEOUT_ENV = "MEMLAB_CHECK_TIMEOUT"
GRADING_ENV = "MEMLAB_GRADING"  # set in the kernel that `memlab grade` starts: check() there only marks the cell
RUN_MARK_ENV = "MEMLAB_GRADE_RUN"  # a random mark in that kernel's environment: every process carrying it is stopped
CHECK_GRACE = 5.0  # seconds past a check's own limit before the grader interrupts the kernel
KILL_GRACE = 3.0  # seconds after an interrupt before the grader kills the kernel's processes
PREPARE_TIMEOUT = 120.0  # seconds for the fresh import of the checks inside the kernel
MAX_SECONDS = 7 * 86400.0  # the longest time limit any option or variable accepts (a week)
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
    if not (isinstance(points, (int, float)) and math.isfinite(points) and points > 0):
        raise ValueError(f"points={points!r} must be a finite number > 0")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0")

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


def chapter_exercises(chapter: str) -> list[Exercise]:
    """The exercises of chapter ``NN`` in the order its module registers them ([] if none)."""
    try:
        load_chapter(chapter)
    except ModuleNotFoundError as exc:
        if exc.name != f"memlab.checks.ch{chapter}":
            raise
    return [ex for key, ex in REGISTRY.items() if key.startswith(f"{chapter}.")]


def get_exercise(exercise_id: str) -> Exercise:
    """The registered exercise ``exercise_id``; ValueError (listing the known ids) if there is none."""
    if not isinstance(exercise_id, str) or not _ID_RE.match(exercise_id):
        raise ValueError(f"exercise_id={exercise_id!r} must look like 'NN.name', e.g. '00.activation_bytes'")
    if exercise_id not in REGISTRY:
        chapter_exercises(exercise_id[:2])
    if exercise_id not in REGISTRY:
        known = sorted(k for k in REGISTRY if k.startswith(exercise_id[:3])) or sorted(REGISTRY)
        raise ValueError(f"exercise_id={exercise_id!r} is not a known exercise; known: {', '.join(known) or 'none'}")
    return REGISTRY[exercise_id]


def parse_seconds(name: str, raw: Any) -> float:
    """``raw`` as a positive, finite number of seconds; ValueError naming ``name`` and the value otherwise."""
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


# ----------------------------------------------------------------------------- time limits
class CheckTimeout(BaseException):
    """Raised inside a check that ran past its limit (a BaseException so `except Exception` can't eat it)."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise CheckTimeout in the current thread after ``seconds``.

    On the main thread of a POSIX process this is a SIGALRM timer; elsewhere a watchdog thread
    injects the exception with PyThreadState_SetAsyncExc. Both interrupt Python code; a single
    long C call (one huge matmul) is interrupted when it returns. A bare ``except:`` can still
    swallow it: ``memlab grade`` therefore also keeps a deadline of its own, outside the kernel.
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


# ----------------------------------------------------------------------------- running the checks
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


def _safe_str(exc: BaseException) -> str:
    """``str(exc)``, even when the learner's exception has a broken ``__str__``."""
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001 - a hostile __str__ must not take the grader down
        return f"<{type(exc).__name__} whose str() failed>"


def _run_checks(ex: Exercise, obj: Any, limit: float | None) -> tuple[str, str]:
    """Run every check of ``ex`` on ``obj`` under ``limit`` seconds: (status, message). Never raises."""
    status, message = "pass", ""
    try:
        try:
            with time_limit(limit):
                for fn in ex.checks:
                    fn(obj)
        except CheckTimeout:
            status, message = "timeout", f"ran longer than the {limit:g} s limit: look for a loop that never ends"
        except NotImplementedError as exc:
            text = _safe_str(exc)
            if any(marker in text for marker in _TORCH_NOT_IMPLEMENTED):
                # torch itself said "not implemented" (an op for a dtype/device): a bug, not a stub
                status, message = "error", _short(f"NotImplementedError: {text}") + _where(_learner_frame(exc))
            else:
                status, message = "todo", _short(text or "not implemented yet")
        except AssertionError as exc:
            text = _safe_str(exc)
            status, message = "fail", _short(text or "a check did not hold") + _where(_learner_frame(exc) if not text else None)
        except KeyboardInterrupt as exc:
            status, message = "error", "KeyboardInterrupt: your code was interrupted (or raised KeyboardInterrupt)" + _where(_learner_frame(exc))
        except SystemExit as exc:
            status, message = "error", _short(f"SystemExit({exc.code!r}): your code called sys.exit()") + _where(_learner_frame(exc))
        except BaseException as exc:  # noqa: BLE001 - the learner's code raised
            status, message = "error", _short(f"{type(exc).__name__}: {_safe_str(exc)}") + _where(_learner_frame(exc))
    except CheckTimeout:  # the alarm fired between the end of the check and disarming the timer
        status, message = "timeout", f"ran longer than the {limit:g} s limit"
    return status, message


def _reference_note(obj: Any, ex: Exercise, modules: Mapping[str, Any] | None = None) -> str:
    """A note when ``obj`` is memlab's own code (the exercise's reference, or anything from memlab), else ''.

    ``modules`` maps module names to the modules the learner's code sees (``sys.modules`` by default).
    """
    modules = sys.modules if modules is None else modules
    try:
        target = obj
        while isinstance(target, functools.partial):
            target = target.func
        target = inspect.unwrap(target) if callable(target) else target
        candidates: list[Any] = []
        if ex.reference is not None:
            ref = ex.reference()
            candidates.append(ref)
            mod = modules.get(getattr(ref, "__module__", "") or "")
            name = getattr(ref, "__qualname__", None)
            if mod is not None and isinstance(name, str) and "." not in name:
                candidates.append(getattr(mod, name, None))
        named = None
        if any(target is c or obj is c for c in candidates if c is not None):
            named = target
        elif isinstance(target, type):
            named = next((c for c in target.__mro__ if str(getattr(c, "__module__", "")).startswith("memlab.")), None)
        elif str(getattr(target, "__module__", "") or "").startswith("memlab."):
            named = target
        if named is None:
            return ""
        where = f"{getattr(named, '__module__', 'memlab')}.{getattr(named, '__qualname__', type(named).__name__)}"
        return f"uses the reference implementation ({where}), not your own code: no points"
    except Exception:  # noqa: BLE001 - a hostile object must not break the row
        return ""


def _is_learner_file(filename: str) -> bool:
    """Code the learner wrote (a notebook cell, a script): neither memlab's nor a library's."""
    f = filename.replace("\\", "/")
    return not (f.startswith("<frozen") or _is_library_frame(filename) or os.path.realpath(filename).startswith(_OWN_DIR + os.sep))


def _reference_codes(ex: Exercise) -> dict[types.CodeType, str]:
    """The code objects of the exercise's reference: the function, or the methods its class defines."""
    if ex.reference is None:
        return {}
    ref = ex.reference()
    codes: dict[types.CodeType, str] = {}

    def add(fn: Any, where: str) -> None:
        for f in (fn, getattr(fn, "__func__", None), getattr(fn, "fget", None), getattr(fn, "fset", None)):
            if f is None:
                continue
            try:
                f = inspect.unwrap(f)
            except ValueError:
                continue
            code = getattr(f, "__code__", None)
            if isinstance(code, types.CodeType):
                codes[code] = where

    name = f"{getattr(ref, '__module__', 'memlab')}.{getattr(ref, '__qualname__', type(ref).__name__)}"
    if isinstance(ref, type):
        for attr, value in vars(ref).items():
            add(value, f"{name}.{attr}")
    else:
        add(ref, name)
    return codes


@contextmanager
def _watch_reference(ex: Exercise, found: list[str]) -> Iterator[None]:
    """Note in ``found`` when the learner's code calls the exercise's reference, however wrapped.

    A global trace function (called on Python function calls only, never per line) sees every
    call of the reference's code objects; the caller chain is walked up
    past library frames (functools, builtins' ``map``, decorators): if the first frame that is not
    a library's is the learner's, the answer delegates to memlab's reference. Calls made by the
    checks themselves (and by memlab's other code) do not count.
    """
    try:
        codes = _reference_codes(ex)
    except Exception:  # noqa: BLE001
        codes = {}
    if not codes:
        yield
        return

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or found or frame.f_code not in codes:
            return
        f = frame.f_back
        while f is not None:
            filename = f.f_code.co_filename
            if _is_learner_file(filename):
                found.append(codes[frame.f_code])
                return
            if not (_is_library_frame(filename) or filename.startswith("<frozen")):
                return  # memlab's own code (a check, or a helper) made the call
            f = f.f_back

    def tracer(frame: Any, event: str, arg: Any) -> None:  # global trace: called on Python calls only
        if frame.f_code in codes:
            hook(frame, event, arg)
        return None  # no per-line tracing

    old = sys.gettrace()
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(old)
        threading.settrace(None)  # type: ignore[arg-type]


def _run_checks_watched(ex: Exercise, obj: Any, limit: float | None) -> tuple[str, str, str]:
    """:func:`_run_checks`, and a note when the answer is (or calls) memlab's reference."""
    found: list[str] = []
    with _watch_reference(ex, found):
        status, message = _run_checks(ex, obj, limit)
    note = ""
    if status == "pass":
        note = _reference_note(obj, ex)
        if not note and found:
            note = f"calls the reference implementation ({found[0]}) from your code: no points"
    return status, message, note


_COMPILED: dict[tuple[str, float], dict[str, Any]] = {}


def _code_table(path: str) -> dict[str, Any]:
    """For a memlab source file: its top-level functions, classes (with their methods) and literal
    constants, and every code object it compiles to, by qualified name."""
    key = (path, os.stat(path).st_mtime)
    if key in _COMPILED:
        return _COMPILED[key]
    import ast

    source = Path(path).read_text(encoding="utf-8")
    tree = ast.parse(source)
    codes: dict[str, types.CodeType] = {}

    def walk(code: types.CodeType) -> None:
        codes.setdefault(code.co_qualname, code)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                walk(c)

    walk(compile(tree, path, "exec"))
    functions, classes, constants = set(), {}, {}
    # names the module rebinds (assigned twice at top level, augmented, or declared global in a
    # function) are state, not constants
    seen: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        seen[n.id] = seen.get(n.id, 0) + (2 if isinstance(node, ast.AugAssign) else 1)
    rebound = {k for k, v in seen.items() if v > 1}
    rebound |= {name for n in ast.walk(tree) if isinstance(n, ast.Global) for name in n.names}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.add(node.name)
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if not isinstance(value, (int, float, str, bytes, tuple, frozenset, type(None))):
                continue  # a mutable registry ({}, []) that the module fills later
            for t in targets:
                if isinstance(t, ast.Name) and not t.id.startswith("__") and t.id not in rebound:
                    constants[t.id] = value
    table = {"codes": codes, "functions": functions, "classes": classes, "constants": constants}
    _COMPILED[key] = table
    return table


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    if a.co_code != b.co_code or a.co_names != b.co_names or len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) or isinstance(y, types.CodeType):
            if not (isinstance(x, types.CodeType) and isinstance(y, types.CodeType) and _same_code(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _function_ok(obj: Any, qualname: str, table: dict[str, Any]) -> bool:
    """Whether ``obj`` (a module's or a class's attribute) still runs the code ``qualname`` of the file."""
    for f in (getattr(obj, "__func__", None), getattr(obj, "fget", None), obj):
        if f is None:
            continue
        if isinstance(f, types.FunctionType) and _is_learner_file(f.__code__.co_filename):
            return False  # a wrapper written in the notebook
        try:
            inner = inspect.unwrap(f)
        except ValueError:
            return False
        if isinstance(inner, types.FunctionType):
            want = table["codes"].get(qualname)
            return want is not None and inner.__qualname__ == qualname and _same_code(inner.__code__, want)
    return True  # not a Python function (a C object made by a decorator): nothing to compare


def verify_memlab_modules(root: str | None = None) -> str:
    """'' when every ``memlab`` module the kernel has imported still holds its file's code; else what changed.

    Each module in ``sys.modules`` must be a module loaded from ``root`` (memlab's folder); every
    top-level function and every method of a top-level class must run the code its source file
    compiles to (a replaced function, a patched ``__code__``, a wrapper, a rebound name all show),
    every class must still be that file's class, and every literal constant must hold its value.
    The grader calls it in the kernel before and after a check runs, so that a notebook that
    patches memlab's reference (or ``sys.modules``) cannot make a wrong answer pass.
    """
    root = os.path.realpath(root or _OWN_DIR)
    for name, mod in sorted(list(sys.modules.items()), key=lambda kv: kv[0]):
        if not (name == "memlab" or name.startswith("memlab.")) or _is_grader_module(name) or mod is None:
            continue
        file = getattr(mod, "__file__", None)
        if not isinstance(mod, types.ModuleType) or not isinstance(file, str):
            return f"sys.modules[{name!r}] is not memlab's module (a {type(mod).__name__})"
        real = os.path.realpath(file)
        if not real.startswith(root + os.sep) or not real.endswith(".py"):
            return f"sys.modules[{name!r}] comes from {file}, not from memlab's folder {root}"
        try:
            table = _code_table(real)
        except (OSError, SyntaxError, ValueError) as exc:
            return f"{name}: cannot read {file} ({type(exc).__name__})"
        ns = vars(mod)
        gone = sorted(n for n in (*table["functions"], *table["classes"]) if n not in ns)
        if gone:
            return f"{name} has no {gone[0]} (defined in {file}): the module was replaced or changed in the kernel"
        for fname in table["functions"]:
            if not _function_ok(ns[fname], fname, table):
                return f"{name}.{fname} was replaced or changed in the kernel"
        for cname, methods in table["classes"].items():
            cls = ns.get(cname)
            if cls is None:
                continue
            if not isinstance(cls, type) or cls.__qualname__ != cname or cls.__module__ != name:
                return f"{name}.{cname} was replaced in the kernel"
            for mname, value in list(vars(cls).items()):
                if mname in methods:
                    ok = _function_ok(value, f"{cname}.{mname}", table)
                elif isinstance(value, (types.FunctionType, staticmethod, classmethod, property)):
                    # a method the class body does not define (a dataclass's, an Enum's generated ones):
                    # refused when the notebook wrote it
                    f = getattr(value, "__func__", None) or getattr(value, "fget", None) or value
                    filename = getattr(getattr(f, "__code__", None), "co_filename", "<string>")
                    ok = filename == "<string>" or not _is_learner_file(filename)
                else:
                    continue
                if not ok:
                    return f"{name}.{cname}.{mname} was replaced or added in the kernel"
            if any(m not in vars(cls) for m in methods):
                return f"a method of {name}.{cname} was deleted in the kernel"
        for const, value in table["constants"].items():
            if const in ns and not (type(ns[const]) is type(value) and ns[const] == value):
                return f"{name}.{const} was changed in the kernel"
    # a package's attribute for a submodule must be that submodule (``from memlab import accounting``)
    for name, mod in list(sys.modules.items()):
        if "." in name and name.startswith("memlab.") and isinstance(mod, types.ModuleType) and not _is_grader_module(name):
            parent, _, leaf = name.rpartition(".")
            pkg = sys.modules.get(parent)
            if pkg is not None and leaf in vars(pkg) and vars(pkg)[leaf] is not mod:
                return f"{parent}.{leaf} is not sys.modules[{name!r}]: a module was replaced in the kernel"
    # names the (fresh) checks bound from memlab's modules must be those modules' own objects
    for name, mod in list(sys.modules.items()):
        if not (_is_grader_module(name) and isinstance(mod, types.ModuleType)):
            continue
        for key, value in list(vars(mod).items()):
            if isinstance(value, types.ModuleType) and str(getattr(value, "__name__", "")).startswith("memlab"):
                if sys.modules.get(value.__name__) is not value:
                    return f"{name}.{key} is not sys.modules[{value.__name__!r}]: a module was replaced in the kernel"
                continue
            origin = getattr(value, "__module__", None) if isinstance(value, (types.FunctionType, type)) else None
            if not (isinstance(origin, str) and origin.startswith("memlab.")) or _is_grader_module(origin):
                continue
            owner = sys.modules.get(origin)
            top = str(getattr(value, "__qualname__", "")).split(".")[0]
            if owner is None or "<" in top:
                continue
            if getattr(owner, top, None) is not value and "." not in value.__qualname__:
                return f"{name}.{key} is not {origin}.{top}: it was replaced in the kernel"
    return ""


def check(exercise_id: str, obj: Any, *, timeout: float | None = None, quiet: bool = False) -> CheckResult:
    """Grade ``obj`` (your function or class) for ``exercise_id``; print and return the row.

    Never raises: an exception of ``obj`` becomes ``error``, a leftover ``NotImplementedError``
    stub ``todo``, an assertion of the check ``fail``, running past the time limit ``timeout``;
    an unknown exercise id or a malformed ``MEMLAB_CHECK_TIMEOUT`` is an ``error`` row that says so.
    Passing memlab's own implementation is a ``pass`` row with no points, flagged as such.

    Inside the kernel that ``memlab grade`` starts, ``check`` only marks the cell: the grader
    runs the checks itself, from a fresh import, right after this cell.
    """
    if os.environ.get(GRADING_ENV) == "1":
        return CheckResult(str(exercise_id), "graded later", 0.0, 0.0, "memlab grade runs this check itself")
    start = time.perf_counter()
    try:
        ex = get_exercise(exercise_id)
        limit = timeout if timeout is not None else (timeout_from_env() or ex.timeout)
        if timeout is not None:
            parse_seconds("timeout", timeout)
    except Exception as exc:  # noqa: BLE001 - a typo in the id or the environment is a row, not a crash
        result = CheckResult(str(exercise_id)[:60], "error", 0.0, 0.0, _short(_safe_str(exc)))
    else:
        status, message, note = _run_checks_watched(ex, obj, limit)
        points = ex.points if status == "pass" else 0.0
        if note:
            points, message = 0.0, note
        result = CheckResult(exercise_id, status, points, ex.points, message, round(time.perf_counter() - start, 3))
    RESULTS.append(result)
    if not quiet:
        print(result.row(), flush=True)
        result._printed = True  # type: ignore[attr-defined]
    return result


_MARK = {"pass": "PASS", "fail": "FAIL", "todo": "TODO", "error": "ERROR", "timeout": "TIMEOUT",
         "missing": "MISSING", "not run": "NOT RUN"}


def format_row(r: CheckResult) -> str:
    """One row: status, exercise, points and the message."""
    pts = f"{r.points:g}/{r.max_points:g}"
    msg = f"  {r.message}" if r.message else ""
    return f"{_MARK.get(r.status, r.status.upper()):<8}{r.exercise:<34}{pts:>6}{msg}"


def format_table(title: str, results: list[CheckResult]) -> str:
    """The rows of one notebook and its total."""
    got = sum(r.points for r in results)
    total = sum(r.max_points for r in results)
    lines = [title, "-" * max(len(title), 48)]
    lines += [format_row(r) for r in results]
    lines.append(f"{'total':<42}{f'{got:g}/{total:g}':>6}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the checks' fingerprint
def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return f"<no source for {obj!r}>"


def chapter_fingerprint(chapter: str) -> str:
    """sha256 of what grades chapter ``NN``: its exercises, points, limits and the source of its checks.

    The grader computes it in its own process and again inside the kernel after a fresh import;
    the two must agree, or the kernel is not running memlab's checks.
    """
    import memlab.checks as helpers

    h = hashlib.sha256()
    h.update(_source(helpers).encode())
    h.update(_source(_run_checks).encode())
    for ex in chapter_exercises(chapter):
        h.update(json.dumps([ex.id, ex.points, ex.timeout]).encode())
        for fn in ex.checks:
            h.update(_source(fn).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- inside the graded kernel
# The grader sends two requests per exercise, right after its check cell. Both run in a private
# namespace, as silent executions (IPython's pre/post_run_cell hooks do not fire), and write their
# answer to a new file whose random name only the request knows, in the grader's private folder;
# nothing the notebook prints is read.
_BOOT_PREPARE = r'''
import sys, json, importlib.util
def _memlab_grader_prepare(args):
    def ours(k):
        return k in ("memlab.grading", "memlab.checks") or k.startswith("memlab.checks.")
    old = {k: m for k, m in list(sys.modules.items()) if ours(k)}
    for k in old:
        del sys.modules[k]
    def load(name, path, package_dir=None):
        spec = importlib.util.spec_from_file_location(
            name, path, submodule_search_locations=[package_dir] if package_dir else None)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    try:
        import memlab
        grading = load("memlab.grading", args["dir"] + "/grading.py")
        load("memlab.checks", args["dir"] + "/checks/__init__.py", args["dir"] + "/checks")
        return grading._kernel_prepare(args, old)
    except BaseException as exc:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(old)
        return {"ok": False, "message": "the grader could not import memlab's checks in the kernel: "
                                        + type(exc).__name__ + ": " + str(exc)[:300]}
def _memlab_grader_answer(path, data):
    import os
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
_memlab_grader_answer(ARGS["answer"], _memlab_grader_prepare(ARGS))
'''

_BOOT_RUN = r'''
import sys, json
def _memlab_grader_run(args, user_ns):
    grading = sys.modules.get("memlab.grading")
    if grading is None or getattr(grading, "_PREPARED", {}).get("nonce") != args["prepared"]:
        return {"status": "error", "message": "the grader's fresh copy of the checks was replaced before it ran"}
    return grading._kernel_run(args, user_ns)
def _memlab_grader_answer(path, data):
    import os
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
_memlab_grader_answer(ARGS["answer"], _memlab_grader_run(ARGS, USER_NS))
'''

_PREPARED: dict[str, Any] = {}


def _is_grader_module(name: str) -> bool:
    """The modules the grader imports afresh in the kernel: itself and the checks."""
    return name in ("memlab.grading", "memlab.checks") or name.startswith("memlab.checks.")


def _restore_modules(old: Mapping[str, Any]) -> None:
    for k in [k for k in sys.modules if _is_grader_module(k)]:
        del sys.modules[k]
    sys.modules.update(old)


def _kernel_prepare(args: dict[str, Any], old_modules: dict[str, Any]) -> dict[str, Any]:
    """(In the kernel, in a freshly imported memlab.) Load the chapter's checks and compare fingerprints."""
    chapter = args["chapter"]
    try:
        fingerprint = chapter_fingerprint(chapter)
    except BaseException as exc:  # noqa: BLE001
        _restore_modules(old_modules)
        return {"ok": False, "message": _short(f"the chapter's checks failed to import in the kernel: {type(exc).__name__}: {exc}")}
    root = os.path.realpath(args["dir"])
    foreign = sorted(k for k, m in list(sys.modules.items())
                     if (k == "memlab" or k.startswith("memlab.")) and getattr(m, "__file__", None)
                     and not os.path.realpath(m.__file__).startswith(root + os.sep))
    if foreign:
        _restore_modules(old_modules)
        where = getattr(sys.modules[foreign[0]], "__file__", "?")
        return {"ok": False, "message": f"the kernel's {foreign[0]} comes from {where}, not from the grader's memlab "
                                        f"({root}): is there a memlab/ folder next to the notebook?"}
    if fingerprint != args["fingerprint"]:
        _restore_modules(old_modules)
        return {"ok": False, "fingerprint": fingerprint,
                "message": "the checks the kernel imports differ from memlab's own (fingerprint mismatch): "
                           "is another `memlab` package on the notebook's path?"}
    changed = verify_memlab_modules(root)
    if changed:
        _restore_modules(old_modules)
        return {"ok": False, "message": f"{changed}: memlab's reference code was changed in the notebook's kernel; "
                                        "the checks need memlab's own: restart the kernel and do not patch memlab"}
    _PREPARED.update(nonce=args["nonce"], old=old_modules)
    return {"ok": True, "fingerprint": fingerprint}


def _resolve(name: str, user_ns: Mapping[str, Any]) -> Any:
    """The learner's object ``name`` (``a`` or ``a.b.c``) from the notebook's namespace; NameError if absent."""
    first, *rest = name.split(".")
    if first not in user_ns:
        raise NameError(f"name {first!r} is not defined in the notebook when its check runs")
    obj = user_ns[first]
    for part in rest:
        obj = getattr(obj, part)
    return obj


def _kernel_run(args: dict[str, Any], user_ns: Mapping[str, Any]) -> dict[str, Any]:
    """(In the kernel, in the fresh memlab.) Run one exercise's checks on the learner's object by name."""
    old = _PREPARED.get("old", {})
    start = time.perf_counter()
    try:
        ex = get_exercise(args["exercise"])
        try:
            obj = _resolve(args["name"], user_ns)
        except BaseException as exc:  # noqa: BLE001 - a hostile __getattr__ included
            return {"status": "error", "message": _short(f"{type(exc).__name__}: {_safe_str(exc)}"), "seconds": 0.0}
        changed = verify_memlab_modules(args["dir"])
        if not changed:
            status, message, note = _run_checks_watched(ex, obj, args["limit"])
            changed = verify_memlab_modules(args["dir"])  # the learner's code ran: look again
        if changed:
            return {"status": "error", "seconds": round(time.perf_counter() - start, 3),
                    "message": f"{changed}: memlab's reference code was changed in the notebook's kernel; the check "
                               "needs memlab's own: restart the kernel and do not patch memlab"}
        return {"status": status, "message": message, "reference": note,
                "seconds": round(time.perf_counter() - start, 3)}
    except BaseException as exc:  # noqa: BLE001
        return {"status": "error", "message": _short(f"the grader failed: {type(exc).__name__}: {_safe_str(exc)}")}
    finally:
        _PREPARED.clear()
        _restore_modules(old)


def _request(boot: str, args: dict[str, Any], with_namespace: bool = False) -> str:
    """The code of one grader request: ``boot`` run in a private namespace with ``args``."""
    ns = "{'__builtins__': __import__('builtins'), 'ARGS': %s%s}" % (
        repr(args), ", 'USER_NS': globals()" if with_namespace else "")
    return f"__import__('builtins').exec({boot!r}, {ns})"


# ----------------------------------------------------------------------------- the notebook's check cells
_CHECK_CALL = re.compile(r"""\bcheck\(\s*(["'])([^"'\n]{1,80})\1\s*(?:,\s*([A-Za-z_][\w.]*)(?=\s*[,)]))?""")


@dataclass
class CheckCall:
    """A ``check("NN.name", obj)`` call in a notebook: the id, the object's name, the cell."""

    exercise: str
    name: str | None
    cell: int


def check_calls(nb: Any) -> list[CheckCall]:
    """Every ``check("...", name)`` call in the notebook's code cells, in order (unknown ids included)."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code" or not isinstance(cell.get("source"), str):
            continue
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("#"))
        for m in _CHECK_CALL.finditer(code):  # a commented-out check is a deleted one
            name = m.group(3) if m.group(3) and not keyword.iskeyword(m.group(3).split(".")[0]) else None
            found.append(CheckCall(m.group(2), name, i))
    return found


def exercises_in(nb: Any) -> list[tuple[str, int]]:
    """(exercise id, index of the first cell that checks it), in notebook order, ids as written."""
    seen: dict[str, int] = {}
    for call in check_calls(nb):
        if _ID_RE.match(call.exercise):
            seen.setdefault(call.exercise, call.cell)
    return list(seen.items())


# ----------------------------------------------------------------------------- the kernel, from outside
def _proc_stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgid, sid, state) of ``pid`` from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0]




def _children_of_this_process() -> set[int]:
    me, out = os.getpid(), set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None and st[0] == me:
                out.add(int(entry))
    return out


def _marked_processes(mark: str, kernel_pid: int | None, adopted: set[int] | None = None) -> set[int]:
    """Processes of this grading run: those whose environment carries ``mark``, those in the
    kernel's session or process group, the kernel's descendants, and ``adopted`` (orphans of the
    run reparented to this process) with their descendants. Never this process."""
    me = os.getpid()
    own_pgid, own_sid = os.getpgid(0), os.getsid(0)
    needle = f"{RUN_MARK_ENV}={mark}".encode()
    stats: dict[int, tuple[int, int, int, str]] = {}
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        st = _proc_stat(pid)
        if st is None or st[3] == "Z":
            continue
        stats[pid] = st
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            env = b""
        if needle in env.split(b"\0"):
            found.add(pid)
    found |= {pid for pid in (adopted or ()) if pid in stats}
    if kernel_pid is not None or adopted:
        roots = {kernel_pid} if kernel_pid is not None else set()
        for pid, (ppid, pgid, sid, _state) in stats.items():
            if (sid == kernel_pid and sid != own_sid) or (pgid == kernel_pid and pgid != own_pgid):
                found.add(pid)
        changed = True
        while changed:  # descendants of the kernel
            changed = False
            for pid, (ppid, *_rest) in stats.items():
                if ppid in roots | found and pid not in found and pid != me:
                    found.add(pid)
                    changed = True
        if kernel_pid in stats:
            found.add(kernel_pid)
    found.discard(me)
    return found


def stop_processes(mark: str, kernel_pid: int | None = None, before: set[int] | None = None) -> int:
    """SIGKILL every process of a grading run (see ``_marked_processes``); returns how many were stopped.

    ``before``: this process's children before the run started; any other child now (but the
    kernel) is an orphan of the run that the grader, as child subreaper, adopted: killed and reaped."""
    if not Path("/proc/self/stat").exists():  # not Linux: the kernel's process group is the best we can do
        if kernel_pid is not None:
            try:
                os.killpg(kernel_pid, signal.SIGKILL)
            except OSError:
                pass
        return 0
    stopped: set[int] = set()
    adopted: set[int] = set()
    for _ in range(50):
        if before is not None:
            adopted |= _children_of_this_process() - before - {kernel_pid}
        victims = _marked_processes(mark, kernel_pid, adopted)
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                stopped.add(pid)
            except OSError:
                pass
        time.sleep(0.05)
    for pid in adopted:  # our children now: reap them, no zombies left
        try:
            os.waitpid(pid, os.WNOHANG)
        except OSError:
            pass
    return len(stopped)


@dataclass
class _Outcome:
    """What one execution request did."""

    state: str  # "ok" | "error" | "interrupted" | "killed" | "died"
    ename: str = ""
    evalue: str = ""
    text: str = ""
    seconds: float = 0.0


class _Kernel:
    """An ipykernel of this interpreter, over IPC sockets in a private folder, with hard deadlines.

    Every request has a deadline; past it the kernel is interrupted, and ``KILL_GRACE`` seconds
    later every process of the run (the kernel, its process group and session, and anything
    carrying the run's mark in its environment) is killed. No learner code can swallow that.
    """

    def __init__(self, cwd: Path, env: dict[str, str], mark: str) -> None:
        self.cwd, self.env, self.mark = cwd, env, mark
        self.tmp = Path(tempfile.mkdtemp(prefix="memlab-kernel-"))
        self.km: Any = None
        self.kc: Any = None
        self.pid: int | None = None
        self.dead = False
        self._log: Any = None
        self.before: set[int] | None = None  # this process's children before the kernel started
        self._was_subreaper: bool | None = None

    async def start(self) -> None:
        with needs("memlab grade"):
            from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
            from jupyter_client.manager import AsyncKernelManager
        require_installed("ipykernel", "memlab grade")

        class _CurrentEnvSpecs(KernelSpecManager):
            def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: D401
                return KernelSpec(
                    argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                          "--HistoryManager.hist_file=:memory:"],
                    display_name=f"Python ({sys.executable})",
                    language="python",
                    resource_dir="",
                )

        ipc = os.name == "posix"  # IPC sockets: no TCP port, no "running over TCP without encryption" warning
        extra: dict[str, Any] = {"transport": "ipc", "ip": str(self.tmp / "kernel")} if ipc else {}
        self.km = AsyncKernelManager(kernel_name="memlab-current-env", kernel_spec_manager=_CurrentEnvSpecs(),
                                     connection_file=str(self.tmp / "kernel.json"), **extra)
        self._log = open(self.tmp / "kernel.log", "wb")
        if Path("/proc/self/stat").exists():
            self.before = _children_of_this_process()
            self._was_subreaper = child_subreaper(True)  # orphans of the notebook come back to the grader
        await self.km.start_kernel(env=self.env, cwd=str(self.cwd), stdout=self._log, stderr=self._log)
        proc = getattr(getattr(self.km, "provisioner", None), "process", None)
        self.pid = getattr(proc, "pid", None)
        self.kc = self.km.client()
        self.kc.allow_stdin = False
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=120)

    def exit_description(self) -> str:
        """How the kernel ended: a signal's name, an exit code, and a fatal error line from its log."""
        proc = getattr(getattr(self.km, "provisioner", None), "process", None)
        rc = proc.poll() if proc is not None else None
        if rc is None:
            what = "stopped responding"
        elif rc < 0:
            try:
                sig = signal.Signals(-rc)
                what = f"was killed by signal {sig.name} ({signal.strsignal(sig) or ''})".replace(" ()", "")
            except ValueError:
                what = f"was killed by signal {-rc}"
            if rc == -signal.SIGKILL:
                what += "; out of memory? the system's OOM killer sends SIGKILL"
        else:
            what = f"exited with code {rc}"
        try:
            log = (self.tmp / "kernel.log").read_text(errors="replace")
            fatal = [ln.strip() for ln in log.splitlines() if "Fatal Python error" in ln or "MemoryError" in ln]
            if fatal:
                what += f" ({_short(fatal[-1], 120)})"
        except OSError:
            pass
        return what

    async def _alive(self) -> bool:
        try:
            return bool(await self.km.is_alive())
        except Exception:  # noqa: BLE001
            return False

    def kill(self) -> None:
        """Kill every process of this run now."""
        self.dead = True
        stop_processes(self.mark, self.pid, self.before)

    async def execute(self, code: str, limit: float, *, keep_text: bool = False, store_history: bool = True,
                      silent: bool = False) -> _Outcome:
        """Run ``code``; past ``limit`` seconds interrupt, ``KILL_GRACE`` later kill. Never raises."""
        start = time.monotonic()
        if self.dead:
            return _Outcome("died")
        msg_id = self.kc.execute(code, silent=silent, store_history=store_history, allow_stdin=False, stop_on_error=False)
        deadline, interrupted_at = start + max(limit, 0.0), None
        ename = evalue = ""
        text: list[str] = []
        size = 0
        while True:
            now = time.monotonic()
            if interrupted_at is None and now >= deadline:
                try:
                    await self.km.interrupt_kernel()
                except Exception:  # noqa: BLE001 - a dead or stuck kernel is killed below
                    pass
                interrupted_at = now
            elif interrupted_at is not None and now >= interrupted_at + KILL_GRACE:
                self.kill()
                return _Outcome("killed", ename, evalue, "".join(text), now - start)
            wake = (deadline if interrupted_at is None else interrupted_at + KILL_GRACE) - now
            try:
                msg = await self.kc.get_iopub_msg(timeout=max(0.01, min(0.5, wake)))
            except queue.Empty:
                if not await self._alive():
                    self.dead = True
                    return _Outcome("died", ename, evalue, "".join(text), time.monotonic() - start)
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg.get("msg_type"), msg.get("content", {})
            if kind == "stream" and keep_text:
                chunk = content.get("text", "")
                text.append(chunk)
                size += len(chunk)
                while size > 2_000_000 and len(text) > 1:  # keep the tail: the answer is printed last
                    size -= len(text.pop(0))
            elif kind == "error" and not ename:
                ename, evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
            elif kind == "status" and content.get("execution_state") == "idle":
                state = "interrupted" if interrupted_at is not None else ("error" if ename else "ok")
                return _Outcome(state, ename, evalue, "".join(text), time.monotonic() - start)

    async def close(self) -> None:
        """Stop every process this run started, then reap the kernel and remove its files.

        The processes are killed before the kernel is reaped, so that its pid cannot have been
        reused by an unrelated process when its session and descendants are looked up.
        """
        try:
            if self.kc is not None:
                self.kc.stop_channels()
        except Exception:  # noqa: BLE001
            pass
        stop_processes(self.mark, self.pid, self.before)
        try:
            if self.km is not None and self.km.has_kernel:
                await asyncio.wait_for(self.km.shutdown_kernel(now=True), timeout=30)  # reaps the killed kernel
        except Exception:  # noqa: BLE001
            try:
                await asyncio.wait_for(self.km.cleanup_resources(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
        finally:
            stop_processes(self.mark, None, (self.before or set()) | ({self.pid} if self.pid else set())
                           if self.before is not None else None)  # anything that appeared meanwhile
            if self._was_subreaper is False:
                child_subreaper(False)
            if self._log is not None:
                self._log.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- grading a notebook
def _answer(path: Path) -> dict[str, Any] | None:
    """The answer a grader request wrote to ``path`` (in the grader's private folder), or None."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4_000_000)
    except OSError:
        return None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _chapters_of(path: Path, calls: list[CheckCall]) -> list[str]:
    m = re.match(r"(\d{2})_", path.name)
    if m:
        return [m.group(1)]
    chapters: list[str] = []
    for c in calls:
        if _ID_RE.match(c.exercise) and c.exercise[:2] not in chapters and chapter_exercises(c.exercise[:2]):
            chapters.append(c.exercise[:2])
    return chapters


def _file_error(path: Path, message: str, max_points: float = 0.0) -> list[CheckResult]:
    return [CheckResult(path.name, "error", 0.0, max_points, _short(message))]


def grade_notebook(
    path: str | os.PathLike,
    *,
    full: bool = False,
    timeout: float | None = None,
    cell_timeout: float | None = None,
    notebook_timeout: float | None = None,
) -> list[CheckResult]:
    """Execute a lab headless in the current interpreter and return one result per expected exercise.

    ``timeout`` limits each check (default: ``MEMLAB_CHECK_TIMEOUT``, else the exercise's own);
    ``cell_timeout`` each of the notebook's cells (default: max(300, 2 x the longest check limit));
    ``notebook_timeout`` the whole run (default 1800 s). Never raises for what the notebook holds
    or does: an unreadable notebook is one ``error`` row naming the file.
    """
    with needs("memlab grade"):
        import jupyter_client  # noqa: F401 - the kernel is started with it
        import nbformat
    require_installed("ipykernel", "memlab grade")
    path = Path(path)
    limits = {"timeout": timeout, "cell_timeout": cell_timeout, "notebook_timeout": notebook_timeout}
    for name, value in limits.items():
        if value is not None:
            parse_seconds(name, value)
    env_timeout = timeout_from_env()
    import memlab.config  # noqa: F401 - a bad MEMLAB_DEVICE or MEMLAB_SMALL is a ValueError naming it, before any kernel
    if not path.is_file():
        return _file_error(path, f"{path}: no such notebook file")
    try:
        nb = nbformat.read(path, as_version=4)
        calls = check_calls(nb)
    except Exception as exc:  # noqa: BLE001 - one corrupt notebook must not stop a batch
        return _file_error(path, f"{path}: not a readable notebook ({type(exc).__name__}: {_short(str(exc), 160)})")
    try:
        chapters = _chapters_of(path, calls)
        expected = [ex for ch in chapters for ex in chapter_exercises(ch)]
    except Exception as exc:  # noqa: BLE001 - a broken checks module is this notebook's error, not the batch's
        return _file_error(path, f"{path}: the chapter's checks failed to import ({type(exc).__name__}: {_short(str(exc), 160)})")
    if not expected:
        return _file_error(path, f"{path}: no exercises to grade: name the file NN_topic.ipynb after its chapter, "
                                 "or keep its check(\"NN.name\", ...) cells")

    rows: dict[str, CheckResult] = {}
    extra: list[CheckResult] = []
    where: dict[str, CheckCall] = {}  # the last check cell of each expected exercise
    for call in calls:
        if call.exercise in {ex.id for ex in expected}:
            where[call.exercise] = call
            continue
        try:
            get_exercise(call.exercise)
            msg = f"cell {call.cell}: check({call.exercise!r}) is not an exercise of chapter {'/'.join(chapters)}; not graded"
        except ValueError as exc:
            msg = f"cell {call.cell}: {exc}"
        extra.append(CheckResult(call.exercise[:34], "error", 0.0, 0.0, _short(msg)))
    for ex in expected:
        if ex.id not in where:
            rows[ex.id] = CheckResult(ex.id, "missing", 0.0, ex.points,
                                      f'no check("{ex.id}", ...) cell in the notebook: restore it from the lab to be graded')
        elif where[ex.id].name is None:
            rows[ex.id] = CheckResult(ex.id, "error", 0.0, ex.points,
                                      f'cell {where[ex.id].cell}: the check cell must name your object: check("{ex.id}", your_function)')
    todo = [ex for ex in expected if ex.id not in rows]
    if todo:
        limit_of = {ex.id: (timeout or env_timeout or ex.timeout) for ex in todo}
        cell_limit = cell_timeout or max(300.0, 2 * max(limit_of.values()))
        run = _NotebookRun(path, nb, todo, where, limit_of, cell_limit, notebook_timeout or DEFAULT_NOTEBOOK_TIMEOUT, full)
        rows.update(_run_async(run.run()))
    return [rows[ex.id] for ex in expected] + extra


def _run_async(coro: Any) -> Any:
    """Run ``coro`` to completion, also when called from code that already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(coro)))
    th.start()
    th.join()
    return box["r"]


class _NotebookRun:
    """One notebook, run cell by cell in a fresh kernel, each exercise graded right after its check cell."""

    def __init__(self, path: Path, nb: Any, exercises: list[Exercise], where: dict[str, CheckCall],
                 limit_of: dict[str, float], cell_limit: float, notebook_limit: float, full: bool) -> None:
        self.path, self.nb, self.exercises, self.where = path, nb, exercises, where
        self.limit_of, self.cell_limit, self.notebook_limit, self.full = limit_of, cell_limit, notebook_limit, full
        self.rows: dict[str, CheckResult] = {}
        self.cell_notes: dict[str, str] = {}  # exercise -> first trouble in its own cells
        self.timed_out: set[str] = set()

    def _owner(self, cell: int) -> Exercise:
        """The exercise a cell belongs to: the first one whose check cell is at or after it."""
        for ex in sorted(self.exercises, key=lambda e: self.where[e.id].cell):
            if self.where[ex.id].cell >= cell:
                return ex
        return self.exercises[-1]

    def _row(self, ex: Exercise, status: str, message: str, seconds: float = 0.0, points: float = 0.0) -> CheckResult:
        return CheckResult(ex.id, status, min(points, ex.points), ex.points, _short(message), round(seconds, 3))

    async def run(self) -> dict[str, CheckResult]:
        mark = secrets.token_hex(16)
        env = dict(os.environ)
        env.pop("MEMLAB_GRADE_RESULTS", None)
        env.update({GRADING_ENV: "1", RUN_MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})
        if not self.full:
            env["MEMLAB_SMALL"] = "1"
        kernel = _Kernel(self.path.parent.resolve(), env, mark)
        self.t0 = time.monotonic()
        stop: tuple[Exercise, str, str] | None = None  # (exercise, status, why) when the run ended early
        try:
            try:
                await asyncio.wait_for(kernel.start(), timeout=180)
            except BaseException as exc:  # noqa: BLE001
                why = f"the kernel did not start: {type(exc).__name__}: {_short(str(exc), 200)}"
                return {ex.id: self._row(ex, "error", why) for ex in self.exercises}
            grade_after: dict[int, list[Exercise]] = {}
            for ex in self.exercises:
                grade_after.setdefault(self.where[ex.id].cell, []).append(ex)
            last = max(grade_after)
            current = self._owner(0)
            try:
                for i, cell in enumerate(self.nb.cells[: last + 1]):
                    current = self._owner(i)
                    if cell.get("cell_type") == "code" and isinstance(cell.get("source"), str) and cell.source.strip():
                        stop = self._out_of_time(current) or await self._run_cell(kernel, i, cell.source)
                        if stop:
                            break
                    for ex in grade_after.get(i, []):
                        current = ex
                        stop = self._out_of_time(ex) or await self._grade(kernel, ex)
                        if stop:
                            break
                    if stop:
                        break
            except Exception as exc:  # noqa: BLE001 - a bug of the grader is a row, and the batch goes on
                stop = current, "error", f"the grader failed: {type(exc).__name__}: {_short(str(exc), 200)}"
        finally:
            await kernel.close()
        rows = dict(self.rows)
        for ex in self.exercises:
            if ex.id in rows:
                continue
            if stop and ex is stop[0]:
                rows[ex.id] = self._row(ex, stop[1], stop[2])
            elif stop:
                rows[ex.id] = self._row(ex, "not run", f"not run: {stop[2].split(':')[0]} at {stop[0].id}")
            else:  # pragma: no cover - every exercise is graded or the run stopped
                rows[ex.id] = self._row(ex, "error", "the grader never reached this exercise")
        return rows

    def _out_of_time(self, ex: Exercise) -> tuple[Exercise, str, str] | None:
        if self._remaining() > 0:
            return None
        return ex, "timeout", f"timeout: the notebook ran past its {self.notebook_limit:g} s limit"

    def _remaining(self) -> float:
        return self.notebook_limit - (time.monotonic() - self.t0)

    async def _run_cell(self, kernel: _Kernel, i: int, source: str) -> tuple[Exercise, str, str] | None:
        ex = self._owner(i)
        budget = min(self.cell_limit, self._remaining())
        out = await kernel.execute(source, budget)
        over = f"the notebook ran past its {self.notebook_limit:g} s limit" if budget < self.cell_limit else f"ran past {budget:g} s"
        if out.state == "died":
            return ex, "error", f"the kernel died: it {kernel.exit_description()} while cell {i} (of {ex.id}) was running"
        if out.state == "killed":
            self.timed_out.add(ex.id)
            return ex, "timeout", f"timeout: cell {i} {over} and ignored the interrupt: the grader stopped the kernel"
        if out.state == "interrupted":
            self.timed_out.add(ex.id)
            self.cell_notes.setdefault(ex.id, f"cell {i} {over} and was interrupted")
        elif out.state == "error":
            self.cell_notes.setdefault(ex.id, f"cell {i} failed: {out.ename}: {_short(out.evalue, 160)}")
        return None

    async def _grade(self, kernel: _Kernel, ex: Exercise) -> tuple[Exercise, str, str] | None:
        chapter = ex.id[:2]
        memlab_dir = str(Path(__file__).resolve().parent)
        nonce = secrets.token_hex(16)
        answer = kernel.tmp / f"answer-{nonce}.json"
        args = {"dir": memlab_dir, "chapter": chapter, "fingerprint": chapter_fingerprint(chapter), "nonce": nonce,
                "answer": str(answer)}
        budget = min(PREPARE_TIMEOUT, self._remaining())
        out = await kernel.execute(_request(_BOOT_PREPARE, args), budget, store_history=False, silent=True)
        stop = self._ended(kernel, ex, out, "while the grader imported the checks")
        if stop:
            return stop
        ready = _answer(answer)
        if not ready or not ready.get("ok") or ready.get("fingerprint") != args["fingerprint"]:
            why = (ready or {}).get("message") or f"the grader got no answer from the kernel ({out.ename or 'no answer file was written'})"
            self.rows[ex.id] = self._row(ex, "error", why)
            return None
        limit = self.limit_of[ex.id]
        run_nonce = secrets.token_hex(16)
        answer = kernel.tmp / f"answer-{run_nonce}.json"
        run_args = {"exercise": ex.id, "name": self.where[ex.id].name, "limit": limit, "prepared": nonce, "nonce": run_nonce,
                    "answer": str(answer), "dir": memlab_dir}
        budget = min(limit + CHECK_GRACE, self._remaining())
        out = await kernel.execute(_request(_BOOT_RUN, run_args, with_namespace=True), budget, store_history=False,
                                   silent=True)
        over = (f"the notebook ran past its {self.notebook_limit:g} s limit" if budget < limit + CHECK_GRACE
                else f"ran longer than the {limit:g} s limit")
        if out.state == "killed":
            return ex, "timeout", f"timeout: the check {over} and ignored the interrupt: the grader stopped the kernel"
        stop = self._ended(kernel, ex, out, "while its check ran")
        if stop:
            return stop
        if out.state == "interrupted":
            self.rows[ex.id] = self._row(ex, "timeout", f"the check {over}: look for a loop that never ends", out.seconds)
            return None
        res = _answer(answer)
        if res is None:
            self.rows[ex.id] = self._row(ex, "error", f"the grader got no answer from the kernel ({out.ename or 'no answer file was written'})")
            return None
        status = res.get("status") if res.get("status") in STATUSES else "error"
        message = str(res.get("message", ""))
        note = self.cell_notes.get(ex.id)
        if status != "pass" and ex.id in self.timed_out:
            status, message = "timeout", f"{note}; then: {message}" if message else str(note)
        elif status != "pass" and note:
            message = f"{message} ({note})"
        points = ex.points if status == "pass" and not res.get("reference") else 0.0
        if res.get("reference") and status == "pass":
            message = str(res["reference"])
        self.rows[ex.id] = self._row(ex, status, message, float(res.get("seconds") or out.seconds), points)
        return None

    def _ended(self, kernel: _Kernel, ex: Exercise, out: _Outcome, when: str) -> tuple[Exercise, str, str] | None:
        if out.state == "died":
            return ex, "error", f"the kernel died: it {kernel.exit_description()} {when}"
        if out.state == "killed":
            return ex, "timeout", f"timeout: the grader stopped the kernel {when}"
        return None


# ----------------------------------------------------------------------------- memlab grade
def _default_paths() -> tuple[Path, list[Path]]:
    """What ``memlab grade`` grades when no path is given: work/*.ipynb when work/ exists, else labs/*.ipynb."""
    from memlab.labs import default_notebooks

    return default_notebooks()


def _chapter_path(arg: str) -> Path:
    """A PATH argument of ``memlab grade``: a notebook's path, or a chapter number (``4``, ``04``)
    naming that chapter's notebook where ``memlab grade`` looks by default (work/, else labs/)."""
    p = Path(arg)
    if p.exists() or not arg.strip().isdigit():
        return p
    folder, found = _default_paths()
    nn = f"{int(arg):02d}"
    matches = [q for q in found if q.name.startswith(f"{nn}_")]
    if len(matches) != 1:
        allowed = ", ".join(sorted({q.name[:2] for q in found})) or f"none (no {folder}/*.ipynb)"
        raise ValueError(f"chapter {arg!r}: no {folder}/{nn}_*.ipynb; allowed: {allowed}, or a notebook's path")
    return matches[0]


def grade_main(argv: list[str] | None = None) -> int:
    """``memlab grade [PATH ...] [--full] [--timeout S] [--cell-timeout S] [--notebook-timeout S]``.

    Exit code 0 on full marks, 1 otherwise, 2 when an argument, the environment or a file is unusable.
    """
    import argparse

    ap = argparse.ArgumentParser(prog="memlab grade", description="Run lab notebooks headless and grade every exercise.")
    ap.add_argument("paths", nargs="*", metavar="PATH",
                    help="lab notebooks, or chapter numbers (04: work/04_*.ipynb) (default: every work/*.ipynb, "
                         "or labs/*.ipynb when there is no work/)")
    ap.add_argument("--full", action="store_true", help="full scale (default: MEMLAB_SMALL=1)")
    ap.add_argument("--timeout", default=None, metavar="S", help="time limit per check in seconds")
    ap.add_argument("--cell-timeout", default=None, metavar="S", help="time limit per notebook cell (default: max(300, 2 x the check limit))")
    ap.add_argument("--notebook-timeout", default=None, metavar="S",
                    help=f"time limit per notebook, in seconds (default {DEFAULT_NOTEBOOK_TIMEOUT:g})")
    args = ap.parse_args(argv)

    def fail(message: str) -> int:
        print(f"memlab grade: {message}", file=sys.stderr)
        return 2

    limits: dict[str, float | None] = {}
    for flag, raw in (("--timeout", args.timeout), ("--cell-timeout", args.cell_timeout), ("--notebook-timeout", args.notebook_timeout)):
        try:
            limits[flag] = None if raw is None else parse_seconds(flag, raw)
        except ValueError as exc:
            return fail(str(exc))
    try:
        timeout_from_env()
        import memlab.config  # noqa: F401 - MEMLAB_DEVICE and MEMLAB_SMALL, checked once for every notebook
    except ValueError as exc:
        return fail(str(exc))
    try:
        paths = [_chapter_path(p) for p in args.paths]
    except ValueError as exc:
        return fail(str(exc))
    if not paths:
        folder, paths = _default_paths()
        if not paths:
            return fail(f"no PATH given and no {folder}/*.ipynb here: run from the course's root or name a notebook")
    got = total = 0.0
    unusable: list[str] = []
    for p in paths:
        if not p.is_file() or p.suffix != ".ipynb":
            results = _file_error(p, f"{p}: not a notebook file (.ipynb)" if p.is_file() else f"{p}: no such notebook file")
        else:
            results = grade_notebook(p, full=args.full, timeout=limits["--timeout"],
                                     cell_timeout=limits["--cell-timeout"], notebook_timeout=limits["--notebook-timeout"])
        if len(results) == 1 and results[0].exercise == p.name and results[0].status == "error":
            unusable.append(f"{p} ({results[0].message})")
        print(format_table(str(p), results), flush=True)
        print(flush=True)
        got += sum(r.points for r in results)
        total += sum(r.max_points for r in results)
    if len(paths) > 1:
        print(f"{'all labs':<42}{f'{got:g}/{total:g}':>6}")
    if unusable:
        for line in unusable:
            print(f"memlab grade: could not grade {line}", file=sys.stderr)
        return 2
    return 0 if got == total else 1


__all__ = [
    "CheckResult",
    "CheckCall",
    "Exercise",
    "REGISTRY",
    "RESULTS",
    "STATUSES",
    "check",
    "check_calls",
    "chapter_exercises",
    "chapter_fingerprint",
    "exercises_in",
    "register",
    "load_all",
    "get_exercise",
    "grade_notebook",
    "grade_main",
    "parse_seconds",
    "stop_processes",
    "verify_memlab_modules",
    "time_limit",
    "timeout_from_env",
    "CheckTimeout",
]
