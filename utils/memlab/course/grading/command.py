"""``memlab grade``: its command line."""
from __future__ import annotations

import sys
from pathlib import Path

from memlab.course.grading.notebook import file_error, grade_notebook
from memlab.course.grading.registry import DEFAULT_NOTEBOOK_TIMEOUT, format_table, parse_seconds, timeout_from_env


# ----------------------------------------------------------------------------- memlab grade
def _default_paths() -> tuple[Path, list[Path]]:
    """What ``memlab grade`` grades when no path is given: work/*.ipynb when work/ exists, else labs/*.ipynb."""
    from memlab.course.labs import default_notebooks

    return default_notebooks()


def chapter_path(arg: str) -> Path:
    """A PATH argument of ``memlab grade``: a notebook's path, or a chapter number (``4``, ``04``)
    naming that chapter's notebook where ``memlab grade`` looks by default (work/, else labs/).
    ValueError for a chapter number with no notebook, listing those there are.
    """
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

    Returns the exit code: 0 on full marks, 1 otherwise, 2 when an argument, the environment or a
    file is unusable.
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
        paths = [chapter_path(p) for p in args.paths]
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
            results = file_error(p, f"{p}: not a notebook file (.ipynb)" if p.is_file() else f"{p}: no such notebook file")
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


