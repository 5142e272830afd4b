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


def _floor(walls=(1.0, 1.25, 0.5)):
    it = iter(walls * 10)

    def floor():
        w = next(it)
        return w, w - 0.25

    return floor


def test_table_and_verdicts(capsys):
    run, calls = _runner(FAST)
    assert B.main(["--repeat", "2", "--strict"], runner=run, floor=_floor()) == 0
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
    assert B.main(["--repeat", "1"], runner=run, floor=None) == 0
    out = capsys.readouterr().out
    assert ("TARGET MISSED: memlab estimate llama-2-70b (first run, every trace made): median 9.00 s <= 4.0 s "
            "(ratio 2.250)") in out
    assert "2 target(s) missed" in out
    assert B.main(["--repeat", "1", "--strict"], runner=run, floor=None) == 1


def test_warm_runs_that_read_no_cache_are_said(capsys):
    run, _ = _runner(FAST, cached=False)
    B.main(["--repeat", "1"], runner=run, floor=None)
    assert "the warm runs did not read the trace cache" in capsys.readouterr().out
    run, _ = _runner(FAST)
    B.main(["--repeat", "1"], runner=run, floor=None)
    assert "did not read" not in capsys.readouterr().out


def test_a_failing_command_is_an_error_not_a_time(capsys):
    def run(args, cache_dir):
        raise RuntimeError("memlab estimate llama-2-7b exited 2: boom")

    assert B.main(["--repeat", "1"], runner=run, floor=_floor()) == 1
    assert "boom" in capsys.readouterr().err


def test_bad_repeat_is_an_argument_error():
    with pytest.raises(SystemExit) as info:
        B.main(["--repeat", "0"])
    assert info.value.code == 2


def test_the_floor_is_timed_each_round_and_each_first_run_shown_above_it(capsys):
    run, _ = _runner(FAST)
    assert B.main(["--repeat", "3"], runner=run, floor=_floor((1.0, 1.25, 0.5))) == 0
    out = capsys.readouterr().out
    # the median of 1.0, 1.25, 0.5 (not the mean, nor the first), its cpu's median, and each cold median minus it
    assert ("median 1.00 s (cpu 0.75); each first run above it: 7B 0.50 s, 70B 2.00 s, 7B + all suggestions "
            "4.00 s") in out
    run, _ = _runner(FAST)
    assert B.main(["--repeat", "1"], runner=run, floor=None) == 0
    assert "floor:" not in capsys.readouterr().out


def test_a_failing_floor_is_an_error(capsys):
    def floor():
        raise RuntimeError("the floor's imports (python -c FLOOR_CODE) exited 1: ImportError")

    run, _ = _runner(FAST)
    assert B.main(["--repeat", "1"], runner=run, floor=floor) == 1
    assert "ImportError" in capsys.readouterr().err


def test_the_floor_process_runs_and_imports_only_what_an_estimate_imports():
    """The real floor: a fresh process that exits 0, timed (wall and CPU both positive); and every module it imports
    is one a first ``memlab estimate llama-2-7b`` has imported when it ends (each in a fresh process of its own), so
    no first run of these commands can be faster than it."""
    import json
    import os
    import subprocess
    import sys

    wall, cpu = B.run_floor()
    assert wall > 0 and cpu > 0
    dump = "import json, sys; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "MEMLAB_CACHE_DIR": "none", "MEMLAB_QUICK_EXIT": "0"}
    floor_code = B.FLOOR_CODE.replace("sys.stdout.flush(); os._exit(0)", dump)
    assert floor_code != B.FLOOR_CODE
    est_code = ("import io, contextlib; from memlab.cli.estimate import main\n"
                "with contextlib.redirect_stdout(io.StringIO()): assert main(['llama-2-7b']) == 0\n" + dump)
    mods = []
    for code in (floor_code, est_code):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        mods.append(set(json.loads(proc.stdout.strip().splitlines()[-1])))
    floor, estimate = mods
    assert {"transformers.models.llama.modeling_llama", "torch._dynamo", "memlab.estimate.trace"} <= floor
    assert floor <= estimate, sorted(floor - estimate)[:10]


def test_a_failing_floor_process_is_an_error(monkeypatch):
    monkeypatch.setattr(B, "FLOOR_CODE", "import sys; sys.exit(3)")
    with pytest.raises(RuntimeError, match="exited 3"):
        B.run_floor()
