"""Stored outputs are what a learner should read: no run noise, no builder's paths (tools/clean_outputs.py)."""
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
    assert not found, f"{path.name}: run `python tools/clean_outputs.py {path.relative_to(ROOT)}`:\n" + "\n".join(found)


def test_the_cleaner_keeps_the_notebooks_own_words():
    text = ("USDT:2026-11-25 02:24:03 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
            "/x/site-packages/tqdm/auto.py:21: TqdmWarning: IProgress not found.\n  from .autonotebook import tqdm\n"
            "\rLoading weights:  10%|█         | 4/39 [00:00<00:02, 15.20it/s]\n"
            "a real message from the cell\n")
    assert clean_outputs._clean_text(text) == "a real message from the cell\n"
