"""``memlab bench profiler``: what the chapter 01 tools cost.

1. Tracker overhead: a TinyGPT training step (forward, backward, AdamW step) timed untracked,
   under :class:`memlab.profiler.MemoryTracker`, and under PyTorch's own
   ``torch.distributed._tools.mem_tracker.MemTracker``; medians of ``--repeat`` runs, as ratios
   to the untracked step. Target: MemoryTracker < 3x.
2. Estimator cost, each in a fresh subprocess (its peak resident memory, ``ru_maxrss``, is the
   estimator's alone): the Llama-2-70B preset (seq_len 4096, batch 1, bf16, AdamW), target < 5 s
   for the estimate and < 8 GB; and Llama-2-7B (batch 1 x 2048) with all of ``memlab estimate``'s
   suggestions (every traced what-if), target < 10 s. A homogeneous decoder stack is traced at
   two depths and extrapolated by layer count (equal to the full trace); the process wall time
   (imports included) is shown next to it.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from memlab.bench import device_name, table, time_median
from memlab.core.units import GB, GiB

OVERHEAD_TARGET = 3.0
WALL_TARGET_S = 5.0  # the 70B estimate itself
SUGGEST_TARGET_S = 10.0  # the 7B estimate with all suggestions
RSS_TARGET_BYTES = 8 * GB

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from memlab.estimate import estimate_training_memory
t1 = time.perf_counter()
a = json.loads(sys.argv[1])
est = estimate_training_memory(a["model"], batch_size=a["batch_size"], seq_len=a["seq_len"],
                               dtype=a["dtype"], optimizer=a["optimizer"])
n_sugg = 0
if a.get("suggest"):
    from memlab.estimate import suggestions
    n_sugg = len(suggestions(est, a["model"], device="cuda"))
t2 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, estimate_s=t2 - t1, total_s=t2 - t0, n_suggestions=n_sugg,
                      extrapolated=list(est.extrapolated_from),
                      peak_bytes=est.peak_bytes, n_params=est.n_params,
                      maxrss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))
"""


def _tracker_overhead(repeat: int, batch_size: int, seq_len: int) -> list[tuple]:
    from memlab.models import TinyGPT, TinyGPTConfig, lm_loss
    from memlab.profiler import MemoryTracker

    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(block_size=max(128, seq_len)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (batch_size, seq_len))
    y = torch.randint(0, 256, (batch_size, seq_len))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model, x, y).backward()
        opt.step()

    def tracked() -> None:
        with MemoryTracker(model, opt):
            step()

    def tracked_no_timeline() -> None:
        with MemoryTracker(model, opt, timeline=False):
            step()

    rows = []
    base = time_median(step, repeat=repeat, warmup=2)
    rows.append(("untracked step", base * 1e3, 1.0))
    for label, fn in (("memlab MemoryTracker", tracked), ("memlab MemoryTracker(timeline=False)", tracked_no_timeline)):
        t = time_median(fn, repeat=repeat, warmup=1)
        rows.append((label, t * 1e3, t / base))
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        def torch_tracked() -> None:
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                step()

        t = time_median(torch_tracked, repeat=repeat, warmup=1)
        rows.append(("torch MemTracker (reference)", t * 1e3, t / base))
    except Exception as exc:  # pragma: no cover - depends on the torch build
        rows.append((f"torch MemTracker unavailable ({type(exc).__name__})", float("nan"), float("nan")))
    return rows


def _estimator_cost(model: str, seq_len: int, batch_size: int, dtype: str, optimizer: str, suggest: bool = False) -> dict:
    arg = json.dumps(dict(model=model, seq_len=seq_len, batch_size=batch_size, dtype=dtype, optimizer=optimizer,
                          suggest=suggest))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"estimator subprocess failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    # Linux reports ru_maxrss in KiB.
    result["maxrss_bytes"] = max(result["maxrss_kb"], resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables and PASS/FAIL lines; exit code 0 when every target holds, else 1."""
    parser = argparse.ArgumentParser(prog="memlab bench profiler", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="timed repeats per variant (median)")
    parser.add_argument("--batch-size", type=int, default=8, help="TinyGPT batch size")
    parser.add_argument("--seq-len", type=int, default=128, help="TinyGPT sequence length")
    parser.add_argument("--model", default="llama-2-70b", help="preset for the estimator timing")
    parser.add_argument("--estimate-seq-len", type=int, default=4096)
    parser.add_argument("--suggest-model", default="llama-2-7b", help="preset for the estimate-with-suggestions timing")
    parser.add_argument("--skip-estimate", action="store_true")
    args = parser.parse_args(list(argv or []))

    ok = True
    rows = _tracker_overhead(args.repeat, args.batch_size, args.seq_len)
    print(table(
        f"Tracker overhead: TinyGPT training step (batch {args.batch_size} x seq {args.seq_len}, AdamW), "
        f"median of {args.repeat}",
        ("variant", "ms / step", "x untracked"), rows, device="cpu",
    ))
    ratio = rows[1][2]
    passed = ratio < OVERHEAD_TARGET
    ok &= passed
    print(f"\n{'PASS' if passed else 'FAIL'}: MemoryTracker overhead {ratio:.2f}x (target < {OVERHEAD_TARGET:g}x)\n")

    if not args.skip_estimate:
        r = _estimator_cost(args.model, args.estimate_seq_len, 1, "bf16", "adamw")
        print(table(
            f"Estimator: {args.model}, batch 1 x seq {args.estimate_seq_len}, bf16, AdamW "
            f"(fresh subprocess, fake tensors)",
            ("quantity", "value"),
            [("parameters", f"{r['n_params'] / 1e9:.2f} B"),
             ("estimated peak (GiB)", r["peak_bytes"] / GiB),
             ("import memlab.estimate (s)", r["import_s"]),
             ("estimate (s)", r["estimate_s"]),
             ("process wall time (s)", r["wall_s"]),
             ("peak RSS (GB)", r["maxrss_bytes"] / GB)],
            device="cpu",
        ))
        t_ok = r["estimate_s"] < WALL_TARGET_S
        m_ok = r["maxrss_bytes"] < RSS_TARGET_BYTES
        ok &= t_ok and m_ok
        print(f"\n{'PASS' if t_ok else 'FAIL'}: {args.model} estimate {r['estimate_s']:.1f} s (target < {WALL_TARGET_S:g} s; "
              f"process {r['wall_s']:.1f} s with imports)")
        print(f"{'PASS' if m_ok else 'FAIL'}: estimator peak RSS {r['maxrss_bytes'] / GB:.2f} GB "
              f"(target < {RSS_TARGET_BYTES / GB:g} GB)")
        s = _estimator_cost(args.suggest_model, 2048, 1, "bf16", "adamw", suggest=True)
        print()
        print(table(
            f"Estimator with suggestions: {args.suggest_model}, batch 1 x 2048, bf16, AdamW, "
            f"the base estimate and all {s['n_suggestions']} what-ifs (fresh subprocess)",
            ("quantity", "value"),
            [("estimated peak (GiB)", s["peak_bytes"] / GiB),
             ("traced at depths", ", ".join(map(str, s["extrapolated"])) or "all layers"),
             ("estimate + suggestions (s)", s["estimate_s"]),
             ("process wall time (s)", s["wall_s"])],
            device="cpu",
        ))
        s_ok = s["estimate_s"] < SUGGEST_TARGET_S
        ok &= s_ok
        print(f"\n{'PASS' if s_ok else 'FAIL'}: {args.suggest_model} estimate with all suggestions {s['estimate_s']:.1f} s "
              f"(target < {SUGGEST_TARGET_S:g} s; process {s['wall_s']:.1f} s with imports)")
    print(f"\nhost: {device_name('cpu')}")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
