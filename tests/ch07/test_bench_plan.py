"""``memlab bench plan`` at a tiny size (``--small``): its output format and what its processes report (a first run
traces, the repeat reads the whole plan from the cache), never its timings (speed targets are the bench's verdicts,
not tests)."""
from __future__ import annotations

import re

from memlab.bench import available


def test_the_plan_bench_is_discovered():
    assert "plan" in available()


def test_bench_plan_small(capsys):
    from memlab.bench import plan as bench

    assert bench.main(["--small", "--cases", "worked"]) == 0
    out = capsys.readouterr().out
    assert "memlab plan as a fresh process (imports included); worked case: a 2-layer tiny config" in out
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^(worked, first run|worked, repeat)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)"
        r"\s+(\d)$", out, re.M)}
    assert set(rows) == {"worked, first run", "worked, repeat"}, out
    first, again = rows["worked, first run"], rows["worked, repeat"]
    assert int(first[3]) > 0 and int(first[4]) == 0  # traced now, nothing from the cache
    assert int(again[3]) == 0 and int(again[4]) == int(first[3])  # nothing traced: all from the cache
    assert first[2] == again[2] and first[-1] == again[-1] == "0"  # the same candidates, a stack fits
    assert int(first[7]) <= int(first[3]) and again[7] == again[8] == "0"  # traced ahead: of those traced; none again
    assert re.search(r"^  worked, repeat: pick: .*\[the whole plan from the plan cache\]$", out, re.M)
    verdicts = re.findall(r"^TARGET (MET|MISSED): (worked, first run|worked, repeat) in [\d.]+ s \(target <= (\d+) s, "
                          r"process wall time; CPU [\d.]+ s\) \[--small: a tiny config, says nothing about the target\]"
                          r" \(ratio [\d.]+\)$",
                          out, re.M)
    assert [(v[1], v[2]) for v in verdicts] == [("worked, first run", "30"), ("worked, repeat", "3")]
    assert re.search(r"^host: CPU .*; load average .* before, .* after", out, re.M)


def test_bench_plan_refuses_an_unknown_case(capsys):
    import pytest

    from memlab.bench import plan as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--cases", "huge"])
    assert exc.value.code == 2 and "--cases='huge' is invalid; allowed: a comma-separated subset of worked, tiny" in \
        capsys.readouterr().err
