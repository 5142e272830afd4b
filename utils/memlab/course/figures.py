"""Figures read from stored outputs and rendered into markdown, for docs/results.md and README.md.

A :class:`Found` is the text of one line a notebook prints (or a stored log under ``results/``),
with ``{name}`` where a figure stands; lines are matched by their words, not by cell index
(lectures gain and lose cells), and runs of spaces match any run of spaces (column widths change).
A figure that is not found, or found twice with different values, stops the render with a message
naming the source and the line. A :class:`Derived` figure is computed from figures read (a ratio,
a difference of two lists), so it cannot disagree with them. A :class:`Row` is six table cells
written as templates over its figures; a :class:`Recorded` row is kept whole, with its source, in
``results/recorded.json``. The rows themselves are :mod:`memlab.course.results`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["Found", "Counted", "Derived", "Row", "Recorded", "FigureError", "RECORDED", "TABLE_BEGIN", "TABLE_END",
           "README_BEGIN", "README_END", "VALIDATE_BEGIN", "VALIDATE_END", "VALIDATE_LOG", "CPU", "num", "ratio",
           "outputs_text", "read_figures", "notebook_device", "render_rows", "render_table", "render_readme_block",
           "render_validate_block", "replace_block", "render_files", "stale"]

TABLE_BEGIN, TABLE_END = "<!-- results:table:begin -->", "<!-- results:table:end -->"
README_BEGIN, README_END = "<!-- results:summary:begin -->", "<!-- results:summary:end -->"
VALIDATE_BEGIN, VALIDATE_END = "<!-- results:validate:begin -->", "<!-- results:validate:end -->"
VALIDATE_LOG = "results/cpu/estimate_validate.txt"  # `memlab estimate --validate`'s output, stored
RECORDED = "results/recorded.json"
HEADER = ("| ch | measurement | from scratch | reference | ratio / verdict | device |\n"
          "|---|---|---|---|---|---|")
CPU = "CPU x86_64, 2 cores"
NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:e[-+]?\d+)?"
FIELD = re.compile(r"\{(\w+)(?::(num|text))?\}")


class FigureError(ValueError):
    """A figure a row needs is missing from its source, ambiguous there, or its source is missing."""


@dataclass(frozen=True)
class Found:
    """Figures read from one printed line of ``source`` (a notebook's stored outputs or a text log).

    ``line`` is the line's text with ``{name}`` for a number (``{name:text}`` for words, matched as
    few characters as possible up to the next literal text); runs of spaces match any run of spaces.
    """
    source: str
    line: str
    after: str = ""  # a log of several sections: read only below the first line holding this text

    def regexes(self) -> list[re.Pattern]:
        """One pattern per line: a ``line`` holding ``\\n`` matches that many consecutive lines."""
        return [Found(self.source, part).regex() for part in self.line.split("\n")]

    def regex(self) -> re.Pattern:
        line = self.line[1:] if self.line.startswith("^") else self.line
        parts, at = ["^[ \t]*" if self.line.startswith("^") else ""], 0
        for m in FIELD.finditer(line):
            parts.append(_literal(line[at:m.start()]))
            last = not line[m.end():].strip()
            text = ".+?[ \t]*$" if last else ".+?"
            parts.append(f"(?P<{m.group(1)}>{text if m.group(2) == 'text' else NUMBER})")
            at = m.end()
        parts.append(_literal(line[at:]))
        return re.compile("".join(parts))

    def names(self) -> list[str]:
        return [m.group(1) for m in FIELD.finditer(self.line)]


@dataclass(frozen=True)
class Counted:
    """``name``: how many stored output lines of ``source`` match ``line`` (a :class:`Found` line), counted
    from the first line holding ``after`` (if given) to the next line holding ``until`` (if given)."""
    source: str
    line: str
    name: str
    after: str = ""
    until: str = ""

    def block(self, lines: list[str]) -> list[str]:
        if self.after:
            at = next((i for i, ln in enumerate(lines) if self.after in ln), None)
            if at is None:
                raise FigureError(f"{self.source}: no line holds {self.after!r} (where {self.line!r} is counted from)")
            lines = lines[at + 1:]
        if self.until:
            end = next((i for i, ln in enumerate(lines) if self.until in ln), None)
            if end is None:
                raise FigureError(f"{self.source}: no line holds {self.until!r} (where counting {self.line!r} stops)")
            lines = lines[:end]
        return lines


@dataclass(frozen=True)
class Derived:
    """A figure computed from others of the same row: ``fn(figures) -> str``, ``uses`` naming them."""
    uses: tuple[str, ...]
    fn: Callable[[dict], str]


@dataclass(frozen=True)
class Row:
    """One row: ``cells`` (measurement, from scratch, reference, verdict) are templates over ``found``."""
    ch: str
    cells: tuple[str, str, str, str]
    found: tuple[Found | Counted, ...]
    derived: dict[str, Derived] = field(default_factory=dict)
    device: str = ""  # "": the device the notebook's first ``describe()`` line names


@dataclass(frozen=True)
class Recorded:
    """A row kept whole in results/recorded.json under ``key`` (not printed by any notebook)."""
    key: str


def _literal(text: str) -> str:
    return "[ \t]+".join(re.escape(w) for w in re.split(r"[ \t]+", text)) if text.strip() else (
        "[ \t]*" if text else "")


def num(s: str) -> float:
    return float(s.replace(",", ""))


def outputs_text(path: Path) -> list[str]:
    """The lines a reader sees under the code cells of a notebook (streams, text/plain), or a log's lines."""
    if path.suffix != ".ipynb":
        return path.read_text(encoding="utf-8").splitlines()
    nb = json.loads(path.read_text(encoding="utf-8"))
    lines: list[str] = []
    for cell in nb.get("cells", []):
        for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            if o.get("output_type") == "stream":
                lines += "".join(o.get("text", "")).splitlines()
            elif "data" in o:
                lines += "".join(o["data"].get("text/plain", "")).splitlines()
    return lines


def _read_one(found: Found, lines: list[str]) -> dict[str, str]:
    if found.after:
        at = next((i for i, ln in enumerate(lines) if found.after in ln), None)
        if at is None:
            raise FigureError(f"{found.source}: no line holds {found.after!r} (where {found.line!r} is read from)")
        lines = lines[at + 1:]
    rxs = found.regexes()
    hits = {}
    for i in range(len(lines) - len(rxs) + 1):
        ms = [rx.search(lines[i + k]) for k, rx in enumerate(rxs)]
        if all(ms):
            groups = {k: v for m in ms for k, v in m.groupdict().items()}
            hits.setdefault(tuple(groups[n].strip() for n in found.names()), lines[i].strip())
    if not hits:
        raise FigureError(f"{found.source}: no stored output line matches {found.line!r}; the notebook must print "
                          f"it (re-run it, or change the row in memlab/course/results.py with the notebook's new words)")
    if len(hits) > 1 and found.after:  # a section's first match: the sections below repeat its lines
        hits = dict([next(iter(hits.items()))])
    if len(hits) > 1:
        shown = "; ".join(repr(v) for v in list(hits.values())[:3])
        raise FigureError(f"{found.source}: {len(hits)} stored output lines match {found.line!r} with different "
                          f"figures ({shown}): make the line's text longer so that one line matches")
    return dict(zip(found.names(), next(iter(hits))))


def read_figures(row: Row, root: Path, cache: dict | None = None) -> dict[str, str]:
    """Every ``{name}`` of ``row``: read from its sources under ``root``, then the derived ones."""
    cache = {} if cache is None else cache
    figs: dict[str, str] = {}
    for found in row.found:
        path = root / found.source
        if found.source not in cache:
            if not path.is_file():
                raise FigureError(f"{found.source}: no such file under {root} (a row of chapter {row.ch} reads it)")
            cache[found.source] = outputs_text(path)
        if isinstance(found, Counted):
            rx = Found(found.source, found.line).regex()
            figs[found.name] = str(sum(bool(rx.search(ln)) for ln in found.block(cache[found.source])))
        else:
            figs.update(_read_one(found, cache[found.source]))
    for name, d in row.derived.items():
        figs[name] = d.fn({k: figs[k] for k in d.uses})
    return figs


DESCRIBE = re.compile(r"^device (?P<dev>cpu|cuda[:\d]*) \((?P<what>[^)]*)\)")


def notebook_device(source: str, lines: list[str]) -> str:
    """The device a notebook's stored outputs ran on, from its ``memlab.config.describe()`` line."""
    m = next((DESCRIBE.match(ln) for ln in lines if DESCRIBE.match(ln)), None)
    if m is None:
        raise FigureError(f"{source}: no `device ...` line (memlab.config.describe()) in the stored outputs")
    if m.group("dev") == "cpu":
        return f"CPU x86_64, {m.group('what').split()[0]} cores"
    return m.group("what").split(",")[0]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _render_row(row: Row, root: Path, cache: dict) -> str:
    figs = read_figures(row, root, cache)
    cells = []
    for template in row.cells:
        try:
            cells.append(template.format_map(figs))
        except KeyError as exc:
            raise FigureError(f"a row of chapter {row.ch} uses {{{exc.args[0]}}}, which none of its lines reads") from None
    sources = sorted({f.source for f in row.found})
    cells[0] += " (" + ", ".join(f"`{s}`" for s in sources) + ")"
    devices = {notebook_device(s, cache[s]) for s in sources if s.endswith(".ipynb")}
    if len(devices) > 1:
        raise FigureError(f"a row of chapter {row.ch} reads notebooks run on different devices: {sorted(devices)}")
    device = row.device or (devices.pop() if devices else "")
    if not device:
        raise FigureError(f"a row of chapter {row.ch} reads no notebook and names no device")
    return "| " + " | ".join(_cell(c) for c in [row.ch] + cells + [device]) + " |"


def _recorded(root: Path) -> dict[str, dict]:
    path = root / RECORDED
    if not path.is_file():
        raise FigureError(f"{RECORDED}: no such file under {root}")
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, r in data.items():
        missing = {"ch", "measurement", "from_scratch", "reference", "verdict", "device", "source"} - set(r)
        if missing or not str(r.get("source", "")).strip():
            raise FigureError(f"{RECORDED}: row {key!r} lacks {sorted(missing) or ['a source']}")
    return data


def _render_recorded(r: dict) -> str:
    cells = [r["ch"], f"{r['measurement']} [source: {r['source']}]", r["from_scratch"], r["reference"],
             r["verdict"], r["device"]]
    return "| " + " | ".join(_cell(str(c)) for c in cells) + " |"


def render_rows(root: Path, rows: Iterable[Row | Recorded]) -> list[str]:
    """The table's rows, in order, as markdown lines."""
    rows = list(rows)
    cache: dict = {}
    recorded = _recorded(root) if any(isinstance(r, Recorded) for r in rows) else {}
    out, errors = [], []
    for r in rows:
        if isinstance(r, Recorded):
            if r.key not in recorded:
                errors.append(f"{RECORDED}: no row {r.key!r} (memlab.course.results' rows name it)")
            else:
                out.append(_render_recorded(recorded[r.key]))
            continue
        try:
            out.append(_render_row(r, root, cache))
        except FigureError as exc:  # every row's problem at once, each with the row it belongs to
            errors.append(f"{exc} [row of chapter {r.ch}: {r.cells[0][:60]!r}]")
    if errors:
        raise FigureError("\n".join(errors))
    return out


def render_table(root: Path, rows: Iterable[Row | Recorded]) -> str:
    return HEADER + "\n" + "\n".join(render_rows(root, rows))


def render_readme_block(root: Path, rows: Iterable[Row | Recorded]) -> str:
    rows = list(rows)
    n_read = sum(isinstance(r, Row) for r in rows)
    return (f"Every measurement in one table, {len(rows)} rows, each naming its device: the from-scratch version "
            f"against the production reference, as ratios of time and peak memory, on the 2-core CPU and on lent "
            f"GPUs (an H100, an H200): [docs/results.md](docs/results.md). {n_read} rows are read from the notebooks' stored outputs "
            f"and the stored logs under `results/` by `python tools/render_results.py` (`--check` in "
            f"`tests/meta/test_results.py`); the other {len(rows) - n_read} (benches run by hand, tests) are kept in "
            f"`{RECORDED}` with their source.")


def _validate_table(lines: list[str]) -> list[list[str]]:
    """The comparable rows of the stored ``--validate`` table: figure, metric, published, estimate, error, target."""
    at = next((i for i, ln in enumerate(lines) if re.match(r"^figure\s+metric\s+published", ln)), None)
    if at is None:
        raise FigureError(f"{VALIDATE_LOG}: no table header 'figure  metric  published ...'")
    rows = []
    for ln in lines[at + 1:]:
        if not ln.strip():
            break
        cells = re.split(r"\s{2,}", ln.strip())
        if len(cells) >= 6 and cells[1] != "-":
            rows.append(cells[:5] + ["  ".join(cells[5:])])
    return rows


def render_validate_block(root: Path) -> str:
    """README's account of ``memlab estimate --validate``: its summary lines and its table, from the stored log."""
    path = root / VALIDATE_LOG
    if not path.is_file():
        raise FigureError(f"{VALIDATE_LOG}: no such file (python tools/render_results.py --run-validate writes it)")
    lines = outputs_text(path)
    f = {}
    for found in (Found(VALIDATE_LOG, "allocated figures: median |error| {med}% (target {tm}%), worst {worst}% "
                                      "(target {tw}%)"),
                  Found(VALIDATE_LOG, "^{met} of {n} comparable figures meet their target{rest:text}"),
                  Found(VALIDATE_LOG, "^{und} undecided ({why:text}): each is at or below its figure for a longest "
                                      "batch of at most {lo} to {hi} tokens"),
                  Found(VALIDATE_LOG, "^{ne} published figures the estimator cannot express")):
        f.update(_read_one(found, lines))
    off = re.match(r"; (\d+) off for a stated reason", f["rest"])
    table = _validate_table(lines)
    head = (f"`memlab estimate --validate` (`memlab/estimate/validate.py`; about 1 min on a 2-core CPU; its output as "
            f"last run: [`{VALIDATE_LOG}`]({VALIDATE_LOG})): {f['n']} published peaks the estimator can decide, "
            f"{f['met']} meeting their target" + (f", {off.group(1)} off for the reason the log states "
                                                  f"(torchtune's runs: torch.compile, its own Llama; litgpt's: its "
                                                  f"own GPT, traced by tools/trace_litgpt.py)" if off else "")
            + f"; allocated figures: median |error| {f['med']}% (target {f['tm']}%), worst {f['worst']}% (target "
            f"{f['tw']}%); reserved / nvidia-smi / unstated figures at or above the estimate; {f['und']} undecided, "
            f"each met for a longest batch of at most {f['lo']} to {f['hi']} tokens; {f['ne']} published figures it "
            f"cannot express, listed with the reason. Rows that name their card pass it (`gpu=`): the cuBLAS "
            f"workspaces follow it (PyTorch's default: 32 MiB on compute capability 9.0 and later, 8.125 MiB before):")
    body = ["| figure | metric | published | estimate | error | target |", "|---|---|---|---|---|---|"]
    body += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in table]
    return head + "\n\n" + "\n".join(body)


def replace_block(text: str, begin: str, end: str, block: str, name: str) -> str:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise FigureError(f"{name}: needs one {begin} line before one {end} line")
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + block + "\n" + end + rest.split(end, 1)[1]


def render_files(root: Path, rows: Iterable[Row | Recorded]) -> dict[str, str]:
    """{relative path: its new text} for docs/results.md and README.md."""
    rows = list(rows)
    out = {}
    blocks = [("docs/results.md", TABLE_BEGIN, TABLE_END, lambda: render_table(root, rows)),
              ("README.md", README_BEGIN, README_END, lambda: render_readme_block(root, rows)),
              ("README.md", VALIDATE_BEGIN, VALIDATE_END, lambda: render_validate_block(root))]
    for rel, begin, end, block in blocks:
        text = out[rel] if rel in out else (root / rel).read_text(encoding="utf-8")
        if begin not in text and end not in text and rel == "README.md" and begin == VALIDATE_BEGIN:
            continue  # a README without the validation's account (the unit tests' small repositories)
        out[rel] = replace_block(text, begin, end, block(), rel)
    return out


def stale(root: Path, rows: Iterable[Row | Recorded]) -> list[str]:
    """One line per stored row or paragraph that differs from a fresh render (empty: up to date)."""
    problems = []
    for rel, new in render_files(root, rows).items():
        old = (root / rel).read_text(encoding="utf-8")
        if old == new:
            continue
        old_lines, new_lines = old.splitlines(), new.splitlines()
        gone = [ln for ln in old_lines if ln not in new_lines]
        added = [ln for ln in new_lines if ln not in old_lines]
        for a in added:
            problems.append(f"{rel}: stale, should read: {a[:300]}")
        for g in gone:
            problems.append(f"{rel}: stale, reads now:    {g[:300]}")
    return problems


def ratio(a: str, b: str, fmt: str = "{:.3f}x") -> Derived:
    """A figure ``a / b``, formatted."""
    return Derived((a, b), lambda f: fmt.format(num(f[a]) / num(f[b])))
