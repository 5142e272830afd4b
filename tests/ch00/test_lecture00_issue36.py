"""Lecture 00's claims (issue 36): the 7B gap between the GPT formula and the traced step is counted on
the page from a small Llama's tape, eager attention's 6 bytes per score is measured, the step's peak sits
beside the allocator's, and "mixed precision halves the activations" is no longer claimed."""
from __future__ import annotations

import ast
import json
import pathlib

import pytest
import torch
from torch import nn

LECTURE_00 = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "00_where_the_memory_goes.ipynb"


def _cells(kind="code"):
    return ["".join(c["source"]) for c in json.loads(LECTURE_00.read_text())["cells"] if c["cell_type"] == kind]


def _definitions(*names):
    """The on-page definitions of `names` (functions only, not the cells' experiments), run in one namespace."""
    import memlab
    import memlab.models
    from memlab.config import seed_everything

    ns = {"torch": torch, "nn": nn, "memlab": memlab, "seed_everything": seed_everything}
    for name in names:
        nodes = [n for s in _cells() for n in ast.parse(s).body if isinstance(n, ast.FunctionDef) and n.name == name]
        assert len(nodes) == 1, f"{len(nodes)} definitions of {name} in lecture 00"
        exec(compile(ast.Module(body=nodes, type_ignores=[]), f"lecture00:{name}", "exec"), ns)
    return ns


def test_the_small_llama_tape_counts_weight_copies_and_six_bytes_per_eager_score():
    pytest.importorskip("transformers")
    ns = _definitions("storage_key", "saved_tape", "llama_tape", "tape_units")
    d = dict(h=64, i=172, a=2, V=96, b=2, s=12)
    units = ns["tape_units"](d)
    one, two = ns["llama_tape"]("eager", 1, d), ns["llama_tape"]("eager", 2, d)
    layer = {k: two.get(k, 0) - one.get(k, 0) for k in two}
    copies = layer[("16-bit weight copies (autocast)", "linear weights")]
    assert copies == 2 * units["linear weights"]                    # 2 bytes per linear weight, per layer
    assert layer[("attention scores (eager only)", "a s^2 b")] == 6 * units["a s^2 b"]   # fp32 softmax + bf16 cast
    assert layer[("fp32 residual stream and RMSNorm", "s b h")] == 16 * units["s b h"]    # 2 norms x (input + normed)
    sdpa = ns["llama_tape"]("sdpa", 1, d)
    assert not any(what.startswith("attention scores") for what, _ in sdpa)


def test_the_gap_and_the_eager_link_are_asserted_on_the_page():
    code = "\n".join(_cells())
    assert "abs(tape_total / traced_acts - 1) < 0.05" in code and "per_score == 6" in code
    assert "abs(eager_more / extra - 1) < 0.05" in code


def test_no_claim_that_mixed_precision_halves_the_activations():
    text = " ".join(" ".join(_cells("markdown")).split())
    assert "halves the *activations*" not in text and "halves the activations" not in text
    assert "0.75x" in text


def test_the_step_peak_is_printed_beside_the_allocator():
    code = "\n".join(_cells())
    assert "peak_beside_allocator(one_step, model, opt)" in code
    assert "predict_peak(cfg, B, T) / alloc_peak" in code
