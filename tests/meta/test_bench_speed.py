"""``memlab bench speed`` at toy sizes (``--tiny``): every figure of issue 42 is printed as a table row and a
verdict line in the one format of ``memlab.bench.verdict``, and ``--strict`` turns a miss into exit code 1.
Never its timings: speed targets are the bench's verdicts, not tests."""
from __future__ import annotations

import re

import pytest

from memlab import bench
from memlab.bench import speed

NUM = r"[\d.,]+(?:e[-+]?\d+)?"
ROWS = {  # figure -> the rows it prints at --tiny sizes
    "tracker": [f"{m}: memlab {k}" for m in ("tinygpt", "tiny_llama")
                for k in ("MemoryTracker", "MemoryTracker(timeline=False)")],
    "adamw": ["chunked eager AdamW, 1 thread(s)"],
    "flash": ["flash attention fwd+bwd, seq 64", "flash attention fwd+bwd, seq 128"],
    "nf4": ["NF4 dequantize 64x64 float32", "NF4 dequantize 64x64 bfloat16"],
}


def test_the_speed_bench_is_discovered():
    assert "speed" in bench.available()


def test_bench_speed_tiny_prints_every_figure_and_one_verdict_each(capsys):
    pytest.importorskip("bitsandbytes")
    assert speed.main(["--tiny", "--repeat", "1"]) == 0  # without --strict a miss is reported, not failed
    out = capsys.readouterr().out
    assert out.startswith("memlab bench speed: issue 42's figures, medians of 1 interleaved rounds (--tiny: toy sizes)")
    assert re.search(r"^device: CPU .*torch threads\); torch ", out, re.M)
    assert re.search(r"^machine load: (load average [\d.]+ \(1 min\) on \d+ cores|unknown)$", out, re.M), out
    for figure, names in ROWS.items():
        for name in names:
            assert re.search(rf"^{re.escape(name)}\s+{NUM}\s+{NUM}\s+{NUM}$", out, re.M), (figure, name, out)
    verdicts = re.findall(rf"^TARGET (MET|MISSED): (.+) \(ratio ({NUM})\)$", out, re.M)
    texts = [t for _, t, _ in verdicts]
    assert sum("MemoryTracker" in t and "<= 1.2x" in t for t in texts) == 4
    assert sum(t.startswith("chunked eager AdamW step (50,000 params) at ") for t in texts) >= (
        1 if any("2 thread(s)" in line for line in out.splitlines()) else 0)
    assert sum(t.startswith("flash attention (PyTorch) fwd+bwd >= 0.5x SDPA's speed at seq ") for t in texts) == 2
    assert sum(t.startswith("NF4 dequantize 64x64 ") for t in texts) == 2
    for met, text, ratio in verdicts:  # the verdict is the ratio against the target the text states
        bound = float(re.search(r"(?:<=|>=) ([\d.]+)x", text).group(1))
        holds = float(ratio) <= bound if "<=" in text else float(ratio) >= bound
        assert (met == "MET") == holds or abs(float(ratio) - bound) < 1e-3, (met, text, ratio)
    missed = sum(m == "MISSED" for m, _, _ in verdicts)
    assert (f"{missed} target(s) missed" in out) == (missed > 0)


def test_strict_exit_code_follows_the_verdicts(capsys):
    code = speed.main(["--tiny", "--repeat", "1", "--only", "adamw,flash", "--strict"])
    out = capsys.readouterr().out
    assert code == (1 if "TARGET MISSED: " in out else 0)
    assert "TARGET MET: " in out or "TARGET MISSED: " in out


def test_report_targets_is_the_one_verdict_format(capsys):
    checks = [("a holds (shown: x)", 1.0, True), ("b misses (shown: y)", 0.25, False), ("c has no ratio", None, True)]
    assert bench.report_targets(checks, "cpu") == 0
    assert bench.report_targets(checks, "cpu", strict=True) == 1
    assert bench.report_targets(checks[:1], "cpu", strict=True) == 0
    out = capsys.readouterr().out
    assert "TARGET MET: a holds (shown: x) (ratio 1.000)" in out
    assert "TARGET MISSED: b misses (shown: y) (ratio 0.250)" in out
    assert "TARGET MET: c has no ratio\n" in out


@pytest.mark.parametrize("args", [["--only", "tracker,gpu"], ["--repeat", "0"], ["--only", ""]])
def test_bad_arguments_exit_2_naming_them(args, capsys):
    with pytest.raises(SystemExit) as exc:
        speed.main(args)
    assert exc.value.code == 2
    assert "--only" in capsys.readouterr().err


def test_interleaved_medians_times_in_rounds():
    order = []
    med = bench.interleaved_medians({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3, warmup=1)
    assert order == ["a", "b"] * 4 and set(med) == {"a", "b"}
    with pytest.raises(ValueError, match="repeat"):
        bench.interleaved_medians({"a": lambda: None}, 0)
