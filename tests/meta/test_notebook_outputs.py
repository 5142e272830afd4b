"""Stored outputs are what a learner should read: no run noise (stderr noise, widget progress bars, tracebacks
a cell does not mean, stray values its last line echoes), no builder's paths (tools/clean_outputs.py)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("clean_outputs", ROOT / "tools" / "clean_outputs.py")
clean_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clean_outputs)
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_outputs_have_no_noise_or_machine_paths(path):
    found = clean_outputs.noise(json.loads(path.read_text(encoding="utf-8")))
    assert not found, (f"{path.name}: run `python tools/clean_outputs.py {path.relative_to(ROOT)}` (it drops stderr "
                       f"noise and progress bars; a traceback or a stray value needs the cell's code changed):\n"
                       + "\n".join(found))


def test_the_cleaner_keeps_the_notebooks_own_words():
    text = ("USDT:2026-11-25 02:24:03 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
            "/x/site-packages/tqdm/auto.py:21: TqdmWarning: IProgress not found.\n  from .autonotebook import tqdm\n"
            "\rLoading weights:  10%|█         | 4/39 [00:00<00:02, 15.20it/s]\n"
            "a real message from the cell\n")
    assert clean_outputs._clean_text(text) == "a real message from the cell\n"


# ------------------------------------------------------------------- each kind of noise, on a synthetic notebook
def _nb(*cells: dict, metadata: dict | None = None) -> dict:
    return {"cells": list(cells), "metadata": metadata or {}, "nbformat": 4, "nbformat_minor": 5}


def _code(source: str, *outputs: dict, tags: list[str] | None = None) -> dict:
    return {"cell_type": "code", "source": source, "execution_count": 1, "outputs": list(outputs),
            "metadata": {"tags": tags} if tags else {}}


def _stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def _display(data: dict, kind: str = "display_data") -> dict:
    out = {"output_type": kind, "data": data, "metadata": {}}
    if kind == "execute_result":
        out["execution_count"] = 1
    return out


BAR = "Loading weights:   0%|          | 0/39 [00:00<?, ?it/s]"


@pytest.mark.parametrize("data", [
    {"application/vnd.jupyter.widget-view+json": {"model_id": "ab12", "version_major": 2, "version_minor": 0},
     "text/plain": BAR},
    {"text/plain": BAR},  # the same bar stored without its widget (an exporter that drops widget data)
], ids=["widget", "text-only"])
def test_a_widget_progress_bar_is_noise_and_the_cleaner_drops_it_with_the_widget_state(data):
    nb = _nb(_code("model = load()", _display(data), _stream("loaded\n")),
             metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}}})
    found = clean_outputs.noise(nb)
    assert any("cell 0: a widget progress bar ('Loading weights:" in f for f in found), found
    assert any("widget state" in f for f in found), found
    assert clean_outputs.clean(nb) is True
    assert nb["cells"][0]["outputs"] == [_stream("loaded\n")] and "widgets" not in nb["metadata"]
    assert clean_outputs.noise(nb) == []


def test_a_figure_or_a_table_is_not_a_progress_bar():
    nb = _nb(_code("plot()", _display({"image/png": "iVBOR", "text/plain": "<Figure size 900x380 with 1 Axes>"})),
             _code("table", _display({"text/plain": "rank  peak\n0  12.58 MiB | 100%"}, "execute_result")))
    assert clean_outputs.noise(nb) == [] and clean_outputs.clean(nb) is False


TRACE = ("Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\n"
         "AttributeError: Can't get attribute 'hello' on <module '__main__' (built-in)>\n")


def test_a_traceback_interleaved_in_a_cell_that_does_not_mean_it_is_noise():
    cell = _code("try:\n    launch(hello, 2)\nexcept RankError as e:\n    print(e)",
                 _stream(TRACE, "stderr"), _stream("rank 1 died\n"))
    found = clean_outputs.noise(_nb(cell))
    assert found == ["cell 0: a traceback in its stderr (\"AttributeError: Can't get attribute 'hello' on <module "
                     "'__main__' (built-in)>\") in a cell tagged neither 'raises-exception' nor 'shows-traceback'"]
    assert clean_outputs.clean(_nb(cell)) is False  # a traceback is for a person to read, never dropped silently
    for tag in ("raises-exception", "shows-traceback"):
        assert clean_outputs.noise(_nb(_code(cell["source"], *cell["outputs"], tags=[tag]))) == []


def test_an_error_output_is_noise_unless_the_cell_is_tagged_to_raise():
    err = {"output_type": "error", "ename": "ValueError", "evalue": "x", "traceback": ["ValueError: x"]}
    assert clean_outputs.noise(_nb(_code("f(-1)", err))) == [
        "cell 0: an error output (ValueError) in a cell not tagged 'raises-exception'"]
    assert clean_outputs.noise(_nb(_code("f(-1)", err, tags=["raises-exception"]))) == []


@pytest.mark.parametrize("value", ["0.0", "True", "None", "tensor(0.)", "3", "-1.5e-05",
                                   "<torch._C.Generator at 0x7f3a2c1d5e90>"])
def test_a_stray_value_echoed_by_the_last_line_is_noise(value):
    nb = _nb(_code("loss = step()\nprint(loss)\nopt.step() or 0.0", _stream("5.3\n"),
                   _display({"text/plain": value}, "execute_result")))
    assert clean_outputs.noise(nb) == [
        f"cell 0: a stray value {value!r} echoed by the cell's last line (end it with ';')"]


def test_a_value_a_cell_shows_on_purpose_is_not_a_stray_value():
    shown = [{"text/plain": "{'peak': '12.58 MiB'}"}, {"text/plain": "Stack(precision='fp32')"},
             {"text/plain": "<IPython.core.display.HTML object>", "text/html": "<div>timeline</div>"},
             {"text/plain": "0.5", "text/html": "<b>0.5</b>"}]
    nb = _nb(*(_code("x", _display(d, "execute_result")) for d in shown))
    assert clean_outputs.noise(nb) == []
