"""memlab estimate --validate: published figures, each with its source, settings and metric; offline."""
from __future__ import annotations

from memlab import estimate as E
from memlab import published_peaks as PP


def test_figures_are_documented():
    assert len(PP.FIGURES) >= 2
    for f in PP.FIGURES:
        assert f.source.startswith("https://") and f.metric in ("allocated", "reserved", "unstated")
        assert f.measured_bytes > 2**30 and f.as_published and f.gpu and f.differs
        assert {"batch_size", "seq_len", "dtype", "optimizer"} <= set(f.settings)
    for name, url, why in PP.NOT_COMPARABLE:
        assert url.startswith("https://") and why


def test_validate_errors_are_small():
    rows = PP.validate()
    assert len(rows) == len(PP.FIGURES)
    for r in rows:
        # the estimate (allocated: tensors + cuBLAS workspaces) within 5% of each published peak
        assert abs(r["error"]) < 0.05, (r["figure"].name, r["error"])
        if r["figure"].metric == "allocated":
            assert abs(r["error"]) < 0.03, (r["figure"].name, r["error"])


def test_cli_validate(capsys):
    assert E.main(["--validate"]) == 0
    out = capsys.readouterr().out
    assert "worst error on allocated figures" in out and "not comparable" in out
    for f in PP.FIGURES:
        assert f.source in out
