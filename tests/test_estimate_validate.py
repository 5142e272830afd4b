"""memlab estimate --validate: published figures, each with its source, settings and metric; offline.

The full validation traces 10 figures (about 2-3 minutes on 2 busy CPU cores); the tests trace the
two Mistral-7B figures (allocated metric) and check every figure's documentation and the verdict logic.
"""
from __future__ import annotations

import pytest

from memlab import estimate as E
from memlab import published_peaks as PP


def test_figures_are_documented():
    assert len(PP.FIGURES) + len(PP.NOT_EXPRESSIBLE) >= 15
    kinds = {f.kind for f in PP.FIGURES} | {"qlora"}  # QLoRA figures are among the not-expressible ones
    assert {"full", "lora"} <= kinds
    assert {f.model for f in PP.FIGURES if isinstance(f.model, str)} >= {"mistral-7b", "bert-large-cls"}
    for f in PP.FIGURES:
        assert f.source.startswith("https://") and f.metric in PP.METRICS
        assert f.measured_bytes > 2**30 and f.as_published and f.gpu and f.differs
        assert {"batch_size", "seq_len", "dtype", "optimizer"} <= set(f.settings)
        assert (f.context_bytes > 0) == (f.metric == "nvidia-smi")  # the context named where it is in the figure
    for name, url, published, why in PP.NOT_EXPRESSIBLE:
        assert url.startswith("https://") and published and why
    assert any("FSDP1" in why for *_, why in PP.NOT_EXPRESSIBLE)
    assert any("paged" in why.lower() and "optimizer_in_bwd" in why for *_, why in PP.NOT_EXPRESSIBLE)


@pytest.mark.parametrize("metric,ours,ok", [("allocated", 103, True), ("allocated", 96, False),
                                            ("reserved", 100, True), ("reserved", 101, False),
                                            ("nvidia-smi", 99, True), ("unstated", 120, False)])
def test_verdicts(metric, ours, ok):
    fig = PP.FIGURES[0].__class__(name="x", source="https://x", measured_bytes=100, metric=metric, as_published="x",
                                  model="x")
    assert PP._verdict(fig, ours)[1] is ok


def test_validate_mistral_rows_within_target(capsys):
    assert E.main(["--validate", "Mistral-7B, batch"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("fms-acceleration: full fine-tuning, Mistral-7B")]
    assert len(rows) == 2 and all("met (within 3%)" in r for r in rows)
    assert "allocated figures: median |error|" in out and "2 of 2 comparable figures meet their target" in out
    assert PP._FMS in out and "MISSED" not in out
