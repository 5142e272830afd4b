"""The estimator's answers stay what they were before its speed-ups (issue 42): every number of ten estimates
(every preset family, LoRA and QLoRA, CPU and CUDA targets, ZeRO-2) and of the 7B suggestions equals, to the byte,
the fixture written by the code before the change (tests/ch01/estimate_golden.py); with the command's trace cache
on, a repeated estimate reads the same numbers without importing transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import estimate_golden as G  # noqa: E402

EXPECTED = json.loads(G.FIXTURE.read_text())


@pytest.mark.parametrize("name,model,kw", G.CASES, ids=[c[0] for c in G.CASES])
def test_estimate_equals_the_fixture(name, model, kw):
    got = json.loads(json.dumps(G.one_case(model, kw)))  # the fixture's JSON form (tuples as lists)
    assert got == EXPECTED["cases"][name]


@pytest.mark.slow
def test_suggestions_equal_the_fixture():
    # the numbers of each technique the fixture has (the list itself may grow: memlab.estimate.suggest's own)
    numbers = ("peak_bytes", "how", "phase", "fwd_bwd_peak", "extra_bytes", "reserved_replay_bytes")
    got = {r["technique"]: {k: r[k] for k in numbers} for r in G.suggest_rows()}
    want = {r["technique"]: {k: r[k] for k in numbers} for r in EXPECTED["suggestions"]}
    common = sorted(set(got) & set(want))
    assert len(common) >= len(want) - 1, f"techniques gone from the suggestions: {sorted(set(want) - set(got))}"
    assert {t: got[t] for t in common} == {t: want[t] for t in common}


def test_the_trace_cache_answers_the_same(tmp_path, monkeypatch):
    from memlab.estimate import extrapolate, trace_cache

    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(trace_cache, "_DISK_CACHE", [True])
    name, model, kw = G.CASES[2]  # llama-2-7b with LoRA
    first = G.one_case(model, kw)
    files = list((tmp_path / "estimates").glob("*.pkl"))
    assert len(files) == 1
    traced = extrapolate.trace_step
    monkeypatch.setattr(extrapolate, "trace_step", lambda *a, **k: pytest.fail("traced again: the cache missed"))
    again = G.one_case(model, kw)
    assert json.loads(json.dumps(again)) == json.loads(json.dumps(first)) == EXPECTED["cases"][name]
    monkeypatch.setattr(extrapolate, "trace_step", traced)
    monkeypatch.setattr(trace_cache, "_DISK_CACHE", [False])  # off (the API's default): traced, nothing read
    assert G.one_case(model, dict(kw, lora_r=8))["peak_bytes"] != first["peak_bytes"]
    assert len(list((tmp_path / "estimates").glob("*.pkl"))) == 1


def test_a_cached_preset_answer_imports_no_transformers(tmp_path):
    code = ("import sys, json; from memlab.estimate import trace_cache, estimate_training_memory as e; "
            "trace_cache.enable_disk_cache(); r = e('llama-2-7b', batch_size=1, seq_len=256); "
            "print(json.dumps([r.peak_bytes, 'transformers' in sys.modules, any('trace cache' in n for n in r.notes)]))")
    env = {**os.environ, "MEMLAB_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    assert runs[0][1:] == [True, False]  # the first traced (transformers built the model)
    assert runs[1][1:] == [False, True]  # the second read the cache: transformers never imported


def test_a_preset_answers_from_its_dimensions_as_its_config_does():
    """A preset resolved without building its transformers config (ModelSpec.preset) gives the same layer field,
    position checks and cache key inputs as the built config: transformers' attribute_map included."""
    from memlab.estimate.model import ModelSpec, check_positions
    from memlab.models import PRESETS, preset_config

    for name in PRESETS:
        lazy, built = ModelSpec(name, preset=name), ModelSpec(name, config=preset_config(name))
        assert lazy.layers() == built.layers() and lazy._config is None
        for f in ("max_position_embeddings", "n_positions", "hidden_size", "num_attention_heads", "vocab_size"):
            assert lazy.fields().get(f) == getattr(built.config, f, None), (name, f)
        assert lazy.fields()["model_type"] == built.config.model_type
        for seq, allow in ((2**20, False), (2**20, True), (128, False)):
            errors = []
            for spec in (lazy, built):
                try:
                    check_positions(spec, seq, allow)
                    errors.append(None)
                except ValueError as exc:
                    errors.append(str(exc))
            assert errors[0] == errors[1], (name, seq, allow)
        assert lazy._config is None  # none of it built the config


def test_the_command_turns_the_disk_cache_on_for_its_own_run_only(tmp_path, monkeypatch, capsys):
    """``memlab estimate`` reads and writes the trace cache while it runs; a process that called it (a test, a
    notebook) keeps its own setting afterwards, so a later in-process estimate is traced, not read back."""
    from memlab.cli import main as memlab_main
    from memlab.estimate import trace_cache

    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path))
    seen = []
    real = trace_cache.enable_disk_cache

    def spy(on: bool = True) -> None:
        seen.append(on)
        real(on)

    monkeypatch.setattr(trace_cache, "enable_disk_cache", spy)
    assert memlab_main(["estimate", "gpt2", "--seq-len", "128", "--no-suggest", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert seen == [True]  # on for the command's run
    with trace_cache.disk_cache():
        pass  # the same context the command uses: it restores what was there before
    assert list((tmp_path / "estimates").iterdir())  # the command's run wrote its estimate
    off_before = not trace_cache._DISK_CACHE[0]
    assert off_before  # and left the process's setting as it found it (off by default)
