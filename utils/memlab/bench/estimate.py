"""``memlab bench estimate``: how long ``memlab estimate`` makes its user wait, as fresh processes (issue 42).

Three commands, each run as a new ``python -m memlab estimate ...`` process and timed from start to exit (imports
included, as a user waits for them):

* ``llama-2-7b`` (target 4 s);
* ``llama-2-70b`` (target 4 s);
* ``llama-2-7b --gpu rtx4090``: the estimate and all its suggestions, traced (target 6 s).

Each is timed twice over: *cold* (``MEMLAB_CACHE_DIR`` a new empty folder: every trace made, a first run) and
*warm* (a folder that one untimed run filled: the answers read from the trace cache, where the command keeps it,
:func:`memlab.estimate.trace_cache.enable_disk_cache`). The commands run in turns, round by round (a busy moment
slows each alike), and each figure is the median of ``--repeat`` rounds. Every run must exit 0 and print a peak.
The targets were set for two idle cores; on a shared machine the figures are noisy: say so beside them.

Each round also times the *floor* (:data:`FLOOR_CODE`): a fresh process that imports what every one of these
commands imports before its first trace (torch, memlab's estimator, transformers' Llama, the fake-tensor mode with
``torch._dynamo``) and leaves as the command does, tracing nothing. No first run can be faster; the table shows each
command's time above it, the part tracing makes: on a host whose speed drifts by the hour, the floor says how much of
a figure is the imports, not the tracing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

from memlab.bench import add_strict, report_targets

#: (name, ``memlab estimate`` arguments, target seconds)
CASES: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("7B", ("llama-2-7b",), 4.0),
    ("70B", ("llama-2-70b",), 4.0),
    ("7B + all suggestions", ("llama-2-7b", "--gpu", "rtx4090"), 6.0),
)
MODES = ("cold", "warm")

Runner = Callable[[Sequence[str], str], "tuple[float, bool, float]"]

#: the floor's process: the imports of a first ``memlab estimate`` of a Llama preset (a subset of what that command
#: has imported when it exits), with the cyclic garbage collector off as the command runs them (memlab.cli.console),
#: then the command's own quick exit (os._exit: no interpreter teardown)
FLOOR_CODE = ("import gc; gc.disable(); import os, sys, memlab.cli.estimate, memlab.estimate.trace; "
              "from transformers import LlamaConfig, LlamaForCausalLM; "
              "from torch._subclasses.fake_tensor import FakeTensorMode; "
              "sys.stdout.flush(); os._exit(0)")


def _timed(cmd: list[str], env: dict[str, str] | None) -> tuple[subprocess.CompletedProcess, float, float]:
    # (the finished process, its wall seconds, its CPU seconds: user + system of it and its children)
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])


def run_process(args: Sequence[str], cache_dir: str) -> tuple[float, bool, float]:
    """(wall seconds, whether it read the trace cache, CPU seconds: user + system) of ``python -m memlab estimate
    ARGS`` in a new process with ``MEMLAB_CACHE_DIR=cache_dir``. The CPU time counts the process and its children:
    the suggestions are traced in two processes where it may run on two CPUs (:func:`memlab.estimate.suggest.suggestions`),
    so on idle cores it exceeds the wall time there; the estimate itself runs one thread, its CPU time about its wall
    time. On a busy machine the CPU time is the steadier figure.

    Raises:
        RuntimeError: the command failed or printed no peak (its last lines quoted).
    """
    proc, seconds, cpu = _timed([sys.executable, "-m", "memlab", "estimate", *args],
                                {**os.environ, "MEMLAB_CACHE_DIR": cache_dir})
    if proc.returncode != 0 or "peak:" not in proc.stdout:
        raise RuntimeError(f"memlab estimate {' '.join(args)} exited {proc.returncode}: {_tail(proc)}")
    return seconds, "read from the trace cache" in proc.stdout, cpu


def run_floor() -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a fresh ``python -c FLOOR_CODE`` (:data:`FLOOR_CODE`).

    Raises:
        RuntimeError: the process failed (its last lines quoted).
    """
    proc, seconds, cpu = _timed([sys.executable, "-c", FLOOR_CODE], None)
    if proc.returncode != 0:
        raise RuntimeError(f"the floor's imports (python -c FLOOR_CODE) exited {proc.returncode}: {_tail(proc)}")
    return seconds, cpu


FLOOR = "imports alone"  # the floor's row in measure's times


def measure(repeat: int, runner: Runner = run_process, cases=CASES,
            floor: Callable[[], tuple[float, float]] | None = run_floor
            ) -> tuple[dict[tuple[str, str], list[float]], bool]:
    """Seconds of every case in both modes, ``repeat`` rounds, interleaved: {(case, mode): [seconds, ...]} (wall;
    the CPU seconds under ``(case, mode + " cpu")``), and whether every warm run read the trace cache. ``floor``
    (:func:`run_floor`; None: not timed) is timed first in each round, under ``(FLOOR, "cold")`` and
    ``(FLOOR, "cold cpu")``."""
    times: dict[tuple[str, str], list[float]] = {(name, m): [] for name, _, _ in cases for m in (*MODES, "cold cpu",
                                                                                                  "warm cpu")}
    if floor is not None:
        times[(FLOOR, "cold")], times[(FLOOR, "cold cpu")] = [], []
    cached = True
    with tempfile.TemporaryDirectory(prefix="memlab-bench-estimate-") as root:
        warm = os.path.join(root, "warm")
        for _, args, _ in cases:  # fill the warm cache (untimed)
            runner(args, warm)
        for r in range(repeat):
            if floor is not None:
                seconds, cpu = floor()
                times[(FLOOR, "cold")].append(seconds)
                times[(FLOOR, "cold cpu")].append(cpu)
            for name, args, _ in cases:
                seconds, _, cpu = runner(args, os.path.join(root, f"cold-{r}-{name}"))
                times[(name, "cold")].append(seconds)
                times[(name, "cold cpu")].append(cpu)
                seconds, read, cpu = runner(args, warm)
                times[(name, "warm")].append(seconds)
                times[(name, "warm cpu")].append(cpu)
                cached = cached and read
    return times, cached


def report(times: dict[tuple[str, str], list[float]], cases=CASES) -> tuple[list[str], list[tuple[str, float, bool]]]:
    """The table, and one ``(text, seconds / target, holds)`` target per case and mode (memlab.bench's verdicts)."""
    lines = [f"{'command':<24}{'cold (s)':>10}{'cpu':>7}{'warm (s)':>10}{'cpu':>7}{'target (s)':>12}   runs",
             "-" * 78]
    checks = []
    for name, args, target in cases:
        med = {m: statistics.median(times[(name, m)]) for m in (*MODES, "cold cpu", "warm cpu")}
        lines.append(f"{name:<24}{med['cold']:>10.2f}{med['cold cpu']:>7.2f}{med['warm']:>10.2f}{med['warm cpu']:>7.2f}"
                     f"{target:>12.1f}   {len(times[(name, 'cold')])}")
        for m in MODES:
            what = "first run, every trace made" if m == "cold" else "repeat, read from the trace cache"
            checks.append((f"memlab estimate {' '.join(args)} ({what}): median {med[m]:.2f} s <= {target:.1f} s",
                           med[m] / target, med[m] <= target))
    lines.append("(wall time, the targets' measure; cpu: user + system seconds of the process and its children: the "
                 "suggestions are traced in two processes, so their cpu exceeds their wall time on idle cores)")
    if times.get((FLOOR, "cold")):
        low = statistics.median(times[(FLOOR, "cold")])
        above = ", ".join(f"{name} {statistics.median(times[(name, 'cold')]) - low:.2f} s" for name, _, _ in cases)
        lines.append(f"floor: a fresh process importing what these commands import before their first trace, tracing "
                     f"nothing (memlab.bench.estimate.FLOOR_CODE): median {low:.2f} s (cpu "
                     f"{statistics.median(times[(FLOOR, 'cold cpu')]):.2f}); each first run above it: {above}")
    return lines, checks


def main(argv: list[str] | None = None, runner: Runner = run_process,
         floor: Callable[[], tuple[float, float]] | None = run_floor) -> int:
    """``memlab bench estimate [--repeat N] [--strict]``: the table, the floor and the verdicts; exit 1 on a missed
    target with ``--strict`` or a failed command, else 0. ``runner`` and ``floor``: as :func:`measure` takes them."""
    p = argparse.ArgumentParser(prog="memlab bench estimate", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="timed rounds of each command (default 3; the median)")
    add_strict(p)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat={args.repeat} is invalid; allowed: an int >= 1")
    import platform

    print(f"memlab estimate as fresh processes: CPU {platform.machine()} ({os.cpu_count()} cores), "
          f"Python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"median of {args.repeat} interleaved round(s); wall time, imports included")
    try:
        times, cached = measure(args.repeat, runner, floor=floor)
    except RuntimeError as exc:
        print(f"memlab bench estimate: error: {exc}", file=sys.stderr)
        return 1
    lines, checks = report(times)
    print("\n".join(lines))
    if not cached:
        print("the warm runs did not read the trace cache: this memlab estimate does not turn it on "
              "(memlab.estimate.trace_cache.enable_disk_cache), so warm = another first run")
    try:
        load = os.getloadavg()[0]
        print(f"load average over the last minute: {load:.1f} on {os.cpu_count()} cores"
              + (" (a busy machine: these figures are slower than on idle cores)" if load > 1.0 else ""))
    except OSError:  # pragma: no cover - not on every platform
        pass
    return report_targets(checks, "cpu", strict=args.strict)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
