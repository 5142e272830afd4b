"""Drop run noise from stored notebook outputs: lines a learner would only worry about.

    python tools/clean_outputs.py notebooks/*.ipynb solutions/*.ipynb   # rewrite in place
    python tools/clean_outputs.py --check notebooks/*.ipynb             # exit 1 when noise is stored

What counts as noise (stderr only; stdout is the notebook's own printing):
- the profiler's C++ start/stop lines (``USDT:... profiler_start``),
- transformers' note that a tiny config's ``loss_type=None`` falls back to the default loss,
- bitsandbytes' note on its optional kernels package, progress-bar redraws, Python warnings
  (``path:line: XWarning: ...``, which carry the builder's paths),
- install prefixes in a traceback a cell shows on purpose become ``<python>/``,
- and ``--check`` also reports absolute paths of a builder's machine in any stream.
tests/meta/test_notebook_outputs.py runs ``--check`` over every lecture and solution.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

NOISE = (
    re.compile(r"^USDT:.*profiler_(start|stop)\s*$"),
    re.compile(r"^\[transformers\] `loss_type=None` was set in the config but it is unrecognized.*$"),
    re.compile(r"^Failed to load CPU gemm_4bit_forward from kernels-community.*$"),  # bitsandbytes' optional kernels
    re.compile(r"^.*\|[^|]*\| *\d+/\d+ \[[^]]*\]\s*$"),  # a progress bar's redraw (tqdm)
    re.compile(r"^\s*$"),
)
# a Python warning: "path:line: SomeWarning: text" and the source line after it
WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")
PATHS = re.compile(r"(/work/[^\s'\"]*|/home/[^\s'\"]*|/root/[^\s'\"]*|\.venv/lib/python[^\s'\"]*)")


# a traceback a cell shows on purpose keeps its frames, without the builder's install prefix
PREFIX = re.compile(r"/[^\s\"']*/lib/python3\.\d+/")


def _clean_text(text: str) -> str:
    text = PREFIX.sub("<python>/", text)
    out, skip_indented = [], False
    for raw in text.replace("\r", "\n").splitlines(keepends=True):
        line = raw.rstrip("\n")
        if skip_indented and line.startswith("  "):
            continue
        skip_indented = bool(WARNING.match(line))
        if skip_indented or any(p.match(line) for p in NOISE):
            continue
        out.append(raw)
    return "".join(out)


def noise(nb: dict) -> list[str]:
    """What is noisy in a notebook's stored outputs, one line each."""
    out = []
    for i, cell in enumerate(nb.get("cells", [])):
        for o in cell.get("outputs", []):
            if o.get("output_type") != "stream":
                continue
            text = "".join(o.get("text", ""))
            if o.get("name") == "stderr" and _clean_text(text) != text:
                out.append(f"cell {i}: stderr noise {text.strip().splitlines()[0][:80]!r}")
            m = PATHS.search(text)
            if m:
                out.append(f"cell {i}: a machine path in the output ({m.group(0)[:60]!r})")
    return out


def clean(nb: dict) -> bool:
    changed = False
    for cell in nb.get("cells", []):
        kept = []
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                text = "".join(o.get("text", ""))
                new = _clean_text(text)
                if new != text:
                    changed = True
                    if not new.strip():
                        continue
                    o["text"] = new
            kept.append(o)
        if "outputs" in cell:
            cell["outputs"] = kept
    return changed


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"]
    bad = 0
    for p in paths:
        nb = json.loads(p.read_text(encoding="utf-8"))
        if check:
            for line in noise(nb):
                print(f"{p}: {line}")
                bad += 1
        elif clean(nb):
            p.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"cleaned {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
