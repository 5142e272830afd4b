"""memlab.testing: assert_peak and the baseline file (record / compare) on a tiny transformers config.

The regression tests here fail on deliberate regressions (checkpointing turned off, a bigger batch) and name the
category, module and op that grew.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402

from memlab.estimate import estimate_training_memory  # noqa: E402
from memlab.testing import MemoryBaseline, assert_peak, compare, peak_record, record  # noqa: E402

STEP = dict(batch_size=4, seq_len=64, checkpointing=True, optimizer="sgd", device="cpu")


@pytest.fixture(scope="module")
def cfg():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


@pytest.fixture(scope="module")
def base(cfg):
    return peak_record(cfg, **STEP)


def test_record_is_the_estimators_peak(cfg, base):
    rec, est = base
    plain = estimate_training_memory(cfg, **STEP)
    assert rec.bytes == rec.peak_bytes == plain.peak_bytes  # no card: the traced tensors, to the byte
    assert rec.breakdown == plain.breakdown and sum(rec.breakdown.values()) == rec.peak_bytes
    assert rec.phase == plain.peak_phase
    assert hasattr(torch.ops.aten, rec.op), rec.op  # the op at the peak is an ATen op
    assert rec.module != "-" and max(rec.module_peaks.values()) == rec.peak_bytes


def test_assert_peak_at_the_boundary(cfg, base):
    rec, _ = base
    est = assert_peak(cfg, at_most=rec.peak_bytes, **STEP)  # equal: passes
    assert est.peak_bytes == rec.peak_bytes
    with pytest.raises(AssertionError) as err:
        assert_peak(cfg, at_most=rec.peak_bytes - 1, **STEP)
    msg = str(err.value)
    assert "exceeds at_most" in msg and f"{rec.peak_bytes:,} bytes" in msg and "by 1 B" in msg
    assert f"op {rec.op!r}" in msg and f"{rec.phase} phase" in msg and "activations" in msg


def test_assert_peak_with_a_card_compares_reserved(cfg):
    est = assert_peak(cfg, batch_size=4, seq_len=64, gpu="a100-40gb")  # fits the card's usable memory
    assert est.device.startswith("cuda") and est.reserved_bytes > est.peak_bytes
    with pytest.raises(AssertionError, match="reserved"):  # above the tensors' peak, below the reserved figure
        assert_peak(cfg, batch_size=4, seq_len=64, gpu="a100-40gb", at_most=est.reserved_bytes - 1)


def test_assert_peak_bad_input(cfg):
    with pytest.raises(ValueError, match="at_most=None is invalid"):
        assert_peak(cfg, **STEP)
    with pytest.raises(ValueError, match="at_most"):
        assert_peak(cfg, at_most="lots", **STEP)


def test_baseline_round_trip_and_regressions(cfg, tmp_path):
    path = tmp_path / "memory.json"
    rec = record(path, "tiny-llama", cfg, **STEP)
    assert json.loads(path.read_text())["tiny-llama"]["bytes"] == rec.bytes
    same = compare(path, "tiny-llama", cfg, **STEP)
    assert not same.grew and same.change == 0.0

    # a deliberate regression: checkpointing turned off keeps every layer's activations
    with pytest.raises(AssertionError) as err:
        compare(path, "tiny-llama", cfg, **{**STEP, "checkpointing": False})
    msg = str(err.value)
    assert "memory regression in 'tiny-llama'" in msg and "category 'activations'" in msg
    assert "settings differ" in msg and "before" in msg and "after" in msg
    assert msg.count("  <-") == 1 and "activations" in msg.split("  <-")[0].splitlines()[-1]

    # another: a bigger batch
    with pytest.raises(AssertionError, match="category 'activations'"):
        compare(path, "tiny-llama", cfg, **{**STEP, "batch_size": 8})


def test_tolerance_allows_a_small_rise(cfg, tmp_path):
    path = tmp_path / "m.json"
    rec = record(path, "a", cfg, **STEP)
    bigger, _ = peak_record(cfg, **{**STEP, "seq_len": 66})
    rise = bigger.bytes / rec.bytes - 1
    assert 0 < rise < 0.2
    assert not compare(path, "a", cfg, **{**STEP, "seq_len": 66}, tolerance=rise * 1.01).grew
    with pytest.raises(AssertionError, match="regression"):
        compare(path, "a", cfg, **{**STEP, "seq_len": 66}, tolerance=rise * 0.99)


def test_diff_names_the_module_and_op(cfg, base, tmp_path):
    before, _ = base
    after, _ = peak_record(cfg, **{**STEP, "checkpointing": False})
    from memlab.testing import diff

    d = diff("x", before, after, 0.0)
    assert d.grew and d.category == "activations" and d.op == after.op
    assert d.module in after.module_peaks or d.module == after.module


def test_record_mode_from_the_environment(cfg, tmp_path, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv("MEMLAB_BASELINE", "record")
    d = MemoryBaseline(path).compare("b", cfg, **{**STEP, "batch_size": 2})
    assert not d.grew and "b" in MemoryBaseline(path).records()
    monkeypatch.delenv("MEMLAB_BASELINE")
    with pytest.raises(AssertionError, match="regression"):
        MemoryBaseline(path).compare("b", cfg, **STEP)  # batch 4 against the recorded 2


def test_baseline_bad_input(cfg, tmp_path):
    path = tmp_path / "m.json"
    with pytest.raises(AssertionError, match="no baseline named 'nope'"):
        MemoryBaseline(path).compare("nope", cfg, **STEP)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a memlab baseline"):
        MemoryBaseline(path).records()
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a memlab baseline"):
        MemoryBaseline(path).records()
    with pytest.raises(ValueError, match="tolerance=-0.1 is invalid"):
        MemoryBaseline(path, tolerance=-0.1)
    with pytest.raises(ValueError, match="mode='replace' is invalid"):
        MemoryBaseline(path, mode="replace")


def test_readme_example_runs_and_fails_on_a_regression(tmp_path, monkeypatch):
    """The README's example (extracted, so the two cannot drift) records, passes, then fails without checkpointing."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    at = readme.index("<!-- memlab-testing-example -->")
    code = re.compile(r"```python\n(.*?)```", re.S).search(readme, at).group(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMLAB_BASELINE", "record")
    ns: dict = {}
    exec(compile(code, "README.md:memlab-testing-example", "exec"), ns)
    ns["test_no_memory_regression"]()
    assert (tmp_path / "tests" / "memory_baseline.json").is_file()
    monkeypatch.delenv("MEMLAB_BASELINE")
    ns = {}
    exec(compile(code, "README.md:memlab-testing-example", "exec"), ns)
    ns["BASELINE"].mode = "compare"
    ns["test_step_fits_an_a100_40gb"]()
    ns["test_no_memory_regression"]()
    ns["STEP"]["checkpointing"] = False
    with pytest.raises(AssertionError) as err:
        ns["test_no_memory_regression"]()
    shown = readme[at:].split("```text\n", 1)[1].split("```", 1)[0]
    assert str(err.value).splitlines()[:2] == shown.splitlines()[:2]  # the README shows this run's message


def test_the_step_function_may_be_given_as_step(cfg):
    """``assert_peak(model, step=fn)``: a training step function is the StepSpec's ``step`` field, not the settings
    (a StepSpec is still taken as the settings)."""
    from memlab.estimate import StepSpec

    def summed_logits(model, batch):  # a step that keeps every logit: its peak differs from the default loss's
        return model(input_ids=batch["input_ids"]).logits.float().pow(2).sum()

    kw = dict(batch_size=2, seq_len=32, optimizer="sgd", device="cpu")
    want = estimate_training_memory(cfg, step=summed_logits, **kw).peak_bytes
    assert want != estimate_training_memory(cfg, **kw).peak_bytes
    for est in (assert_peak(cfg, summed_logits, at_most=want, **kw),
                assert_peak(cfg, step=summed_logits, at_most=want, **kw)):
        assert est.peak_bytes == want
    with pytest.raises(AssertionError, match="exceeds at_most"):
        assert_peak(cfg, step=summed_logits, at_most=want - 1, **kw)
    spec = StepSpec(batch_size=2, seq_len=32, optimizer="sgd", device="cpu")
    assert assert_peak(cfg, spec, at_most=10**12).peak_bytes == estimate_training_memory(cfg, spec).peak_bytes
