"""Running an exercise's checks on a learner's object: time limits, the learner's frame in an
error, memlab's own reference passed off as an answer, and ``check()`` itself."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import inspect
import json
import os
import signal
import sys
import threading
import time
import traceback
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from memlab.course.grading.harness import run_exercise
from memlab.course.grading.provenance import reference_hits, reset_hits, wrapped_reference
from memlab.course.grading.registry import (
    MEMLAB_DIR, STAND_IN_FILE, is_learner_file, is_library_file,
    CHECKS_PACKAGE, GRADING_ENV, RESULTS, WALL_FACTOR, CheckResult, Exercise, chapter_exercises, get_exercise, parse_seconds,
    safe_str, shorten, timeout_from_env,
)


# ----------------------------------------------------------------------------- time limits
class CheckTimeout(BaseException):
    """Raised inside a check that ran past its limit (a BaseException so `except Exception` can't eat it)."""


def thread_cpu_clock(ident: int | None = None) -> Callable[[], float]:
    """A function returning the CPU seconds thread ``ident`` (default: this one) has used.

    POSIX's per-thread CPU clock (``time.pthread_getcpuclockid``); where there is none, the process's
    CPU time (all threads: generous when torch runs several). Time the thread waits for a core on a
    loaded machine, sleeps or blocks is not counted."""
    ident = threading.get_ident() if ident is None else ident
    try:
        clock = time.pthread_getcpuclockid(ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return time.process_time
    return lambda: time.clock_gettime(clock)


def _fire(target: int, on_main: bool) -> None:
    if on_main:
        signal.pthread_kill(target, signal.SIGALRM)
    else:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(CheckTimeout))


@contextmanager
def time_limit(seconds: float | None, *, wall_factor: float = WALL_FACTOR) -> Iterator[None]:
    """Raise CheckTimeout in the current thread once it has used ``seconds`` of CPU time, or after
    ``wall_factor`` x ``seconds`` of wall-clock time, whichever comes first.

    The limit counts this thread's own CPU time (:func:`thread_cpu_clock`), so a correct answer never
    fails for time on a slow or loaded machine; the wall-clock backstop still ends code that sleeps or
    blocks. A watchdog thread polls both clocks and, past a limit, interrupts: on the main thread of a
    POSIX process with SIGALRM (which also breaks a ``time.sleep``), elsewhere by injecting the exception
    with PyThreadState_SetAsyncExc. Both interrupt Python code; a single long C call (one huge matmul)
    is interrupted when it returns. A bare ``except:`` can still swallow it: ``memlab grade`` therefore
    also keeps a deadline of its own, outside the kernel. ``seconds`` None or <= 0: no limit.
    """
    if not seconds or seconds <= 0:
        yield
        return
    target = threading.get_ident()
    cpu = thread_cpu_clock(target)
    on_main = hasattr(signal, "pthread_kill") and threading.current_thread() is threading.main_thread()
    wall0, cpu0 = time.monotonic(), cpu()
    done, fired = threading.Event(), []
    poll = min(0.1, max(0.01, seconds / 20))

    def _alarm(signum: int, frame: Any) -> None:
        raise CheckTimeout(fired[0] if fired else f"ran longer than the {seconds:g} s limit")

    def _watchdog() -> None:
        while not done.wait(poll):
            wall = time.monotonic() - wall0
            used = min(cpu() - cpu0, wall)
            if used >= seconds or wall >= seconds * wall_factor:
                fired.append(f"ran longer than the {seconds:g} s limit" if used >= seconds else
                             f"ran {wall:.0f} s of wall-clock time, {wall_factor:g} x its {seconds:g} s limit")
                _fire(target, on_main)
                return

    previous = signal.signal(signal.SIGALRM, _alarm) if on_main else None
    watchdog = threading.Thread(target=_watchdog, daemon=True, name="memlab-check-watchdog")
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()
        if on_main:
            signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------- running the checks
_TORCH_NOT_IMPLEMENTED = ("Could not run 'aten::", "not implemented for '", "NYI")


def _learner_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The deepest frame that is neither the grader, a check, nor a library: the learner's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if not fr.filename.startswith(MEMLAB_DIR) and not is_library_file(fr.filename):
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



def _run_checks(ex: Exercise, obj: Any, limit: float | None) -> tuple[str, str]:
    """Run every check of ``ex`` on ``obj`` under ``limit`` seconds: (status, message). Never raises."""
    status, message = "pass", ""
    try:
        try:
            with time_limit(limit):
                run_exercise(ex, obj)  # every check, with the hygiene probes and a second run
        except CheckTimeout as exc:
            why = safe_str(exc) or f"ran longer than the {limit:g} s limit"
            status, message = "timeout", f"{why} (CPU time of the check): look for a loop that never ends"
        except NotImplementedError as exc:
            text = safe_str(exc)
            if any(marker in text for marker in _TORCH_NOT_IMPLEMENTED):
                # torch itself said "not implemented" (an op for a dtype/device): a bug, not a stub
                status, message = "error", shorten(f"NotImplementedError: {text}") + _where(_learner_frame(exc))
            else:
                status, message = "todo", shorten(text or "not implemented yet")
        except AssertionError as exc:
            text = safe_str(exc)
            status, message = "fail", shorten(text or "a check did not hold") + _where(_learner_frame(exc) if not text else None)
        except KeyboardInterrupt as exc:
            status, message = "error", "KeyboardInterrupt: your code was interrupted (or raised KeyboardInterrupt)" + _where(_learner_frame(exc))
        except SystemExit as exc:
            status, message = "error", shorten(f"SystemExit({exc.code!r}): your code called sys.exit()") + _where(_learner_frame(exc))
        except BaseException as exc:  # noqa: BLE001 - the learner's code raised
            status, message = "error", shorten(f"{type(exc).__name__}: {safe_str(exc)}") + _where(_learner_frame(exc))
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


_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


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

    started: set[int] = set()  # generator frames already judged at their first entry

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or found or frame.f_code not in codes:
            return
        if frame.f_code.co_flags & _RESUMABLE:
            # a generator's frame gets a "call" event at every resume, and at its close when it is collected,
            # whichever frame runs then (a learner's, for a context manager the check made and left): only its
            # first entry, by the frame that started it, is a call
            if id(frame) in started:
                return
            started.add(id(frame))
        f = frame.f_back
        while f is not None:
            filename = f.f_code.co_filename
            if is_learner_file(filename):
                found.append(codes[frame.f_code])
                return
            if not (is_library_file(filename) or filename.startswith("<frozen") or filename == STAND_IN_FILE):
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


def run_checks_watched(ex: Exercise, obj: Any, limit: float | None) -> tuple[str, str, str]:
    """:func:`_run_checks` under ``limit`` seconds: (status, message, note); the note is '' unless the
    answer is, wraps or calls memlab's reference: by name (:func:`_reference_note`), by what it wraps
    (:func:`~.provenance.wrapped_reference`: a cloned code object, a callable object), by the reference's code
    running while the answer runs (:func:`~.provenance.reference_swapped`, in the harness: a worker thread,
    tracing switched off), or by a call the trace function saw."""
    found: list[str] = []
    reset_hits()
    with _watch_reference(ex, found):
        status, message = _run_checks(ex, obj, limit)
    note = ""
    if status == "pass":
        note = _reference_note(obj, ex)
        ran = reference_hits()
        if not note and (ran or found):
            note = f"calls the reference implementation ({(ran or found)[0]}) from your code: no points"
        wrapped = wrapped_reference(obj, ex) if not note else None
        if wrapped:
            note = f"uses the reference implementation ({wrapped}), not your own code: no points"
    return status, message, note


def check(exercise_id: str, obj: Any, *, timeout: float | None = None, quiet: bool = False) -> CheckResult:
    """Grade ``obj`` (your function or class) for ``exercise_id``; print and return the row.

    Never raises: an exception of ``obj`` becomes ``error``, a leftover ``NotImplementedError``
    stub ``todo``, an assertion of the check ``fail``, running past the time limit ``timeout``;
    an unknown exercise id or a malformed ``MEMLAB_CHECK_TIMEOUT`` is an ``error`` row that says so.
    Passing memlab's own implementation is a ``pass`` row with no points, flagged as such.

    Inside the kernel that ``memlab grade`` starts, ``check`` only marks the cell: the grader
    runs the checks itself, from a fresh import, right after this cell.

    Args:
        exercise_id: ``"NN.name"``, as the lab's check cell writes it.
        obj: your function or class.
        timeout: seconds for all of the exercise's checks (default: ``MEMLAB_CHECK_TIMEOUT``, else the
            exercise's own limit).
        quiet: do not print the row.

    Returns:
        The :class:`CheckResult` (also appended to ``RESULTS``).
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
        result = CheckResult(str(exercise_id)[:60], "error", 0.0, 0.0, shorten(safe_str(exc)))
    else:
        status, message, note = run_checks_watched(ex, obj, limit)
        points = ex.points if status == "pass" else 0.0
        if note:
            points, message = 0.0, note
        result = CheckResult(exercise_id, status, points, ex.points, message, round(time.perf_counter() - start, 3))
    RESULTS.append(result)
    if not quiet:
        print(result.row(), flush=True)
        result._printed = True  # type: ignore[attr-defined]
    return result


# ----------------------------------------------------------------------------- the checks' fingerprint
def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return f"<no source for {obj!r}>"


def chapter_fingerprint(chapter: str) -> str:
    """sha256 (hex) of what grades chapter ``NN``: its exercises, points, limits and the source of its checks.

    The grader computes it in its own process and again inside the kernel after a fresh import;
    the two must agree, or the kernel is not running memlab's checks.
    """
    helpers = importlib.import_module(CHECKS_PACKAGE)
    h = hashlib.sha256()
    h.update(_source(helpers).encode())
    h.update(_source(_run_checks).encode())
    for module in ("memlab.course.grading.harness", "memlab.course.grading.cases", "memlab.course.grading.snapshots",
                   "memlab.course.grading.provenance"):
        h.update(_source(importlib.import_module(module)).encode())
    for ex in chapter_exercises(chapter):
        h.update(json.dumps([ex.id, ex.points, ex.timeout, list(ex.mutates), list(ex.keeps), ex.rerun]).encode())
        for fn in ex.checks:
            h.update(_source(fn).encode())
    return h.hexdigest()

