"""``memlab bench profiler``: what the chapter 01 tools cost.

1. Tracker overhead: a TinyGPT and a tiny Llama training step (forward, backward, AdamW step)
   timed untracked, under :class:`memlab.profiler.MemoryTracker` (default, with its timeline, and
   ``timeline=False``), and under PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker``,
   interleaved round by round (medians of ``--repeat`` rounds), as ratios to the untracked step.
   Target (issue 42): MemoryTracker <= 1.2x on both.
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
from typing import Any, Callable

import torch

from memlab.bench import add_strict, device_name, interleaved_medians, report_targets, table
from memlab.core.units import GB, GiB

OVERHEAD_TARGET = 1.2
MODELS = ("tinygpt", "tiny_llama")
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


def tracker_steps(model_name: str, batch_size: int, seq_len: int, torch_reference: bool = True
                  ) -> dict[str, Callable[[], None]]:
    """One training step of ``model_name`` (``"tinygpt"`` or ``"tiny_llama"``, AdamW) as the calls to time:
    ``untracked``, ``memlab MemoryTracker``, ``memlab MemoryTracker(timeline=False)`` and (``torch_reference``) torch's
    ``MemTracker`` when this torch build has it; each tracked call enters a fresh tracker."""
    from memlab.models import TinyGPT, TinyGPTConfig, lm_loss, tiny_llama
    from memlab.profiler import MemoryTracker

    torch.manual_seed(0)
    if model_name == "tinygpt":
        model = TinyGPT(TinyGPTConfig(block_size=max(128, seq_len)))
    else:
        model = tiny_llama(max_position_embeddings=max(256, seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (batch_size, seq_len))
    y = torch.randint(0, 256, (batch_size, seq_len))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, x, y) if model_name == "tinygpt" else model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()

    def tracked(**kw: Any) -> Callable[[], None]:
        def run() -> None:
            with MemoryTracker(model, opt, **kw):
                step()
        return run

    fns: dict[str, Callable[[], None]] = {"untracked": step, "memlab MemoryTracker": tracked(),
                                          "memlab MemoryTracker(timeline=False)": tracked(timeline=False)}
    if torch_reference:
        try:
            from torch.distributed._tools.mem_tracker import MemTracker

            def torch_tracked() -> None:
                mt = MemTracker()
                mt.track_external(model, opt)
                with mt:
                    step()

            fns["torch MemTracker (reference)"] = torch_tracked
        except Exception:  # pragma: no cover - depends on the torch build
            pass
    return fns


def tracker_overhead(model_name: str, repeat: int, batch_size: int, seq_len: int, torch_reference: bool = True
                     ) -> dict[str, float]:
    """Median seconds of each of :func:`tracker_steps`' calls, interleaved over ``repeat`` rounds (after two
    warm-up rounds), at one torch thread (the caller's count restored)."""
    fns = tracker_steps(model_name, batch_size, seq_len, torch_reference)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return interleaved_medians(fns, repeat, "cpu", warmup=2)
    finally:
        torch.set_num_threads(threads)


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
    """Run the benchmark and print its tables and targets; exit code 0, or 1 with ``--strict`` when a target is
    missed."""
    parser = argparse.ArgumentParser(prog="memlab bench profiler", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=11, help="interleaved rounds per variant (median)")
    parser.add_argument("--batch-size", type=int, default=8, help="batch size of the tracked steps")
    parser.add_argument("--seq-len", type=int, default=128, help="sequence length of the tracked steps")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--model", default="llama-2-70b", help="preset for the estimator timing")
    parser.add_argument("--estimate-seq-len", type=int, default=4096)
    parser.add_argument("--suggest-model", default="llama-2-7b", help="preset for the estimate-with-suggestions timing")
    parser.add_argument("--skip-estimate", action="store_true")
    add_strict(parser)
    args = parser.parse_args(list(argv or []))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or args.repeat < 1:
        parser.error(f"--models={args.models!r} / --repeat={args.repeat} is invalid; allowed: a subset of "
                     f"{', '.join(MODELS)} and a repeat >= 1")

    checks: list[tuple[str, float | None, bool]] = []
    for name in models:
        med = tracker_overhead(name, args.repeat, args.batch_size, args.seq_len)
        base = med["untracked"]
        print(table(f"Tracker overhead: {name} training step (batch {args.batch_size} x seq {args.seq_len}, AdamW, "
                    f"1 torch thread), medians of {args.repeat} interleaved rounds",
                    ("variant", "ms / step", "x untracked"), [(k, t * 1e3, t / base) for k, t in med.items()],
                    device="cpu"))
        print()
        for k in ("memlab MemoryTracker", "memlab MemoryTracker(timeline=False)"):
            r = med[k] / base
            checks.append((f"{k} overhead on the {name} step <= {OVERHEAD_TARGET:g}x (shown: tracked / untracked)",
                           r, r <= OVERHEAD_TARGET))

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
        checks.append((f"{args.model} estimate < {WALL_TARGET_S:g} s (shown: seconds; process "
                       f"{r['wall_s']:.1f} s with imports)", r["estimate_s"], r["estimate_s"] < WALL_TARGET_S))
        checks.append((f"estimator peak RSS < {RSS_TARGET_BYTES / GB:g} GB (shown: GB)", r["maxrss_bytes"] / GB,
                       r["maxrss_bytes"] < RSS_TARGET_BYTES))
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
        checks.append((f"{args.suggest_model} estimate with all suggestions < {SUGGEST_TARGET_S:g} s (shown: seconds; "
                       f"process {s['wall_s']:.1f} s with imports)", s["estimate_s"],
                       s["estimate_s"] < SUGGEST_TARGET_S))
    return report_targets(checks, "cpu", strict=args.strict)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
