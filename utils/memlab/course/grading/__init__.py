"""The course's grader.

``check(exercise_id, obj)`` runs an exercise's checks (:mod:`memlab.course.checks`) on a learner's
object under a time limit and prints one row; whatever the learner's code does becomes a row,
never a dead kernel. ``grade_notebook(path)`` (``memlab grade``) executes a lab headless and grades
each exercise right after its check cell from a fresh import of the checks, with memlab's modules
verified against their source before and after (:func:`verify_memlab_modules`); ``run_and_grade(path)``
also runs the cells after the last check and returns the notebook as it ran.

Threat model: tampering from the notebook (a redefined ``check``, forged rows or answers, IPython
hooks, deleted check cells, an ``int`` whose ``==`` is always true, a patched, wrapped or cloned reference
(a cloned code object, a callable object, a worker thread, tracing switched off), a loop that swallows
interrupts, processes left running) has no effect on the grade. A learner who patches the interpreter itself
is not stopped.

Statuses: ``pass``, ``fail`` (a check's assertion did not hold), ``todo`` (the stub still raises
NotImplementedError), ``error``, ``timeout``; ``memlab grade`` adds ``missing`` (no check cell) and
``not run`` (the kernel died or was stopped earlier).

Modules: :mod:`.registry` (exercises, rows), :mod:`.running` (``check``), :mod:`.harness` (the hygiene probes
and the second run every check goes through), :mod:`.cases` (differential cases from a declared input space),
:mod:`.verify`, :mod:`.provenance` (memlab's reference found by what an answer computes with: code
objects, a stand-in while it runs, the grader's own modules),
:mod:`.inkernel` (the requests run in the kernel), :mod:`.kernel` (the kernel from outside),
:mod:`.notebook` (``grade_notebook``), :mod:`.command` (``memlab grade``).
"""
from memlab.course.grading.registry import (
    CHECK_GRACE, DEFAULT_NOTEBOOK_TIMEOUT, DEFAULT_TIMEOUT, GRADING_ENV, KILL_GRACE, MAX_SECONDS, PREPARE_TIMEOUT,
    REGISTRY, RESULTS, RUN_MARK_ENV, STATUSES, TIMEOUT_ENV, WALL_FACTOR, CheckResult, Exercise, chapter_exercises, format_row,
    format_table, get_exercise, load_all, load_chapter, parse_seconds, register, timeout_from_env,
)
from memlab.course.grading.running import CheckTimeout, chapter_fingerprint, check, thread_cpu_clock, time_limit
from memlab.course.grading.verify import is_grader_module, verify_memlab_modules
from memlab.course.grading.kernel import stop_processes
from memlab.course.grading.notebook import CheckCall, check_calls, exercises_in, grade_notebook, run_and_grade
from memlab.course.grading.command import chapter_path, grade_main

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
    "load_chapter",
    "get_exercise",
    "grade_notebook",
    "run_and_grade",
    "grade_main",
    "parse_seconds",
    "stop_processes",
    "verify_memlab_modules",
    "is_grader_module",
    "time_limit",
    "thread_cpu_clock",
    "timeout_from_env",
    "CheckTimeout",
    "format_row",
    "format_table",
    "chapter_path",
    "DEFAULT_TIMEOUT",
    "DEFAULT_NOTEBOOK_TIMEOUT",
    "TIMEOUT_ENV",
    "GRADING_ENV",
    "RUN_MARK_ENV",
    "CHECK_GRACE",
    "WALL_FACTOR",
    "KILL_GRACE",
    "PREPARE_TIMEOUT",
    "MAX_SECONDS",
]
