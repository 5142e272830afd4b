"""``memlab labs``: generate labs/ from solutions/, and keep a learner's own copies in work/.

A lab is its solution notebook with each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block
replaced by one ``raise NotImplementedError("exercise NN.name: ...")`` line (the id is the first
``check("NN.name", ...)`` at or after the block), cells tagged ``solution-only`` dropped, a first
line ``# NBVAL_CHECK_OUTPUT`` moved into the cell tag ``nbval-check-output``, outputs and timing
metadata cleared, and the metadata JupyterLab writes on opening added (opening and saving a lab
changes nothing). Building is deterministic (``memlab labs check`` compares bytes), all or
nothing, and never overwrites a learner's code without ``force=True``. ``memlab labs start``
copies the labs into ``work/`` without overwriting; ``reset NN`` moves the learner's copy into
``work/backups/`` (one rename; refused while a save may be under way) and copies a fresh one.
Exit codes: 0 done, 1 a file problem or drift, 2 a bad argument (a chapter with no lab).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from memlab.course.workspace import (  # the workspace is part of memlab.course.labs' API
    BACKUPS, WORK, LabArgumentError, LabFileError, default_notebooks, fix_for_os_error, is_complete_notebook,
    lab_file_errors, refuse_link, reset, start, unchanged_since_copy,
)
from memlab.core.optional import needs

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
SOLUTION_ONLY = "solution-only"
_TIMING_KEYS = ("execution", "ExecuteTime", "collapsed", "scrolled")
_CHECK_ID = re.compile(r"""\bcheck\(\s*["'](\d{2}\.\w+)["']""")
#: a whole line that is a solution marker; group 1 is "begin" or "end"
_MARKER_LINE = re.compile(r"^\s*#+\s*(begin|end)[\s_-]+solution\s*$", re.IGNORECASE)
#: a solution marker anywhere in a line (what must never reach a lab)
_MARKER_ANYWHERE = re.compile(r"#+\s*(begin|end)[\s_-]+solution\b", re.IGNORECASE)
_STUB = re.compile(r"""raise NotImplementedError\("exercise (\d{2}\.\w+): replace this line with your code"\)""")

#: what JupyterLab 4 writes into a notebook's metadata when ipykernel's python3 kernel opens it
KERNELSPEC: dict[str, str] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO: dict[str, Any] = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
}

__all__ = [
    "BEGIN", "END", "SOLUTION_ONLY", "KERNELSPEC", "LANGUAGE_INFO", "LabBuildError", "stub_line", "build_lab",
    "render", "expected_lab", "find_markers", "learner_exercises", "LabFileError", "is_complete_notebook", "build",
    "drift", "start", "reset", "default_notebooks", "main", "WORK", "BACKUPS", "LabArgumentError",
    "unchanged_since_copy",
]


class LabBuildError(ValueError):
    """A solution notebook cannot become a lab, or a lab must not be overwritten. The message is
    one line per problem and names the file and the cell."""


def stub_line(indent: str, exercise_id: str) -> str:
    """The ``raise NotImplementedError(...)`` line, indented by ``indent``, that replaces a solution block in the lab."""
    return f'{indent}raise NotImplementedError("exercise {exercise_id}: replace this line with your code")'


def _where(name: str, index: int, cell: Any) -> str:
    cell_id = cell.get("id")
    return f"{name}: cell {index}" + (f" (id {cell_id})" if cell_id else "")


def _strip_solutions(source: str, exercise_id: str | None, where: str) -> str:
    """``source`` with every solution block replaced by its stub line."""
    out: list[str] = []
    inside = False
    for lineno, line in enumerate(source.split("\n"), start=1):
        full = _MARKER_LINE.match(line)
        if full is None and _MARKER_ANYWHERE.search(line):
            raise LabBuildError(
                f"{where}, line {lineno}: a solution marker must stand on a line of its own, got {line.strip()!r}"
            )
        kind = full.group(1).lower() if full else None
        if kind == "begin":
            if inside:
                raise LabBuildError(f"{where}, line {lineno}: '{BEGIN}' inside another solution block (nested)")
            if exercise_id is None:
                raise LabBuildError(f"{where}, line {lineno}: a solution block with no check(\"NN.name\", ...) at or after it")
            inside = True
            out.append(stub_line(line[: len(line) - len(line.lstrip())], exercise_id))
        elif kind == "end":
            if not inside:
                raise LabBuildError(f"{where}, line {lineno}: '{END}' without '{BEGIN}' (unbalanced)")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise LabBuildError(f"{where}: '{BEGIN}' is never closed by '{END}' (unbalanced)")
    return "\n".join(out)


def _exercise_after(cells: Sequence[Any], start: int) -> str | None:
    """The id of the first ``check("NN.name", ...)`` in a code cell at or after ``start``."""
    for later in cells[start:]:
        if later.cell_type == "code":
            m = _CHECK_ID.search(later.source)
            if m:
                return m.group(1)
    return None


#: nbval's first-line comments and the cell tags nbval reads the same way (nbval/plugin.py:
#: ``metadata_tags`` is each comment marker lower-cased with ``-`` for ``_``)
NBVAL_TAGS = {
    "# NBVAL_CHECK_OUTPUT": "nbval-check-output",
    "# NBVAL_IGNORE_OUTPUT": "nbval-ignore-output",
    "# NBVAL_SKIP": "nbval-skip",
}


def _nbval_comment_to_tag(cell: Any) -> None:
    """A lab shows the learner no nbval marker: a first line ``# NBVAL_CHECK_OUTPUT`` (the
    solutions' convention) becomes the cell tag ``nbval-check-output``, which nbval honours alike."""
    first, nl, rest = cell.source.partition("\n")
    tag = NBVAL_TAGS.get(first.strip())
    if tag is None:
        return
    cell.source = rest if nl else ""
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    if tag not in tags:
        tags.append(tag)


def build_lab(solution: Any, name: str = "notebook") -> Any:
    """Return the lab notebook (an nbformat node) made from a solution notebook; the solution is
    not modified. Raises :class:`LabBuildError` naming ``name`` (the file's) and the cell on a bad marker.
    """
    nb = copy.deepcopy(solution)
    cells = []
    for i, cell in enumerate(nb.cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if SOLUTION_ONLY in tags:
            continue
        where = _where(name, i, cell)
        if cell.cell_type == "code":
            if _MARKER_ANYWHERE.search(cell.source):
                cell.source = _strip_solutions(cell.source, _exercise_after(nb.cells, i), where)
            _nbval_comment_to_tag(cell)
            cell.outputs = []
            cell.execution_count = None
        else:
            m = _MARKER_ANYWHERE.search(cell.source)
            if m:
                raise LabBuildError(
                    f"{where}: a solution marker {m.group(0)!r} in a {cell.cell_type} cell; allowed only in code cells"
                )
        for key in _TIMING_KEYS:
            cell.get("metadata", {}).pop(key, None)
        cells.append(cell)
    nb.cells = cells
    version = nb.metadata.get("language_info", {}).get("version")
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {**copy.deepcopy(LANGUAGE_INFO), **({"version": version} if version else {})}
    return nb


def render(nb: Any) -> str:
    """The bytes (as text) a notebook is stored with: nbformat's JSON plus a final newline."""
    with needs("memlab labs"):
        import nbformat

    return nbformat.writes(nb) + "\n"


def _read(path: Path) -> Any:
    with needs("memlab labs"):
        import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except ImportError:
        raise
    except Exception as exc:  # unreadable file, bad JSON, invalid notebook
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise LabBuildError(f"{path}: not a readable notebook ({type(exc).__name__}: {first})") from None


def _pairs(root: Path) -> list[tuple[Path, Path]]:
    sol_dir = root / "solutions"
    if not sol_dir.is_dir():
        raise FileNotFoundError(f"root={str(root)!r} has no solutions/ folder: run from the course's root")
    return [(p, root / "labs" / p.name) for p in sorted(sol_dir.glob("*.ipynb"))]


def expected_lab(solution_path: Path) -> str:
    """The text ``memlab labs build`` writes for ``solution_path`` (``solutions/NN_topic.ipynb``)."""
    return render(build_lab(_read(Path(solution_path)), name=str(solution_path)))


def find_markers(nb: Any, name: str = "notebook") -> list[str]:
    """One line, naming the file ``name``, per cell of ``nb`` that holds a solution marker (any case,
    any number of ``#``); [] when there is none."""
    found = []
    for i, cell in enumerate(nb.cells):
        m = _MARKER_ANYWHERE.search(cell.source)
        if m:
            found.append(f"{_where(name, i, cell)}: contains the solution marker {m.group(0)!r}: the solution leaks")
    return found


def learner_exercises(lab: Any, expected: Any | None = None) -> list[str]:
    """Exercise ids whose stub ``lab`` no longer holds: the learner wrote code there.

    An exercise is one checked by a ``check("NN.name", ...)`` cell of ``lab``; it holds learner code
    when ``lab`` has fewer stub lines for it than ``expected`` (the freshly generated lab; one stub
    when ``expected`` is None or lacks the exercise). The ids come in notebook order.
    """

    def stubs(nb: Any) -> dict[str, int]:
        counts: dict[str, int] = {}
        for cell in nb.cells:
            if cell.cell_type == "code":
                for m in _STUB.finditer(cell.source):
                    counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        return counts

    have = stubs(lab)
    want = stubs(expected) if expected is not None else {}
    checked: list[str] = []
    for cell in lab.cells:
        if cell.cell_type == "code":
            for m in _CHECK_ID.finditer(cell.source):
                if m.group(1) not in checked:
                    checked.append(m.group(1))
    return [ex for ex in checked if have.get(ex, 0) < max(want.get(ex, 1), 1)]


def _write_atomically(files: dict[Path, str]) -> None:
    """Write every ``path: text`` or none: all texts go to temporary files beside their targets
    first, then each is renamed over its target; a failure restores what was there before."""
    temps: dict[Path, str] = {}
    try:
        for path, text in files.items():
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            temps[path] = tmp
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, (path.stat().st_mode & 0o777) if path.exists() else 0o644)
    except BaseException:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    previous = {path: (path.read_bytes() if path.exists() else None) for path in files}
    replaced: list[Path] = []
    try:
        for path, tmp in temps.items():
            os.replace(tmp, path)
            replaced.append(path)
    except BaseException:
        for path in replaced:
            old = previous[path]
            with contextlib.suppress(OSError):
                if old is None:
                    path.unlink()
                else:
                    path.write_bytes(old)
        for path, tmp in temps.items():
            if path not in replaced:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        raise


def build(root: str | Path = ".", *, force: bool = False) -> list[Path]:
    """Write labs/ from solutions/ and return the labs that changed.

    Every lab is generated in memory first (a bad solution raises :class:`LabBuildError` before
    anything is written); then the changed ones are written atomically, all or nothing. A lab
    that holds a learner's code is never overwritten unless ``force`` is true: the build stops
    with a :class:`LabBuildError` naming it and writes nothing.
    """
    root = Path(root)
    pairs = _pairs(root)
    generated = {}
    for sol, lab in pairs:
        nb = build_lab(_read(sol), name=str(sol))
        generated[lab] = (nb, render(nb))
    changed: dict[Path, str] = {}
    protected: list[str] = []
    for lab, (nb, text) in generated.items():
        if lab.exists():
            if lab.read_text(encoding="utf-8") == text:
                continue
            if not force:
                mine = learner_exercises(_read(lab), nb)
                if mine:
                    protected.append(
                        f"{lab}: holds your code for {', '.join(mine)}: not overwritten "
                        f"(work in {WORK}/ via `memlab labs start`; `memlab labs build --force` discards it)"
                    )
                    continue
        changed[lab] = text
    if protected:
        raise LabBuildError("\n".join(protected))
    with lab_file_errors("labs build"):
        refuse_link(root / "labs")
        (root / "labs").mkdir(exist_ok=True)
        _write_atomically(changed)
    return sorted(changed)


def _same_lab(actual: str, expected: str) -> bool:
    """Byte-equal, or equal but for ``language_info.version`` (the Python version JupyterLab
    records when it saves a lab on another machine)."""
    if actual == expected:
        return True
    try:
        a, b = json.loads(actual), json.loads(expected)
    except ValueError:
        return False
    for nb in (a, b):
        if isinstance(nb, dict):
            nb.get("metadata", {}).get("language_info", {}).pop("version", None)
    return a == b


def drift(root: str | Path = ".") -> list[str]:
    """One line per problem ([] when labs/ is in sync): labs that differ from what build() would
    write, labs with no solution, labs holding a solution marker."""
    root = Path(root)
    problems = []
    pairs = _pairs(root)
    for sol, lab in pairs:
        if not lab.exists():
            problems.append(f"{lab}: missing (run `memlab labs build`)")
        elif not _same_lab(lab.read_text(encoding="utf-8"), expected_lab(sol)):
            problems.append(f"{lab}: differs from what {sol} generates (run `memlab labs build`; never edit labs/ by hand)")
    known = {lab.name for _, lab in pairs}
    for lab in sorted((root / "labs").glob("*.ipynb")):
        if lab.name not in known:
            problems.append(f"{lab}: has no solutions/{lab.name}")
        problems.extend(find_markers(_read(lab), name=str(lab)))
    return problems


def main(argv: list[str] | None = None) -> int:
    """``memlab labs build [--force] | check | start | reset NN``; returns the exit code."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="memlab labs",
        description=(
            "build: generate labs/ from solutions/; check: report drift and leaked solution markers; "
            f"start: copy the labs you do not have yet into {WORK}/; reset NN: move {WORK}/NN_* into "
            f"{WORK}/{BACKUPS}/ and copy a fresh one (refused while it is being saved). Exit codes: 0 done, "
            "1 a file problem or drift, 2 a bad argument"
        ),
    )
    ap.add_argument("action", choices=["build", "check", "start", "reset"])
    ap.add_argument("chapter", nargs="?", help="for reset: the chapter, e.g. 03")
    ap.add_argument("--root", default=".", help="the course's root (default: current directory)")
    ap.add_argument("--force", action="store_true", help="build: overwrite labs even where they hold your code")
    args = ap.parse_args(argv)
    if args.action != "reset" and args.chapter is not None:
        ap.error(f"chapter={args.chapter!r} is only allowed with reset")
    if args.action == "reset" and args.chapter is None:
        ap.error("reset needs the chapter to reset, e.g. `memlab labs reset 03`")
    try:
        if args.action == "build":
            changed = build(args.root, force=args.force)
            for lab in changed:
                print(f"wrote {lab}")
            if not changed:
                print("labs/ already up to date")
            return 0
        if args.action == "start":
            notes: list[str] = []
            copied, kept = start(args.root, notes=notes)
            for line in notes:
                print(f"note: {line}")
            for p in copied:
                print(f"copied {p}")
            for p in kept:
                print(f"kept   {p} (yours; `memlab labs reset {p.stem.split('_')[0]}` for a fresh copy)")
            print(f"work in {Path(args.root) / WORK}/; grade it with `make grade` or `.venv/bin/memlab grade`")
            return 0
        if args.action == "reset":
            fresh, backup = reset(args.chapter, args.root)
            if backup is not None:
                print(f"moved your copy to {backup}")
            else:
                print("no backup: there was no copy, or it still had the lab's cells as given")
            print(f"fresh copy: {fresh}")
            return 0
        problems = drift(args.root)
    except (LabBuildError, ValueError, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, (LabFileError, FileNotFoundError)):
            exc = LabFileError(exc.errno, f"{exc.filename or args.root}: {exc.strerror or exc}; {fix_for_os_error(exc)}")
        for line in str(exc).splitlines():
            print(f"memlab labs {args.action}: {line}", file=sys.stderr)
        return 2 if isinstance(exc, LabArgumentError) else 1
    for p in problems:
        print(p)
    if not problems:
        print("labs/ is in sync with solutions/")
    return 1 if problems else 0
