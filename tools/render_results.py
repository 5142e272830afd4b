"""Render docs/results.md's table and README.md's results paragraph from the notebooks' stored outputs.

    python tools/render_results.py          # rewrite both from the stored outputs and results/recorded.json
    python tools/render_results.py --check  # exit 1, naming each stale row, when either differs
    python tools/render_results.py --run-validate  # first re-run `memlab estimate --validate` (about 1 min)
                                                   # into results/cpu/estimate_validate.txt, then render

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
    unknown = [a for a in argv if a not in ("--check", "--run-validate")]
    if unknown or len(set(argv)) > 1:
        shown = unknown[0] if unknown else " ".join(argv)
        print(f"render_results: argument {shown!r} is invalid; allowed: --check or --run-validate", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "utils"))  # memlab without an install (it needs only the standard library here)
    from memlab.course.results import VALIDATE_LOG, FigureError, render_files, stale

    if "--run-validate" in argv:
        import subprocess

        run = subprocess.run([sys.executable, "-m", "memlab", "estimate", "--validate"], cwd=root,
                             capture_output=True, text=True)
        if run.returncode not in (0, 1):  # 1: a figure misses its target, which the table shows
            print(f"render_results: memlab estimate --validate exited {run.returncode}:\n{run.stderr[-2000:]}",
                  file=sys.stderr)
            return 2
        (root / VALIDATE_LOG).parent.mkdir(parents=True, exist_ok=True)
        (root / VALIDATE_LOG).write_text(run.stdout, encoding="utf-8")
        print(f"wrote {VALIDATE_LOG}")

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
