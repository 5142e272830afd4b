"""The suggestion rows traced ahead (memlab.estimate.suggest.Speculation, issue 42): while ``memlab estimate MODEL
--gpu CARD`` traces the estimate, a forked child traces the rows the suggestions will try; the rows are those of one
process, whether the guess was right (its rows used), partly right (the fused AdamW row, which needs the estimate's
peak phase, made after it) or wrong (none used); the command prints what it printed without the speculation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from memlab.core import forking
from memlab.estimate import estimate_training_memory, suggest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or forking.cpus() < 2, reason="needs os.fork and 2 CPUs")

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(num_hidden_layers=8, hidden_size=64, intermediate_size=160, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=1000)


def _config(**change):
    from transformers import LlamaConfig

    return LlamaConfig(**{"max_position_embeddings": 2048, **SMALL, **change})


def _provisional(base, **change):
    # the command's guess of the estimate: its settings, no peak phase, no optimizer implementation
    fields = dict(batch_size=base.batch_size, seq_len=base.seq_len, dtype=base.dtype, optimizer=base.optimizer,
                  checkpointing=base.checkpointing, loss=base.loss, device=base.device, offload_checkpoints=False,
                  world_size=1, zero_stage=0, optimizer_in_backward=False, optimizer_impl="", peak_phase="",
                  adapter="")
    return SimpleNamespace(**{**fields, **change})


@pytest.mark.parametrize("guess", ["right", "wrong"])
def test_speculated_rows_are_the_rows_of_one_process(guess):
    cfg, run = _config(), dict(device="cuda")
    base = estimate_training_memory(cfg, batch_size=1, seq_len=16, **run)
    assert base.peak_phase == "optimizer" and base.optimizer_impl == "foreach"  # the fused AdamW row: not guessed
    spec = suggest.Speculation(cfg, _provisional(base, **({} if guess == "right" else {"seq_len": 32})), None, run)
    try:
        ahead = suggest.suggestions(base, cfg, speculation=spec, **run)
    finally:
        spec.close()
    one = suggest.suggestions(base, cfg, jobs=1, **run)
    assert ahead == one and len(one) >= 10
    traced = [r.technique for r in one if r.how == "traced"]
    guessed = [kw for kw in spec.kws if kw in [{**suggest._common(base, None, run), **c}
                                               for _, _, c in suggest._tried(base, run)[0]]]
    assert len(guessed) == (len(traced) - 1 if guess == "right" else 0)  # all but the fused AdamW row, or none
    assert len(spec._done) == len(spec.kws)  # every speculated row made (by the child or, left, here)


def test_the_command_prints_what_it_printed_without_speculating(tmp_path):
    pytest.importorskip("transformers")
    cfg = tmp_path / "small"
    _config(vocab_size=32000).save_pretrained(cfg)  # its logits alone over 1 GiB at 8 x 1024: the suggestions run
    run = ("import io, sys, contextlib, memlab.cli.estimate as E\n"
           "made = []\n"
           "if sys.argv[1] == 'off': E._speculation = lambda *a: []\n"
           "else:\n"
           "    real = E._speculation\n"
           "    E._speculation = lambda *a: made.extend(real(*a)) or made\n"
           f"rc = E.main([{str(cfg)!r}, '--batch-size', '8', '--seq-len', '1024', '--gpu', '1GiB'])\n"
           "print('speculated', len(made), 'rc', rc)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "utils"), "MEMLAB_CACHE_DIR": "none", "OMP_NUM_THREADS": "1"}
    out = {}
    for mode in ("on", "off"):
        proc = subprocess.run([sys.executable, "-c", run, mode], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[mode] = [ln for ln in proc.stdout.splitlines() if not ln.startswith("estimated in ")]
    assert out["on"][-1] == "speculated 1 rc 0" and out["off"][-1] == "speculated 0 rc 0"
    assert out["on"][:-1] == out["off"][:-1] and any("to reproduce a traced row" in ln for ln in out["on"])
    assert json.dumps(out["on"]).count("memlab estimate") >= 10
