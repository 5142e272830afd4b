"""``memlab grade``: its command line."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from memlab.course.grading.notebook import exercises_in, file_error, grade_notebook
from memlab.course.grading.registry import (
    DEFAULT_NOTEBOOK_TIMEOUT, CheckResult, chapter_exercises, format_table, parse_seconds, timeout_from_env,
)


# ----------------------------------------------------------------------------- memlab grade
def _default_paths() -> tuple[Path, list[Path]]:
    """What ``memlab grade`` grades when no path is given: work/*.ipynb when work/ exists, else labs/*.ipynb."""
    from memlab.course.labs import default_notebooks

    return default_notebooks()


def chapter_path(arg: str) -> Path:
    """A PATH argument of ``memlab grade``: a notebook's path, or a chapter number (``4``, ``04``)
    naming that chapter's notebook where ``memlab grade`` looks by default (work/, else labs/).
    ValueError, listing the chapters there are, for a chapter number with no notebook and for a
    word that is neither an existing file nor a notebook's path (``xx``, ``²``).
    """
    p = Path(arg)
    if p.exists():
        return p
    if not re.fullmatch(r"[0-9]{1,6}", arg.strip()) and (p.suffix == ".ipynb" or len(p.parts) > 1):
        return p  # a notebook's path that is missing: graded as an error row, the batch goes on
    folder, found = _default_paths()
    allowed = ", ".join(sorted({q.name[:2] for q in found if re.match(r"[0-9]{2}_", q.name)}))
    allowed = f"{allowed}, or a notebook's path" if allowed else f"a notebook's path (no {folder}/NN_*.ipynb here)"
    if not re.fullmatch(r"[0-9]{1,6}", arg.strip()):
        raise ValueError(f"PATH={arg!r} is neither a notebook file nor a chapter number; allowed: {allowed}")
    nn = f"{int(arg):02d}"
    matches = [q for q in found if q.name.startswith(f"{nn}_")]
    if len(matches) != 1:
        raise ValueError(f"chapter {arg!r}: no {folder}/{nn}_*.ipynb; allowed: {allowed}")
    return matches[0]


def in_notebook_order(path: Path, results: list[CheckResult]) -> list[CheckResult]:
    """``results`` (registry order) in the order the notebook checks them: an exercise the notebook
    does not check (MISSING) stays after the one the registry puts before it; rows that are no
    exercise of the chapter stay last."""
    try:
        import nbformat

        first = {ex: i for i, (ex, _) in enumerate(exercises_in(nbformat.read(path, as_version=4)))}
    except Exception:  # noqa: BLE001 - an unreadable notebook is already one error row
        return results
    graded = [r for r in results if r.max_points > 0]  # the chapter's exercises (points > 0); then the other rows
    keys: list[float] = []
    last = -1.0
    for r in graded:
        last = float(first[r.exercise]) if r.exercise in first else last + 1e-3
        keys.append(last)
    order = sorted(range(len(graded)), key=lambda i: keys[i])
    return [graded[i] for i in order] + [r for r in results if r.max_points <= 0]


def _unchanged(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(changed, unchanged): the work/ notebooks with the learner's changes since `memlab labs start`
    or `reset` copied them, and those without."""
    from memlab.course.workspace import unchanged_since_copy

    changed, same = [], []
    for p in paths:
        (same if unchanged_since_copy(p) else changed).append(p)
    return changed, same


def _points_of(path: Path) -> float:
    """The points of the chapter a notebook ``NN_topic.ipynb`` belongs to (0 when unknown)."""
    m = re.match(r"([0-9]{2})_", path.name)
    try:
        return sum(ex.points for ex in chapter_exercises(m.group(1))) if m else 0.0
    except Exception:  # noqa: BLE001 - a checks module that cannot import: graded (and reported) when it changes
        return 0.0


def grade_main(argv: list[str] | None = None) -> int:
    """``memlab grade [PATH ...] [--all] [--full] [--timeout S] [--cell-timeout S] [--notebook-timeout S]``.

    With no PATH it grades the notebooks of work/ changed since `memlab labs start` or `reset`
    copied them (``--all``: every one; labs/ when there is no work/). Returns the exit code: 0 on
    full marks, 1 otherwise, 2 when an argument, the environment or a file is unusable.
    """
    import argparse

    ap = argparse.ArgumentParser(prog="memlab grade", description="Run lab notebooks headless and grade every exercise.")
    ap.add_argument("paths", nargs="*", metavar="PATH",
                    help="lab notebooks, or chapter numbers (04: work/04_*.ipynb) (default: the work/*.ipynb you "
                         "changed since they were copied, or labs/*.ipynb when there is no work/)")
    ap.add_argument("--all", action="store_true", help="with no PATH: grade every work/*.ipynb, changed or not")
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
        paths = [chapter_path(p) for p in args.paths]
    except ValueError as exc:
        return fail(str(exc))
    if args.all and paths:
        return fail("--all grades every notebook of the default folder: give it no PATH")
    skipped: list[Path] = []
    if not paths:
        folder, paths = _default_paths()
        if not paths:
            return fail(f"no PATH given and no {folder}/*.ipynb here: run from the course's root or name a notebook")
        if folder.name == "work" and not args.all:
            paths, skipped = _unchanged(paths)
    got = total = 0.0
    unusable: list[str] = []
    for p in paths:
        if not p.is_file() or p.suffix != ".ipynb":
            results = file_error(p, f"{p}: not a notebook file (.ipynb)" if p.is_file() else f"{p}: no such notebook file")
        else:
            results = in_notebook_order(p, grade_notebook(
                p, full=args.full, timeout=limits["--timeout"], cell_timeout=limits["--cell-timeout"],
                notebook_timeout=limits["--notebook-timeout"]))
        if len(results) == 1 and results[0].exercise == p.name and results[0].status == "error":
            unusable.append(f"{p} ({results[0].message})")
        print(format_table(str(p), results), flush=True)
        print(flush=True)
        got += sum(r.points for r in results)
        total += sum(r.max_points for r in results)
    if skipped:
        total += sum(_points_of(p) for p in skipped)
        print(f"not graded, unchanged since copied (every exercise TODO): {', '.join(p.name for p in skipped)} "
              f"(`memlab grade --all` grades them too)", flush=True)
    if len(paths) + len(skipped) > 1:
        print(f"{'all labs':<42}{f'{got:g}/{total:g}':>6}")
    if unusable:
        for line in unusable:
            print(f"memlab grade: could not grade {line}", file=sys.stderr)
        return 2
    return 0 if got == total else 1
