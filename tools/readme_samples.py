"""Regenerate the sample output of `memlab estimate` that README.md shows, from a real run.

    python tools/readme_samples.py          # run the command, rewrite README's sample block
    python tools/readme_samples.py --check  # exit 1 when README's sample differs from a fresh run

The block between ``<!-- sample:estimate:begin -->`` and ``<!-- sample:estimate:end -->`` holds
the command and, of its output, the ``GPU:``, ``verdict:``, the suggestions' header and the
``next to try:`` lines (the full table is long; ``...`` marks what is left out).
tests/meta/test_readme.py checks the verdict line against a fresh estimate.
"""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- sample:estimate:begin -->", "<!-- sample:estimate:end -->"
ARGS = ["llama-2-7b", "--batch-size", "1", "--seq-len", "2048", "--dtype", "bf16", "--optimizer", "adamw", "--gpu", "24GB"]
KEEP = ("GPU:", "verdict:", "what would make it fit", "next to try:")


def run(args: list[str] = ARGS) -> str:
    sys.path.insert(0, str(ROOT / "utils"))
    from memlab.cli.estimate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(args)
    return out.getvalue()


def sample(output: str, args: list[str] = ARGS) -> str:
    lines = [f"$ .venv/bin/memlab estimate {' '.join(args)}", "..."]
    for line in output.splitlines():
        if line.startswith(KEEP):
            lines.append("what would make it fit: ... (a table of techniques, their peaks and savings)"
                         if line.startswith("what would make it fit") else line)
    return "\n".join(lines)


def block(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return rest.split(END, 1)[0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        print(f"README.md: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    new = f"\n```text\n{sample(run())}\n```\n"
    if "--check" in argv:
        if block(text) != new:
            print("README.md's memlab estimate sample is stale: run python tools/readme_samples.py", file=sys.stderr)
            return 1
        return 0
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{BEGIN}{new}{END}{tail}", encoding="utf-8")
    print("wrote README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
