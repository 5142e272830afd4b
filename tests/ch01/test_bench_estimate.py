"""``memlab bench estimate`` (issue 42): its table, one verdict per command and mode, the exit code under
``--strict``, and an honest error when a command fails; a process runner stands in for the real one (the real
commands take seconds each: the bench itself is run by hand, never timed in a test)."""
from __future__ import annotations

import re

import pytest

from memlab.bench import estimate as B


def _runner(seconds, cached=True):
    calls = []

    def run(args, cache_dir):
        calls.append((tuple(args), cache_dir))
        return seconds[" ".join(args)], cached and "warm" in cache_dir, seconds[" ".join(args)] / 2

    return run, calls


FAST = {"llama-2-7b": 1.5, "llama-2-70b": 3.0, "llama-2-7b --gpu rtx4090": 5.0}


def test_table_and_verdicts(capsys):
    run, calls = _runner(FAST)
    assert B.main(["--repeat", "2", "--strict"], runner=run) == 0
    out = capsys.readouterr().out
    assert re.search(r"^7B\s+1\.50\s+0\.75\s+1\.50\s+0\.75\s+4\.0\s+2$", out, re.M)
    assert re.search(r"^7B \+ all suggestions\s+5\.00\s+2\.50\s+5\.00\s+2\.50\s+6\.0\s+2$", out, re.M)
    verdicts = re.findall(r"^TARGET (MET|MISSED): memlab estimate (.+) \((first run|repeat).*\(ratio [\d.]+\)$", out, re.M)
    assert len(verdicts) == 6 and {v[0] for v in verdicts} == {"MET"}
    # three untimed runs fill the warm cache, then 2 rounds x 3 commands x (cold, warm)
    assert len(calls) == 3 + 2 * 3 * 2
    colds = [d for (_, d) in calls[3:][::2]]
    assert len(set(colds)) == len(colds)  # every cold run gets an empty folder of its own
    assert len({d for (_, d) in calls[3:][1::2]} | {d for (_, d) in calls[:3]}) == 1  # one warm folder


def test_a_missed_target_is_said_and_strict_fails(capsys):
    run, _ = _runner({**FAST, "llama-2-70b": 9.0})
    assert B.main(["--repeat", "1"], runner=run) == 0
    out = capsys.readouterr().out
    assert ("TARGET MISSED: memlab estimate llama-2-70b (first run, every trace made): median 9.00 s <= 4.0 s "
            "(ratio 2.250)") in out
    assert "2 target(s) missed" in out
    assert B.main(["--repeat", "1", "--strict"], runner=run) == 1


def test_warm_runs_that_read_no_cache_are_said(capsys):
    run, _ = _runner(FAST, cached=False)
    B.main(["--repeat", "1"], runner=run)
    assert "the warm runs did not read the trace cache" in capsys.readouterr().out
    run, _ = _runner(FAST)
    B.main(["--repeat", "1"], runner=run)
    assert "did not read" not in capsys.readouterr().out


def test_a_failing_command_is_an_error_not_a_time(capsys):
    def run(args, cache_dir):
        raise RuntimeError("memlab estimate llama-2-7b exited 2: boom")

    assert B.main(["--repeat", "1"], runner=run) == 1
    assert "boom" in capsys.readouterr().err


def test_bad_repeat_is_an_argument_error():
    with pytest.raises(SystemExit) as info:
        B.main(["--repeat", "0"])
    assert info.value.code == 2
