"""``memlab bench plan``: how long ``memlab plan`` takes, as a user runs it (issue 42.2).

Each case runs ``python -m memlab plan ...`` in a fresh process (interpreter start and imports included) and
times its wall clock and CPU time (user + sys, of the process):

* ``worked``: the chapter 07 worked case, ``memlab plan llama-3-8b --gpu rtx4090 --seq-len 2048 --batch-size 16``,
  first with an empty trace cache (target: 30 s), then again on the cache the first run filled (target: 3 s);
* ``tiny``: a tiny Llama config file (``memlab.models.tiny_llama_config()``, 0.79M parameters) planned for the
  same card with an empty cache, batch 8 x 256 tokens (target: 10 s).

The caches live in a temporary folder (``MEMLAB_CACHE_DIR``), never the user's. The plan's own summary line
says how many stacks it traced, read from the cache, or decided by a bound, and how many of its traces were made
ahead, two at a time (:mod:`memlab.plan.ahead`; "ahead unused": traced ahead, never asked for); the table shows it.
The CPU time is the process's and its children's (a process tracing ahead is a child). The targets
are for 2 idle cores: the host's load average is printed, and a busy host stretches the wall time past the
CPU time. ``--small`` runs the worked case on a two-layer tiny config (batch 4 x 128) instead of Llama-3-8B: it
checks the bench itself cheaply, and its verdicts say nothing about the targets.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlab.bench import add_strict, device_name, load_average, report_targets, table

TARGETS_S = {"worked, first run": 30.0, "worked, repeat": 3.0, "tiny, first run": 10.0}
WORKED = ["llama-3-8b", "--gpu", "rtx4090", "--seq-len", "2048", "--batch-size", "16"]
_SUMMARY = re.compile(r"(\d+) candidates: (\d+) stacks traced on fake tensors, (\d+) read from the trace cache; "
                      r"(\d+) ruled out untraced by a lower bound.*?, (\d+) decided to fit")
_AHEAD = re.compile(r"; (\d+) of the traces made ahead, two at a time \(and (\d+) made ahead not needed\)")


def run_plan(argv: list[str], cache_dir: str) -> dict:
    """``python -m memlab plan *argv --no-progress`` in a fresh process with ``MEMLAB_CACHE_DIR=cache_dir``: its
    wall and CPU seconds, exit code, the counts of its summary line and its verdict line."""
    env = dict(os.environ, MEMLAB_CACHE_DIR=cache_dir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memlab", "plan", *argv, "--no-progress"], capture_output=True,
                          text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"memlab plan {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    m = _SUMMARY.search(proc.stdout)
    if m is None:
        raise RuntimeError(f"memlab plan printed no summary line:\n{proc.stdout[-2000:]}")
    candidates, fresh, cached, below, above = map(int, m.groups())
    ahead = _AHEAD.search(proc.stdout)
    verdict = next((line for line in proc.stdout.splitlines() if line.startswith(("pick:", "nothing fits"))), "?")
    return dict(wall_s=wall, cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                code=proc.returncode, candidates=candidates, fresh=fresh, cached=cached, below=below, above=above,
                ahead=int(ahead.group(1)) if ahead else 0, ahead_unused=int(ahead.group(2)) if ahead else 0,
                remembered="read whole from the plan cache" in proc.stdout, verdict=verdict)


def _tiny_config(folder: Path, layers: int | None = None) -> str:
    from memlab.models import tiny_llama_config

    cfg = tiny_llama_config() if layers is None else tiny_llama_config(num_hidden_layers=layers)
    path = folder / (f"tiny-{layers}" if layers else "tiny")
    path.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(str(path / "config.json"))
    return str(path / "config.json")


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print their table and a TARGET MET / TARGET MISSED line each; exit code 0, or 1 with
    ``--strict`` when a target is missed."""
    p = argparse.ArgumentParser(prog="memlab bench plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="worked,tiny", help="comma-separated: worked, tiny (default both)")
    p.add_argument("--small", action="store_true", help="the worked case on a two-layer tiny config: checks the bench "
                                                       "only")
    add_strict(p)
    args = p.parse_args(list(argv or []))
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in ("worked", "tiny")]
    if bad or not cases:
        p.error(f"--cases={args.cases!r} is invalid; allowed: a comma-separated subset of worked, tiny")
    results: dict[str, dict] = {}
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="memlab-bench-plan-") as tmp:
        root = Path(tmp)
        if "worked" in cases:
            worked = ([_tiny_config(root, layers=2), "--gpu", "rtx4090", "--seq-len", "128", "--batch-size", "4"]
                      if args.small else WORKED)
            cache = str(root / "cache-worked")
            results["worked, first run"] = run_plan(worked, cache)
            results["worked, repeat"] = run_plan(worked, cache)
        if "tiny" in cases:
            tiny = [_tiny_config(root), "--gpu", "rtx4090", "--batch-size", "8", "--seq-len", "256"]
            results["tiny, first run"] = run_plan(tiny, str(root / "cache-tiny"))
    what = "a 2-layer tiny config, batch 4 x 128, in place of llama-3-8b (--small)" if args.small else " ".join(WORKED)
    print(table(f"memlab plan as a fresh process (imports included); worked case: {what}",
                ("case", "wall (s)", "CPU (s)", "candidates", "traced", "from cache", "lower bound", "fit by neighbour",
                 "traced ahead", "ahead unused", "exit"),
                [(name, r["wall_s"], r["cpu_s"], r["candidates"], r["fresh"], r["cached"], r["below"], r["above"],
                  r["ahead"], r["ahead_unused"], r["code"]) for name, r in results.items()], device="cpu"))
    print()
    for name, r in results.items():
        print(f"  {name}: {r['verdict']}" + (" [the whole plan from the plan cache]" if r["remembered"] else ""))
    checks = []
    for name, r in results.items():
        target = TARGETS_S[name]
        scale = " [--small: a tiny config, says nothing about the target]" if args.small and name.startswith("worked") \
            else ""
        checks.append((f"{name} in {r['wall_s']:.1f} s (target <= {target:g} s, process wall time; CPU "
                       f"{r['cpu_s']:.1f} s){scale}", r["wall_s"] / target, r["wall_s"] <= target))
    code = report_targets(checks, "cpu", strict=args.strict)
    print(f"host: {device_name('cpu')}; load average {load_before} before, {load_average()} after (the targets are "
          f"for 2 idle cores: a busy host stretches the wall time past the CPU time)")
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
