"""Generate labs/ from solutions/: the solved notebook is the single source of truth.

For every ``solutions/NN_topic.ipynb`` the lab ``labs/NN_topic.ipynb`` is the same notebook with

* each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block replaced by one line,
  ``raise NotImplementedError("exercise NN.name: ...")``, indented like the block;
* cells tagged ``solution-only`` dropped;
* outputs, execution counts and timing metadata cleared; cell ids kept.

The exercise id of a block is the first ``check("NN.name", ...)`` at or after it. Building is
deterministic, so ``memlab labs check`` can compare bytes and report drift.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
SOLUTION_ONLY = "solution-only"
_TIMING_KEYS = ("execution", "ExecuteTime", "collapsed", "scrolled")
_CHECK_ID = re.compile(r"""\bcheck\(\s*["'](\d{2}\.\w+)["']""")


class LabBuildError(ValueError):
    pass


def stub_line(indent: str, exercise_id: str) -> str:
    return f'{indent}raise NotImplementedError("exercise {exercise_id}: replace this line with your code")'


def _strip_solutions(source: str, exercise_id: str | None, where: str) -> str:
    out: list[str] = []
    inside = False
    for line in source.split("\n"):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise LabBuildError(f"{where}: '{BEGIN}' inside another solution block")
            if exercise_id is None:
                raise LabBuildError(f"{where}: a solution block with no check(\"NN.name\", ...) at or after it")
            inside = True
            out.append(stub_line(line[: len(line) - len(line.lstrip())], exercise_id))
        elif stripped.startswith(END):
            if not inside:
                raise LabBuildError(f"{where}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise LabBuildError(f"{where}: '{BEGIN}' is never closed by '{END}'")
    return "\n".join(out)


def build_lab(solution: Any, name: str = "notebook") -> Any:
    """Return the lab notebook (nbformat node) made from a solution notebook."""
    nb = copy.deepcopy(solution)
    cells = []
    for i, cell in enumerate(nb.cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if SOLUTION_ONLY in tags:
            continue
        if cell.cell_type == "code":
            if BEGIN in cell.source or END in cell.source:
                exercise_id = None
                for later in nb.cells[i:]:
                    m = _CHECK_ID.search(later.source) if later.cell_type == "code" else None
                    if m:
                        exercise_id = m.group(1)
                        break
                cell.source = _strip_solutions(cell.source, exercise_id, f"{name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
        for key in _TIMING_KEYS:
            cell.get("metadata", {}).pop(key, None)
        cells.append(cell)
    nb.cells = cells
    return nb


def render(nb: Any) -> str:
    import nbformat

    return nbformat.writes(nb) + "\n"


def _pairs(root: Path) -> list[tuple[Path, Path]]:
    sol_dir = root / "solutions"
    if not sol_dir.is_dir():
        raise FileNotFoundError(f"root={str(root)!r} has no solutions/ folder: run from the course's root")
    return [(p, root / "labs" / p.name) for p in sorted(sol_dir.glob("*.ipynb"))]


def expected_lab(solution_path: Path) -> str:
    import nbformat

    nb = nbformat.read(solution_path, as_version=4)
    return render(build_lab(nb, name=str(solution_path)))


def build(root: str | Path = ".") -> list[Path]:
    """Write labs/ from solutions/; return the labs written."""
    root = Path(root)
    written = []
    (root / "labs").mkdir(exist_ok=True)
    for sol, lab in _pairs(root):
        text = expected_lab(sol)
        if not lab.exists() or lab.read_text(encoding="utf-8") != text:
            lab.write_text(text, encoding="utf-8")
        written.append(lab)
    return written


def drift(root: str | Path = ".") -> list[str]:
    """Problems: labs that differ from what build() would write, labs with no solution."""
    root = Path(root)
    problems = []
    pairs = _pairs(root)
    for sol, lab in pairs:
        if not lab.exists():
            problems.append(f"{lab}: missing (run `memlab labs build`)")
        elif lab.read_text(encoding="utf-8") != expected_lab(sol):
            problems.append(f"{lab}: differs from what {sol} generates (run `memlab labs build`; never edit labs/ by hand)")
    known = {lab.name for _, lab in pairs}
    for lab in sorted((root / "labs").glob("*.ipynb")):
        if lab.name not in known:
            problems.append(f"{lab}: has no solutions/{lab.name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="memlab labs", description="Generate labs/ from solutions/, or check for drift.")
    ap.add_argument("action", choices=["build", "check"])
    ap.add_argument("--root", default=".", help="the course's root (default: current directory)")
    args = ap.parse_args(argv)
    if args.action == "build":
        for lab in build(args.root):
            print(f"wrote {lab}")
        return 0
    problems = drift(args.root)
    for p in problems:
        print(p)
    if not problems:
        print("labs/ is in sync with solutions/")
    return 1 if problems else 0
