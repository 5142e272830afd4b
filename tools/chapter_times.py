"""How long each chapter takes: print (or write into docs/start.md and README.md) the table of
chapters with each lecture's and solved lab's run time and an estimated study time.

Run time: the sum of the cells' execution times stored in the notebook (nbclient records when each
cell started and finished), i.e. what the stored outputs' run took: on the CPU at small scale for
every notebook run by `make notebooks` on a CPU. Kernel start-up (a few seconds) is not included.

Study time is an estimate with a stated rule, not a measurement: prose at 150 words a minute plus
code at 15 lines a minute for a lecture; 15 minutes per graded exercise for a lab.

    python tools/chapter_times.py            # print the table (markdown)
    python tools/chapter_times.py --write    # update the tables between the markers in docs/start.md and README.md
    python tools/chapter_times.py --json     # the numbers, for tests
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS_PER_MIN = 150
CODE_LINES_PER_MIN = 15
MIN_PER_EXERCISE = 15
BEGIN, END = "<!-- chapter-times:begin -->", "<!-- chapter-times:end -->"
TOPICS = {
    "00": "where the memory goes", "01": "memory profiler", "02": "gradient checkpointing",
    "03": "mixed precision", "04": "CPU-offload Adam", "05": "chunked attention", "06": "QLoRA stack",
    "07": "capstone: fit a budget", "08": "beyond one GPU", "09": "long sequences",
}
CHECK = re.compile(r"""check\(\s*["'](\d\d\.\w+)["']""")


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def notebook_stats(path: Path) -> dict:
    nb = json.loads(path.read_text(encoding="utf-8"))
    run_s, words, code, exercises = 0.0, 0, 0, set()
    for cell in nb["cells"]:
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += len(src.split())
            continue
        if cell["cell_type"] != "code":
            continue
        code += sum(1 for line in src.splitlines() if line.strip())
        exercises.update(CHECK.findall(src))
        ex = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in ex and "shell.execute_reply" in ex:
            run_s += (_when(ex["shell.execute_reply"]) - _when(ex["iopub.execute_input"])).total_seconds()
    return {"run_s": round(run_s, 1), "words": words, "code_lines": code, "exercises": len(exercises)}


def _round5(minutes: float) -> int:
    return max(5, int(5 * math.ceil(minutes / 5)))


def chapters(root: Path = ROOT) -> list[dict]:
    rows = []
    for lecture in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        lab = root / "labs" / lecture.name
        solution = root / "solutions" / lecture.name
        lec = notebook_stats(lecture)
        sol = notebook_stats(solution) if solution.exists() else {"run_s": 0.0, "exercises": 0}
        rows.append({
            "chapter": lecture.name[:2],
            "topic": TOPICS.get(lecture.name[:2], lecture.stem[3:].replace("_", " ")),
            "lecture": f"notebooks/{lecture.name}",
            "lab": f"work/{lecture.name}" if lab.exists() else None,
            "lecture_run_s": lec["run_s"],
            "lecture_study_min": _round5(lec["words"] / WORDS_PER_MIN + lec["code_lines"] / CODE_LINES_PER_MIN),
            "lab_run_s": sol["run_s"],
            "exercises": sol["exercises"],
            "lab_study_min": _round5(sol["exercises"] * MIN_PER_EXERCISE),
        })
    return rows


def _hm(minutes: int) -> str:
    h, m = divmod(minutes, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min"


def table(rows: list[dict], prefix: str = "") -> str:
    out = [
        "| NN | topic | 1. lecture: read and run | lecture runs in (CPU) | 2. lab in `work/` | exercises | study time (lecture + lab) |",
        "|---|---|---|---|---|---|---|",
    ]
    total = 0
    for r in rows:
        minutes = r["lecture_study_min"] + r["lab_study_min"]
        total += minutes
        out.append(
            f"| {r['chapter']} | {r['topic']} | [{Path(r['lecture']).name}]({prefix}{r['lecture']}) "
            f"| {r['lecture_run_s']:.0f} s | [{Path(r['lab']).name}]({prefix}{r['lab']}) "
            f"| {r['exercises']} | ~{_hm(r['lecture_study_min'])} + ~{_hm(r['lab_study_min'])} |"
        )
    out.append(f"| | all {len(rows)} | | | | | ~{_hm(total)} |")
    return "\n".join(out)


def _replace(text: str, new: str, where: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{where}: no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{new}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="update docs/start.md and README.md between the markers")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    rows = chapters()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not args.write:
        print(table(rows))
        return 0
    for path, prefix in ((ROOT / "docs" / "start.md", "../"), (ROOT / "README.md", "")):
        text = path.read_text(encoding="utf-8")
        new = _replace(text, table(rows, prefix), str(path.relative_to(ROOT)))
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
