"""Drop run noise from stored notebook outputs: lines a learner would only worry about.

    python tools/clean_outputs.py notebooks/*.ipynb solutions/*.ipynb   # rewrite in place
    python tools/clean_outputs.py --check notebooks/*.ipynb             # exit 1 when noise is stored

What counts as noise, removed by the cleaner (stderr only; stdout is the notebook's own printing):
- the profiler's C++ start/stop lines (``USDT:... profiler_start``),
- transformers' note that a tiny config's ``loss_type=None`` falls back to the default loss,
- bitsandbytes' note on its optional kernels package, progress-bar redraws, Python warnings
  (``path:line: XWarning: ...``, which carry the builder's paths),
- widget progress bars (transformers' ``Loading weights: 0%``, tqdm.auto in a notebook): a display
  output holding ``application/vnd.jupyter.widget-view+json`` or a progress bar as its text, and the
  notebook's stored widget state with them,
- install prefixes in a traceback a cell shows on purpose become ``<python>/``.
What ``--check`` also reports, for a person to fix in the notebook's code (the cleaner cannot know
what was meant):
- absolute paths of a builder's machine in any stream,
- a traceback (``Traceback (most recent call last)`` in a stream, or an error output) in a cell not
  tagged ``raises-exception`` (a stream's traceback may also be tagged ``shows-traceback``, for a
  cell that shows one it caught on purpose): a child process's or a library's traceback interleaved
  with the cell's own output,
- a stray value echoed by the cell's last line: an ``execute_result`` that is a bare scalar
  (``0.0``, ``True``, ``None``, ``tensor(0.)``) or an object's default repr (``<... at 0x...>``),
  the sign of an expression left on the last line (``opt.step()``, ``torch.manual_seed(0)``); end
  it with ``;`` or print what is meant.
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
WIDGET = "application/vnd.jupyter.widget-view+json"
PROGRESS = re.compile(r"^\s*[^\n]*\d+%\|[^|]*\|\s*\d+/\d+")  # tqdm's text: "Loading weights:   0%|   | 0/39"
TRACEBACK = "Traceback (most recent call last)"
# cell tags that say a traceback is meant: nbclient's and nbval's "this cell raises", and one for a cell
# that shows a traceback it caught (a child process's, say) on purpose
INTENDED_ERROR = ("raises-exception", "shows-traceback")
STRAY = re.compile(r"^(?:[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|nan|inf|True|False|None|"
                   r"tensor\([^()]*\)|np\.\w+\([^()]*\)|<[\w.]+(?: object)? at 0x[0-9a-f]+>)$")


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


def _is_progress_widget(o: dict) -> bool:
    if o.get("output_type") not in ("display_data", "execute_result"):
        return False
    data = o.get("data", {})
    return WIDGET in data or bool(PROGRESS.match("".join(data.get("text/plain", ""))))


def _stray_value(o: dict) -> str | None:
    data = o.get("data", {})
    if o.get("output_type") != "execute_result" or set(data) != {"text/plain"}:
        return None
    text = "".join(data["text/plain"]).strip()
    return text if STRAY.match(text) else None


def _cell_noise(i: int, cell: dict) -> list[str]:
    out = []
    intended = any(t in INTENDED_ERROR for t in cell.get("metadata", {}).get("tags", []))
    for o in cell.get("outputs", []):
        kind = o.get("output_type")
        if _is_progress_widget(o):
            shown = "".join(o.get("data", {}).get("text/plain", "")).strip()
            out.append(f"cell {i}: a widget progress bar ({shown[:60]!r})")
        elif kind == "error" and not intended:
            out.append(f"cell {i}: an error output ({o.get('ename')}) in a cell not tagged {INTENDED_ERROR[0]!r}")
        elif _stray_value(o) is not None:
            out.append(f"cell {i}: a stray value {_stray_value(o)!r} echoed by the cell's last line (end it with ';')")
        if kind != "stream":
            continue
        text = "".join(o.get("text", ""))
        if o.get("name") == "stderr" and _clean_text(text) != text:
            out.append(f"cell {i}: stderr noise {text.strip().splitlines()[0][:80]!r}")
        if TRACEBACK in text and not intended:
            after = text[text.index(TRACEBACK):].strip().splitlines()
            out.append(f"cell {i}: a traceback in its {o.get('name')} ({after[-1][:80]!r}) in a cell tagged neither "
                       f"{INTENDED_ERROR[0]!r} nor {INTENDED_ERROR[1]!r}")
        m = PATHS.search(text)
        if m:
            out.append(f"cell {i}: a machine path in the output ({m.group(0)[:60]!r})")
    return out


def noise(nb: dict) -> list[str]:
    """What is noisy in a notebook's stored outputs, one line each."""
    out = []
    for i, cell in enumerate(nb.get("cells", [])):
        out += _cell_noise(i, cell)
    if "widgets" in nb.get("metadata", {}):
        out.append("notebook metadata: stored widget state (of progress bars)")
    return out


def clean(nb: dict) -> bool:
    changed = False
    for cell in nb.get("cells", []):
        kept = []
        for o in cell.get("outputs", []):
            if _is_progress_widget(o):
                changed = True
                continue
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
    if "widgets" in nb.get("metadata", {}):
        del nb["metadata"]["widgets"]
        changed = True
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
