"""Render docs/results.md's table and README.md's results paragraph from the notebooks' stored outputs.

    python tools/render_results.py          # rewrite both from the stored outputs and results/recorded.json
    python tools/render_results.py --check  # exit 1, naming each stale row, when either differs

The rows, and the printed line each figure is read from, are in utils/memlab/course/results.py;
rows no notebook prints (benches, GPU logs, tests) are in results/recorded.json with their source.
Re-execute a notebook, then run this: a row whose line the notebook no longer prints stops the
render with the notebook and the line named (exit 2). tests/meta/test_results.py runs ``--check``.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    unknown = [a for a in argv if a != "--check"]
    if unknown:
        print(f"render_results: argument {unknown[0]!r} is invalid; allowed: --check", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "utils"))  # memlab without an install (it needs only the standard library here)
    from memlab.course.results import FigureError, render_files, stale

    try:
        if "--check" in argv:
            problems = stale(root)
            for p in problems:
                print(p, file=sys.stderr)
            if problems:
                print("stale results: run `python tools/render_results.py`", file=sys.stderr)
            return 1 if problems else 0
        for rel, text in render_files(root).items():
            path = root / rel
            if path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
                print(f"rendered {rel}")
    except FigureError as exc:
        print(f"render_results: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
