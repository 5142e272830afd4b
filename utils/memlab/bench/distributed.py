"""``memlab bench distributed``: per-rank peak memory and step time of ZeRO stages 0-3 on 2 ranks.

One launch (:func:`memlab.distributed.launch`, gloo on CPU) trains the tiny Llama under stage 0
(data parallelism: each gradient all-reduced, a full AdamW per rank), stages 1 and 2 (memlab's
from-scratch :class:`memlab.distributed.ZeroOptimizer`) and stage 3 (PyTorch FSDP2,
``fully_shard`` per decoder layer and root), and reports, per rank, the tracked peak of the last
step (:func:`memlab.distributed.rank_tracker`), the parameters / gradients / optimizer bytes held
after it, the median step time, and each against stage 0. The estimate of
``memlab estimate --world-size N --zero-stage S`` is printed next to the measured peak.

On GPUs, run the same stages under torchrun with NCCL (not measured by this command).

Targets: per rank, ZeRO-1's optimizer state and ZeRO-2's gradients are 1/N of stage 0's (+ padding),
FSDP2's parameters about 1/N; every stage's losses equal stage 0's bit for bit.
"""
from __future__ import annotations

import argparse
from typing import Any

from memlab.bench import add_strict, report_targets, table
from memlab.core.units import format_bytes
from memlab.core.validation import check_int, check_positive_int

NAMES = {0: "stage 0: data parallel (all-reduce)", 1: "stage 1: memlab ZeroOptimizer", 2: "stage 2: memlab ZeroOptimizer",
         3: "stage 3: PyTorch FSDP2"}


def _ranks(rank: int, world_size: int, steps: int, batch_size: int, seq_len: int, layers: int) -> list[dict[str, Any]]:
    # One rank's :func:`memlab.distributed.train_rank` under every stage, in one launch (a fork each costs).
    from memlab.distributed import STAGES, train_rank

    kw = dict(steps=steps, batch_size=batch_size * world_size, seq_len=seq_len, model_kwargs={"num_hidden_layers": layers})
    return [train_rank(rank, world_size, s, **kw) for s in STAGES]


def main(argv: list[str] | None = None) -> int:
    """``memlab bench distributed``: a table of every stage on every rank, then the targets; exit code 0, or 1
    with ``--strict`` when a target is missed.
    """
    from memlab.config import pick
    from memlab.distributed import STAGES, launch
    from memlab.estimate import estimate_training_memory
    from memlab.models import tiny_llama_config

    ap = argparse.ArgumentParser(prog="memlab bench distributed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2, help="ranks (processes, gloo on CPU)")
    ap.add_argument("--steps", type=int, default=None, help="steps per stage: the first warms up, the last is tracked, "
                                                           "the median of the others is the step time (default 7; 5 when small)")
    ap.add_argument("--batch-size", type=int, default=2, help="batch per rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny Llama")
    add_strict(ap)
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else pick(full=7, small=5)
    try:  # argparse's usage line, then the one memlab error format
        for name, v in (("--world-size", args.world_size), ("--batch-size", args.batch_size),
                        ("--seq-len", args.seq_len), ("--layers", args.layers)):
            check_positive_int(name, v)
        # the last step is tracked once the optimizer state exists: a step before it
        check_int("--steps", steps, minimum=2)
    except ValueError as exc:
        ap.error(str(exc))
    if steps < 3:
        print(f"note: --steps={steps}: the step time is the first (warm-up) step's")

    ranks = launch(_ranks, args.world_size, steps, args.batch_size, args.seq_len, args.layers, timeout=600)
    cfg = tiny_llama_config(num_hidden_layers=args.layers)
    est = {s: estimate_training_memory(cfg, batch_size=args.batch_size, seq_len=args.seq_len, dtype="fp32",
                                       optimizer="adamw", device="cpu", loss="memlab", extrapolate=False,
                                       world_size=args.world_size, zero_stage=s) for s in STAGES}
    base = ranks[0][0]
    rows = []
    for s in STAGES:
        for r in range(args.world_size):
            m = ranks[r][s]
            b = m["bytes"]
            rows.append([NAMES[s] if r == 0 else "", r, format_bytes(m["peak_bytes"]), f"{m['peak_bytes'] / base['peak_bytes']:.2f}",
                         format_bytes(est[s].peak_bytes) if r == 0 else "", format_bytes(b["parameters"]),
                         format_bytes(b["gradients"]), format_bytes(b["optimizer"]), f"{1000 * m['step_seconds']:.1f}",
                         f"{m['step_seconds'] / ranks[r][0]['step_seconds']:.2f}",
                         format_bytes(sum(m["comm_bytes"].values()))])
    print(table(f"memlab bench distributed: tiny Llama ({base['n_params'] / 1e6:.2f}M params, {args.layers} layers, fp32 "
                f"AdamW), {args.world_size} ranks (gloo), batch {args.batch_size} x {args.seq_len} per rank, "
                f"step time: median of steps 2-{steps - 1} of {steps}",
                ["stage", "rank", "peak", "vs stage 0", "estimate", "params held", "grads held", "optimizer held",
                 "step ms", "time vs stage 0", "sent/step"], rows, "cpu"))
    print("peak: MemoryTracker on each rank over the last step; held: after optimizer.step() and zero_grad() "
          "(stage 0 and FSDP2 free their gradients there, stages 1-2 keep their buffers); sent/step: bytes this "
          "rank sent in the last step's collectives, ring cost (memlab.distributed.CommCounter)")
    n = args.world_size
    b0 = ranks[0][0]["bytes"]
    checks = []
    for r in range(n):
        z1, z2, f3 = ranks[r][1]["bytes"], ranks[r][2]["bytes"], ranks[r][3]["bytes"]
        ratio1 = z1["optimizer"] / b0["optimizer"]
        checks.append((f"rank {r}: ZeRO-1 optimizer state ~1/{n} of stage 0's", ratio1, abs(ratio1 - 1 / n) < 0.01))
        ratio2 = z2["gradients"] / z1["gradients"]
        checks.append((f"rank {r}: ZeRO-2 gradients ~1/{n} of ZeRO-1's", ratio2, abs(ratio2 - 1 / n) < 0.01))
        ratio3 = f3["parameters"] / b0["parameters"]
        checks.append((f"rank {r}: FSDP2 parameters ~1/{n} of stage 0's", ratio3, abs(ratio3 - 1 / n) < 0.02))
        same = all(ranks[r][s]["losses"] == ranks[r][0]["losses"] for s in STAGES)
        checks.append((f"rank {r}: losses of stages 1-3 equal stage 0's bit for bit", float(same), same))
    return report_targets(checks, "cpu", strict=args.strict)
