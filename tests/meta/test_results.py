"""docs/results.md and README's results paragraph equal a fresh render from the stored outputs
(tools/render_results.py; the rows and the lines they read are in memlab.course.results)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from memlab.course import results as R

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_and_readme_are_rendered_from_the_stored_outputs(capsys):
    assert _tool().main(["--check"]) == 0, capsys.readouterr().err


def test_every_row_reads_a_notebook_or_a_stored_gpu_log_and_recorded_rows_name_a_source():
    rows = R.ROWS
    read = [r for r in rows if isinstance(r, R.Row)]
    assert len(read) >= 20 and all(f.source.startswith(("notebooks/", "results/h100/", "results/h200/", "results/cpu/")) for r in read for f in r.found)
    assert all(r.device == "" for r in read if any(f.source.startswith("notebooks/") for f in r.found)), \
        "a notebook row's device is the one its stored outputs name"
    recorded = json.loads((ROOT / R.RECORDED).read_text(encoding="utf-8"))
    keys = [r.key for r in rows if isinstance(r, R.Recorded)]
    assert sorted(keys) == sorted(recorded), "results/recorded.json holds exactly the rows ROWS names"
    for key in keys:
        src = recorded[key]["source"]
        for path in [w.rstrip(",;)") for w in src.split() if w.startswith(("results/", "tests/"))]:
            assert (ROOT / path).exists(), f"results/recorded.json's row {key!r} cites {path}, which does not exist"


def _nb(lines: list[str], device: str = "device cpu (2 cores); 16-bit: bf16; torch 2.13.0+cpu; small scale") -> dict:
    lines = [device] + lines
    return {"cells": [{"cell_type": "code", "source": "print(...)", "metadata": {}, "execution_count": 1,
                       "outputs": [{"output_type": "stream", "name": "stdout", "text": [ln + "\n" for ln in lines]}]}],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


ROW = R.Row("05", ("toy", "peak {peak} MiB", "ref {ref} MiB", "{r}"),
            (R.Found("notebooks/x.ipynb", "^mine peak {peak} MiB"), R.Found("notebooks/x.ipynb", "ref  peak {ref} MiB")),
            {"r": R.ratio("peak", "ref")})


def _repo(tmp_path: Path, lines: list[str]) -> Path:
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "notebooks" / "x.ipynb").write_text(json.dumps(_nb(lines)), encoding="utf-8")
    (tmp_path / "docs" / "results.md").write_text(f"# R\n\n{R.TABLE_BEGIN}\n{R.TABLE_END}\nafter\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(f"x\n{R.README_BEGIN}\nold\n{R.README_END}\n", encoding="utf-8")
    for rel, text in R.render_files(tmp_path, [ROW]).items():
        (tmp_path / rel).write_text(text, encoding="utf-8")
    return tmp_path


def test_a_changed_stored_output_makes_the_check_fail(tmp_path):
    root = _repo(tmp_path, ["mine   peak 4.50 MiB (chunked)", "ref peak 4.00 MiB"])
    text = (root / "docs" / "results.md").read_text(encoding="utf-8")
    assert "| peak 4.50 MiB | ref 4.00 MiB | 1.125x | CPU x86_64, 2 cores |" in text and text.endswith("after\n")
    assert R.stale(root, [ROW]) == []
    # the notebook is re-executed and prints another figure: the stored row is stale, and says what it should read
    (root / "notebooks" / "x.ipynb").write_text(json.dumps(_nb(["mine peak 4.38 MiB (chunked)", "ref peak 4.00 MiB"])))
    problems = R.stale(root, [ROW])
    assert any("should read" in p and "4.38 MiB" in p and "1.095x" in p for p in problems), problems
    assert any("reads now" in p and "4.50 MiB" in p for p in problems), problems
    # the notebook re-executed on a GPU: the row names that device
    gpu = "device cuda:0 (NVIDIA H100 80GB HBM3, 79.2 GiB, compute 9.0); 16-bit: bf16, fp16; torch 2.11.0; full scale"
    (root / "notebooks" / "x.ipynb").write_text(json.dumps(_nb(["mine peak 4.38 MiB", "ref peak 4.00 MiB"], gpu)))
    assert any(p.endswith("| 1.095x | NVIDIA H100 80GB HBM3 |") for p in R.stale(root, [ROW]))
    # a hand edit of the table is stale too
    for rel, new in R.render_files(root, [ROW]).items():
        (root / rel).write_text(new, encoding="utf-8")
    assert R.stale(root, [ROW]) == []
    (root / "docs" / "results.md").write_text(text.replace("4.50", "4.49"), encoding="utf-8")
    assert R.stale(root, [ROW])


def test_a_line_the_notebook_no_longer_prints_or_prints_twice_is_named(tmp_path):
    root = _repo(tmp_path, ["mine peak 4.50 MiB", "ref peak 4.00 MiB"])
    (root / "notebooks" / "x.ipynb").write_text(json.dumps(_nb(["mine peak was 4.50 MiB", "ref peak 4.00 MiB"])))
    with pytest.raises(R.FigureError, match=r"notebooks/x.ipynb: no stored output line matches '\^mine peak \{peak\} MiB'"):
        R.render_table(root, [ROW])
    (root / "notebooks" / "x.ipynb").write_text(json.dumps(_nb(["mine peak 4.50 MiB", "ref peak 4.00 MiB",
                                                                 "mine peak 4.60 MiB"])))
    with pytest.raises(R.FigureError, match="2 stored output lines match"):
        R.render_table(root, [ROW])
    # the same figure printed twice (two ranks, two steps) is one figure
    (root / "notebooks" / "x.ipynb").write_text(json.dumps(_nb(["mine peak 4.50 MiB", "ref peak 4.00 MiB",
                                                                 "  mine   peak 4.50 MiB"])))
    assert "| peak 4.50 MiB |" in R.render_table(root, [ROW])


def test_lines_match_by_words_whatever_the_column_widths():
    f = R.Found("n", "^{label:text} losses [{l:text}] peak {p} MiB")
    m = f.regex().search("memlab   losses [5.1, 5.2]   peak  11.61 MiB")
    assert m and m.group("label") == "memlab" and m.group("l") == "5.1, 5.2" and m.group("p") == "11.61"
    assert R.Found("n", "x = {v}").regex().search("x = -1,234.5e-3").group("v") == "-1,234.5e-3"
    assert not R.Found("n", "^peak {p} MiB").regex().search("the peak 3 MiB")


def test_the_tool_exits_2_naming_the_missing_line(tmp_path, capsys):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "results").mkdir()
    shutil.copy(ROOT / R.RECORDED, tmp_path / R.RECORDED)
    (tmp_path / "notebooks").mkdir()
    for p in (ROOT / "notebooks").glob("*.ipynb"):
        nb = json.loads(p.read_text(encoding="utf-8"))
        if p.name.startswith("07_"):  # lecture 07 stored without the outputs of its last code cells
            code = [c for c in nb["cells"] if c["cell_type"] == "code"]
            for c in code[len(code) // 2:]:
                c["outputs"] = []
        (tmp_path / "notebooks" / p.name).write_text(json.dumps(nb), encoding="utf-8")
    assert _tool().main(["--check"], root=tmp_path) == 2
    err = capsys.readouterr().err
    assert "notebooks/07_fit_a_budget.ipynb: no stored output line matches" in err and "[row of chapter 07: " in err
    assert _tool().main(["--bogus"], root=tmp_path) == 2


def test_readme_validation_account_is_rendered_from_the_stored_validate_log(tmp_path):
    root = _repo(tmp_path, ["mine peak 4.50 MiB", "ref peak 4.00 MiB"])
    (root / "results" / "cpu").mkdir(parents=True)
    log = (ROOT / R.VALIDATE_LOG).read_text(encoding="utf-8")
    (root / R.VALIDATE_LOG).write_text(log, encoding="utf-8")
    (root / "README.md").write_text(f"x\n{R.README_BEGIN}\n{R.README_END}\n{R.VALIDATE_BEGIN}\nold table\n"
                                    f"{R.VALIDATE_END}\nprose\n", encoding="utf-8")
    for rel, text in R.render_files(root, [ROW]).items():
        (root / rel).write_text(text, encoding="utf-8")
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "old table" not in readme and readme.endswith(f"{R.VALIDATE_END}\nprose\n")
    rows = [ln for ln in readme.splitlines() if ln.startswith("| ") and not ln.startswith(("| figure", "|---"))]
    table = log[log.index("\nfigure "):].split("\n\n", 1)[0].splitlines()[2:]
    assert len(rows) == sum(1 for ln in table if "  -  " not in ln and " - " not in ln.split("GiB")[0][-12:])
    assert R.stale(root, [ROW]) == []
    # a re-run of the validation that moves one estimate: README's row is stale
    (root / R.VALIDATE_LOG).write_text(log.replace("34.79 GiB   -3.9%", "34.80 GiB   -3.8%"), encoding="utf-8")
    assert any("34.80 GiB | -3.8%" in p for p in R.stale(root, [ROW]))


def test_a_count_reads_only_its_block(tmp_path):
    lines = ["mine peak 4.50 MiB", "ref peak 4.00 MiB", "12 steps in 1 s", "  step 0: OOM with a -> b", "  step 1: OOM with b -> c",
             "settled on: c", "  step 0: OOM with a -> d (the page's own trainer)"]
    root = _repo(tmp_path, lines)
    row = R.Row("07", ("toy", "{n} back-offs", "{all} in the notebook", "-"), (
        R.Counted("notebooks/x.ipynb", "^step {i}: OOM with {w:text} -> ", "n", after="steps in", until="settled on:"),
        R.Counted("notebooks/x.ipynb", "^step {i}: OOM with {w:text} -> ", "all")))
    assert "| 2 back-offs | 3 in the notebook |" in R.render_table(root, [row])
    bad = R.Row("07", ("toy", "{n}", "-", "-"), (R.Counted("notebooks/x.ipynb", "OOM", "n", until="never printed"),))
    with pytest.raises(R.FigureError, match="no line holds 'never printed'"):
        R.render_table(root, [bad])
