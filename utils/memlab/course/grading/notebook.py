"""Grading one notebook: find its check cells, run it cell by cell in a fresh kernel and grade each
exercise right after its check cell, from a fresh import of the checks."""
from __future__ import annotations

import asyncio
import copy
import json
import keyword
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlab.course.grading.inkernel import BOOT_PREPARE, BOOT_RUN, request
from memlab.course.grading.kernel import Kernel, Outcome
from memlab.course.grading.registry import (
    CHECK_GRACE, DEFAULT_NOTEBOOK_TIMEOUT, EXERCISE_ID, WALL_FACTOR, GRADING_ENV, PREPARE_TIMEOUT, RUN_MARK_ENV, STATUSES,
    CheckResult, Exercise, chapter_exercises, get_exercise, parse_seconds, shorten, timeout_from_env,
)
from memlab.course.grading.running import MEMLAB_DIR, chapter_fingerprint
from memlab.course.grading.verify import GRADER_PACKAGES
from memlab.core.optional import needs, require_installed


# ----------------------------------------------------------------------------- the notebook's check cells
_CHECK_CALL = re.compile(r"""\bcheck\(\s*(["'])([^"'\n]{1,80})\1\s*(?:,\s*([A-Za-z_][\w.]*)(?=\s*[,)]))?""")


@dataclass
class CheckCall:
    """A ``check("NN.name", obj)`` call in a notebook: the id, the object's name, the cell."""

    exercise: str
    name: str | None
    cell: int


def check_calls(nb: Any) -> list[CheckCall]:
    """Every ``check("...", name)`` call in the notebook's code cells, in order (unknown ids included);
    a commented-out call does not count."""
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
        if EXERCISE_ID.match(call.exercise):
            seen.setdefault(call.exercise, call.cell)
    return list(seen.items())


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
        if EXERCISE_ID.match(c.exercise) and c.exercise[:2] not in chapters and chapter_exercises(c.exercise[:2]):
            chapters.append(c.exercise[:2])
    return chapters


def file_error(path: Path, message: str, max_points: float = 0.0) -> list[CheckResult]:
    """The rows of a notebook that cannot be graded at all: one ``error`` row named after the file."""
    return [CheckResult(path.name, "error", 0.0, max_points, shorten(message))]


def _sort_calls(calls: list[CheckCall], expected: list[Exercise], chapters: list[str]
                ) -> tuple[dict[str, CheckResult], list[CheckResult], dict[str, CheckCall]]:
    """The check cells of a notebook, sorted out before it runs: (rows already decided: missing
    or unnamed check cells; error rows of check cells that are not this chapter's; the last check
    cell of each expected exercise)."""
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
        extra.append(CheckResult(call.exercise[:34], "error", 0.0, 0.0, shorten(msg)))
    for ex in expected:
        if ex.id not in where:
            rows[ex.id] = CheckResult(ex.id, "missing", 0.0, ex.points,
                                      f'no check("{ex.id}", ...) cell in the notebook: restore it from the lab to be graded')
        elif where[ex.id].name is None:
            rows[ex.id] = CheckResult(ex.id, "error", 0.0, ex.points,
                                      f'cell {where[ex.id].cell}: the check cell must name your object: check("{ex.id}", your_function)')
    return rows, extra, where


def grade_notebook(
    path: str | os.PathLike,
    *,
    full: bool = False,
    timeout: float | None = None,
    cell_timeout: float | None = None,
    notebook_timeout: float | None = None,
) -> list[CheckResult]:
    """Execute a lab headless in the current interpreter and return one result per expected exercise.

    The cells run up to the last check cell. ``full``: full scale (default: ``MEMLAB_SMALL=1`` in
    the kernel). ``timeout`` limits each check (default: ``MEMLAB_CHECK_TIMEOUT``, else the
    exercise's own); ``cell_timeout`` each of the notebook's cells (default: max(300, 2 x the longest
    check limit)); ``notebook_timeout`` the whole run (default 1800 s), all in seconds. Never raises
    for what the notebook holds or does: an unreadable notebook is one ``error`` row naming the file.

    Returns:
        One :class:`CheckResult` per exercise of the chapter (registry order), then one ``error``
        row per check cell of another chapter or of an unknown id.

    Raises:
        ValueError: for a malformed limit, ``MEMLAB_CHECK_TIMEOUT``, ``MEMLAB_DEVICE`` or ``MEMLAB_SMALL``.
    """
    return _grade(Path(path), False, full=full, timeout=timeout, cell_timeout=cell_timeout,
                  notebook_timeout=notebook_timeout)[0]


def run_and_grade(path: str | os.PathLike, **limits: Any) -> tuple[list[CheckResult], Any]:
    """:func:`grade_notebook` (same keywords) that runs every code cell, also those after the last
    check cell, and returns with the rows the notebook as this run left it (None when it could not be
    read): each code cell's outputs and execution count from the run, none for a cell that did not
    run, an error output naming the cause for a cell in which the kernel died or was stopped.

    In the grader's kernel ``check()`` only marks its cell: a check cell shows no row there, the
    rows returned are its grade. The test suite executes each solution once, this way.
    """
    return _grade(Path(path), True, **limits)


def _grade(path: Path, keep_outputs: bool, *, full: bool = False, timeout: float | None = None,
           cell_timeout: float | None = None, notebook_timeout: float | None = None) -> tuple[list[CheckResult], Any]:
    with needs("memlab grade"):
        import jupyter_client  # noqa: F401 - the kernel is started with it
        import nbformat
    require_installed("ipykernel", "memlab grade")
    limits = {"timeout": timeout, "cell_timeout": cell_timeout, "notebook_timeout": notebook_timeout}
    for name, value in limits.items():
        if value is not None:
            parse_seconds(name, value)
    env_timeout = timeout_from_env()
    import memlab.config  # noqa: F401 - a bad MEMLAB_DEVICE or MEMLAB_SMALL is a ValueError naming it, before any kernel
    if not path.is_file():
        return file_error(path, f"{path}: no such notebook file"), None
    try:
        nb = nbformat.read(path, as_version=4)
        calls = check_calls(nb)
    except Exception as exc:  # noqa: BLE001 - one corrupt notebook must not stop a batch
        return file_error(path, f"{path}: not a readable notebook ({type(exc).__name__}: {shorten(str(exc), 160)})"), None
    executed = _blank_copy(nb) if keep_outputs else None
    try:
        chapters = _chapters_of(path, calls)
        expected = [ex for ch in chapters for ex in chapter_exercises(ch)]
    except Exception as exc:  # noqa: BLE001 - a broken checks module is this notebook's error, not the batch's
        why = f"{path}: the chapter's checks failed to import ({type(exc).__name__}: {shorten(str(exc), 160)})"
        return file_error(path, why), executed
    if not expected:
        return file_error(path, f"{path}: no exercises to grade: name the file NN_topic.ipynb after its chapter, "
                                 "or keep its check(\"NN.name\", ...) cells"), executed

    rows, extra, where = _sort_calls(calls, expected, chapters)
    todo = [ex for ex in expected if ex.id not in rows]
    if todo:
        limit_of = {ex.id: (timeout or env_timeout or ex.timeout) for ex in todo}
        cell_limit = cell_timeout or max(300.0, 2 * max(limit_of.values()))
        run = _NotebookRun(path, nb, todo, where, limit_of, cell_limit, notebook_timeout or DEFAULT_NOTEBOOK_TIMEOUT, full,
                           executed)
        rows.update(_run_async(run.run()))
    return [rows[ex.id] for ex in expected] + extra, executed


def _blank_copy(nb: Any) -> Any:
    """``nb`` with no outputs and no execution counts: what a run fills in."""
    blank = copy.deepcopy(nb)
    for cell in blank.cells:
        if cell.get("cell_type") == "code":
            cell.outputs, cell.execution_count = [], None
    return blank


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
    """One notebook, run cell by cell in a fresh kernel, each exercise graded right after its check cell.
    With ``executed`` (a blank copy of the notebook) every code cell runs and leaves its outputs there."""

    def __init__(self, path: Path, nb: Any, exercises: list[Exercise], where: dict[str, CheckCall],
                 limit_of: dict[str, float], cell_limit: float, notebook_limit: float, full: bool,
                 executed: Any | None = None) -> None:
        self.path, self.nb, self.exercises, self.where = path, nb, exercises, where
        self.limit_of, self.cell_limit, self.notebook_limit, self.full = limit_of, cell_limit, notebook_limit, full
        self.executed = executed
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
        return CheckResult(ex.id, status, min(points, ex.points), ex.points, shorten(message), round(seconds, 3))

    async def run(self) -> dict[str, CheckResult]:
        mark = secrets.token_hex(16)
        env = dict(os.environ)
        env.pop("MEMLAB_GRADE_RESULTS", None)
        env.update({GRADING_ENV: "1", RUN_MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})
        if not self.full:
            env["MEMLAB_SMALL"] = "1"
        kernel = Kernel(self.path.parent.resolve(), env, mark)
        self.t0 = time.monotonic()
        stop: tuple[Exercise, str, str] | None = None  # (exercise, status, why) when the run ended early
        try:
            try:
                await asyncio.wait_for(kernel.start(), timeout=180)
            except BaseException as exc:  # noqa: BLE001
                why = f"the kernel did not start: {type(exc).__name__}: {shorten(str(exc), 200)}"
                return {ex.id: self._row(ex, "error", why) for ex in self.exercises}
            grade_after: dict[int, list[Exercise]] = {}
            for ex in self.exercises:
                grade_after.setdefault(self.where[ex.id].cell, []).append(ex)
            last = len(self.nb.cells) - 1 if self.executed is not None else max(grade_after)
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
                stop = current, "error", f"the grader failed: {type(exc).__name__}: {shorten(str(exc), 200)}"
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

    async def _run_cell(self, kernel: Kernel, i: int, source: str) -> tuple[Exercise, str, str] | None:
        ex = self._owner(i)
        budget = min(self.cell_limit, self._remaining())
        out = await kernel.execute(source, budget, keep_outputs=self.executed is not None)
        over = f"the notebook ran past its {self.notebook_limit:g} s limit" if budget < self.cell_limit else f"ran past {budget:g} s"
        stop: tuple[Exercise, str, str] | None = None
        if out.state == "died":
            stop = ex, "error", f"the kernel died: it {kernel.exit_description()} while cell {i} (of {ex.id}) was running"
        elif out.state == "killed":
            self.timed_out.add(ex.id)
            stop = ex, "timeout", f"timeout: cell {i} {over} and ignored the interrupt: the grader stopped the kernel"
        elif out.state == "interrupted":
            self.timed_out.add(ex.id)
            self.cell_notes.setdefault(ex.id, f"cell {i} {over} and was interrupted")
        elif out.state == "error":
            self.cell_notes.setdefault(ex.id, f"cell {i} failed: {out.ename}: {shorten(out.evalue, 160)}")
        if self.executed is not None:
            self._keep(i, out, stop)
        return stop

    def _keep(self, i: int, out: Outcome, stop: tuple[Exercise, str, str] | None) -> None:
        import nbformat

        cell = self.executed.cells[i]
        cell.outputs, cell.execution_count = out.outputs, out.execution_count
        if stop is not None:  # nbclient would raise here: say why in the cell
            cell.outputs.append(nbformat.v4.new_output("error", ename=f"Kernel{out.state.capitalize()}",
                                                       evalue=stop[2], traceback=[]))

    async def _grade(self, kernel: Kernel, ex: Exercise) -> tuple[Exercise, str, str] | None:
        chapter = ex.id[:2]
        memlab_dir = MEMLAB_DIR
        nonce = secrets.token_hex(16)
        answer = kernel.tmp / f"answer-{nonce}.json"
        args = {"dir": memlab_dir, "chapter": chapter, "fingerprint": chapter_fingerprint(chapter), "nonce": nonce,
                "answer": str(answer), "packages": list(GRADER_PACKAGES)}
        budget = min(PREPARE_TIMEOUT, self._remaining())
        out = await kernel.execute(request(BOOT_PREPARE, args), budget, store_history=False, silent=True)
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
        # the check's limit counts CPU time (of the kernel's main thread, where it runs); wall-clock time only
        # as a backstop, WALL_FACTOR x the limit: a loaded machine does not make a right answer time out
        backstop = limit * WALL_FACTOR + CHECK_GRACE
        budget = min(backstop, self._remaining())
        out = await kernel.execute(request(BOOT_RUN, run_args, with_namespace=True), budget, store_history=False,
                                   silent=True, cpu_limit=limit + CHECK_GRACE)
        over = (f"the notebook ran past its {self.notebook_limit:g} s limit" if budget < backstop
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

    def _ended(self, kernel: Kernel, ex: Exercise, out: Outcome, when: str) -> tuple[Exercise, str, str] | None:
        if out.state == "died":
            return ex, "error", f"the kernel died: it {kernel.exit_description()} {when}"
        if out.state == "killed":
            return ex, "timeout", f"timeout: the grader stopped the kernel {when}"
        return None

