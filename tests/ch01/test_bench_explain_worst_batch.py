"""``memlab bench explain`` and ``memlab bench worst_batch`` at a tiny size (``--small``): their output format and
their synthetic snapshot, never their timings (speed targets are the benches' verdicts, not tests)."""
from __future__ import annotations

import pickle
import re
import subprocess
import sys

import pytest

from memlab.bench import available


def test_both_benches_are_discovered():
    assert {"explain", "worst_batch"} <= set(available())


def test_the_synthetic_snapshot_is_one_pytorch_reads_and_memlab_explains(tmp_path):
    from memlab.bench.explain import synthetic_snapshot
    from memlab.profiler.explain import explain

    snap = synthetic_snapshot(300_000, seed=1)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert 250_000 < path.stat().st_size < 450_000  # about the size asked
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for seg in snap["segments"]:  # the blocks tile each segment
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    live = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    e = explain(path)
    assert e.kind == "CUDA memory snapshot" and e.allocated_bytes >= live and e.by_source and e.largest


def test_bench_explain_small(capsys):
    from memlab.bench import explain as bench

    assert bench.main(["--small"]) == 0
    out = capsys.readouterr().out
    assert "memlab explain on a synthetic CUDA memory snapshot of" in out
    for quantity in ("process wall time (s)", "process CPU time, user + sys (s)", "peak RSS of that process (GB)"):
        assert quantity in out
    verdicts = re.findall(r"^TARGET (MET|MISSED): (.*)$", out, re.M)
    assert len(verdicts) == 2 and "target < 10 s" in verdicts[0][1] and "target < 2 GB" in verdicts[1][1]
    assert all("the target is for 100 MB" in v for _, v in verdicts)  # a small run says it is not the target's
    assert all(re.search(r" \(ratio [\d.]+\)$", v) for _, v in verdicts)  # memlab.bench.verdict's one format
    assert "CUDA memory snapshot; at the peak of allocated memory" in out  # the command's own first line


def test_bench_worst_batch_small(capsys):
    pytest.importorskip("transformers")
    from memlab.bench import worst_batch as bench

    assert bench.main(["--small"]) == 0
    out = capsys.readouterr().out
    assert "the worst batch of 1,000 lengths" in out and "gpt2" in out
    assert re.search(r"worst batch\s+#\d+: 8 x \d+ tokens", out)
    assert re.search(r"batches in the epoch\s+125\b", out)
    verdict = re.findall(r"^TARGET (MET|MISSED): the worst batch in [\d.]+ s \(target < 30 s, process wall time\)"
                         r" \[1,000 lengths, gpt2: the target is for 100,000 lengths and a 7B preset\]"
                         r" \(ratio [\d.]+\)$", out, re.M)  # memlab.bench.verdict's line, the time / target as ratio
    assert len(verdict) == 1


def test_bench_arguments_are_checked(capsys):
    from memlab.bench import explain, worst_batch

    with pytest.raises(SystemExit):
        explain.main(["--size-mb", "0"])
    assert "--size-mb=0 must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        worst_batch.main(["--samples", "0"])
    assert "--samples=0 must be >= 1" in capsys.readouterr().err
