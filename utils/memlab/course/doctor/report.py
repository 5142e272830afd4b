"""The doctor's report: the verdicts, the text and JSON output, and ``main``."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from memlab.course.doctor.checks import CORE_CHECKS, CheckLine, run_checks
from memlab.course.doctor.probes import plural


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def _core_fails(lines: Sequence[CheckLine]) -> List[str]:
    return [line.name for line in lines if line.status == "FAIL" and line.name.split(":")[0] in CORE_CHECKS]


def core_summary(lines: Sequence[CheckLine]) -> str:
    """``"memlab core can run"`` or ``"memlab core cannot run: fix the FAIL lines of torch"``."""
    bad = _core_fails(lines)
    if bad:
        return f"memlab core cannot run: fix the FAIL lines of {', '.join(bad)}"
    return "memlab core can run (torch, numpy, matplotlib, tqdm: `pip install ./utils`)"


def summarize(lines: Sequence[CheckLine]) -> str:
    """``"the course can run (2 warnings)"`` or ``"the course cannot run: fix the FAIL lines ..."``
    (with ``"memlab core only"`` when the failures are all outside memlab's core)."""
    fails = sum(1 for line in lines if line.status == "FAIL")
    warns = sum(1 for line in lines if line.status == "WARN")
    if fails:
        text = (
            f"the course cannot run: fix the FAIL lines ({plural(fails, 'failure')}, "
            f"{plural(warns, 'warning')})"
        )
        if not _core_fails(lines):
            text += "; memlab core only: `make setup` or `pip install -r requirements.txt` installs the rest"
        return text
    if warns:
        return f"the course can run ({plural(warns, 'warning')})"
    return "the course can run (no warnings)"


def format_report(lines: Sequence[CheckLine]) -> str:
    """The text report: one aligned line per check, then the two verdicts."""
    width = max([14] + [len(line.name) for line in lines]) + 1
    tags = {"OK": "[ OK ]", "WARN": "[WARN]", "FAIL": "[FAIL]"}
    out = ["memlab doctor"]
    for line in lines:
        out.append(f"{tags[line.status]} {line.name.ljust(width)}{line.detail}")
    out.append(core_summary(lines))
    out.append(summarize(lines))
    return "\n".join(out)


def exit_code(lines: Sequence[CheckLine]) -> int:
    """1 when any line is FAIL (the course cannot run), else 0."""
    return 1 if any(line.status == "FAIL" for line in lines) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``memlab doctor``; returns 0 when the course can run (no line is FAIL), else 1.
    ``argv`` defaults to ``sys.argv[1:]``, and to none in a notebook."""
    parser = argparse.ArgumentParser(
        prog="memlab doctor",
        description="Check that this environment can run LLM Memory Lab; paste the output into bug reports.",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON instead of text")
    if argv is None and "ipykernel" in sys.modules:
        argv = []  # called as doctor.main() in a notebook: sys.argv holds the kernel's arguments
    args = parser.parse_args(list(argv) if argv is not None else None)

    lines = run_checks()
    code = exit_code(lines)
    if args.json:
        payload = {
            "checks": [line.to_dict() for line in lines],
            "failures": sum(1 for line in lines if line.status == "FAIL"),
            "warnings": sum(1 for line in lines if line.status == "WARN"),
            "summary": summarize(lines),
            "core_summary": core_summary(lines),
            "core_can_run": not _core_fails(lines),
            "course_can_run": code == 0,
            "exit_code": code,
        }
        print(json.dumps(payload, indent=2))
    else:
        print(format_report(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
