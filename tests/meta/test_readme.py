"""README facts that code can check: the reuse example runs as written (it is extracted from
README.md, so the two cannot drift) and its numbers agree with an independent trace; the chapter
table lists every lecture and lab with its run time as tools/chapter_times.py reads it."""
from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _block_after(marker: str) -> str:
    at = README.index(marker)
    m = re.compile(r"```python\n(.*?)```", re.S).search(README, at)
    assert m is not None and m.start() - at < 200, f"no python block right after {marker}"
    return m.group(1)


def test_reuse_example_runs_and_its_estimate_agrees_with_the_measurement(capsys):
    pytest.importorskip("transformers")
    code = _block_after("<!-- reuse-example -->")
    assert 12 <= len(code.strip().splitlines()) <= 30, "keep the example about 20 lines"
    ns: dict = {"__name__": "readme_example"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # enable() must not warn on a plain model
        exec(compile(code, "README.md:reuse-example", "exec"), ns)
    out = capsys.readouterr().out
    model, tracker, est, host = ns["model"], ns["tracker"], ns["est"], ns["host"]
    from memlab.models import decoder_layers

    layers = decoder_layers(model)
    assert all("forward" in layer.__dict__ for layer in layers), "enable() wrapped every decoder layer"
    assert model.config.use_cache is False
    # the trace on fake tensors and the tracker on the real steps count the same step: within 0.1%
    assert abs(tracker.peak_bytes - (est.peak_bytes + host)) <= 0.001 * tracker.peak_bytes, (tracker.peak_bytes, est.peak_bytes, host)
    assert out.startswith("peak: measured ")
    # checkpointing is what the example says it is: the same step without enable() holds more activations
    from memlab.checkpoint import disable
    from memlab.profiler import MemoryTracker

    acts_on = max(e.bytes["activations"] for e in tracker.timeline)
    assert disable(model) == len(layers)
    x = ns["x"]
    with MemoryTracker(model) as plain:
        model(input_ids=x, labels=x).loss.backward()
    acts_off = max(e.bytes["activations"] for e in plain.timeline)
    assert acts_off > 1.3 * acts_on, (acts_off, acts_on)


def _chapter_times():
    spec = importlib.util.spec_from_file_location("chapter_times", ROOT / "tools" / "chapter_times.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page, prefix", [("README.md", ""), ("docs/start.md", "../")])
def test_chapter_table_lists_every_chapter_with_its_measured_run_time(page, prefix):
    """Rows name each lecture and lab (links that resolve), and the run time stays within 30 s of
    what the stored notebooks say (chapter engineers re-execute them; `tools/chapter_times.py
    --write` refreshes the table)."""
    mod = _chapter_times()
    text = (ROOT / page).read_text(encoding="utf-8")
    table = text.split(mod.BEGIN, 1)[1].split(mod.END, 1)[0]
    rows = mod.chapters(ROOT)
    assert len(rows) == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))) >= 9
    for r in rows:
        line = next((ln for ln in table.splitlines() if ln.startswith(f"| {r['chapter']} |")), None)
        assert line is not None, f"chapter {r['chapter']} missing from {page}"
        assert f"]({prefix}{r['lecture']})" in line and f"]({prefix}{r['lab']})" in line
        assert (ROOT / r["lecture"]).is_file() and (ROOT / "labs" / Path(r["lab"]).name).is_file()
        shown = float(re.search(r"\| (\d+) s \|", line).group(1))
        assert abs(shown - r["lecture_run_s"]) <= 30, (r["chapter"], shown, r["lecture_run_s"])


def test_results_table_moved_to_its_own_page():
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert results.count("\n| 0") >= 50  # the rows, one per measurement
    assert "](docs/results.md)" in README
    assert README.count("\n| 0") < 30  # README keeps the short tables only


def test_readme_estimate_sample_is_a_real_run():
    """README's `memlab estimate` sample (written by tools/readme_samples.py): its GPU and verdict
    lines are what the command prints now (the suggestions are left out here: they take longer)."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("readme_samples", ROOT / "tools" / "readme_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shown = mod.block(README)
    fresh = mod.run([*mod.ARGS, "--no-suggest"])
    for prefix in ("GPU:", "verdict:"):
        line = next(ln for ln in fresh.splitlines() if ln.startswith(prefix))
        assert line in shown, f"stale README sample: {line!r} not in it; run python tools/readme_samples.py"
    assert f"memlab estimate {' '.join(mod.ARGS)}" in shown


def test_hosted_first_cell_names_the_device_without_installing(monkeypatch, capsys):
    """README's first cell for Colab/Kaggle: where memlab is importable it installs nothing and
    prints describe()'s line."""
    import subprocess

    code = _block_after("<!-- first-cell -->")
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    exec(compile(code, "README.md:first-cell", "exec"), {"__name__": "first_cell"})
    from memlab.config import describe

    assert calls == [] and capsys.readouterr().out.strip() == describe()
