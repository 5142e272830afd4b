"""``memlab bench speed``: issue 42's speed figures in one run, each a ratio measured in turns.

Every comparison times its variants interleaved round by round (:func:`memlab.bench.interleaved_medians`,
medians), so a busy moment of a shared machine slows both sides of a ratio alike:

1. **tracker overhead**: a TinyGPT and a tiny Llama training step (batch 8 x 128, AdamW, one torch
   thread) under :class:`memlab.profiler.MemoryTracker` (its default, with the timeline, and
   ``timeline=False``) against the untracked step; target <= 1.2x
   (:func:`memlab.bench.profiler.tracker_overhead`);
2. **chunked CPU AdamW by threads**: chapter 04's eager chunked step
   (:func:`memlab.offload.adamw_step_eager_chunked_`) at one torch thread per core against one
   thread, in rounds whose order flips each time, with the cores the step got (CPU time / wall time);
   target >= 1x (:func:`chunked_adamw_rounds`);
3. **flash attention vs SDPA**: :func:`memlab.attention.flash_attention` (PyTorch, FA2) causal
   forward + backward against ``F.scaled_dot_product_attention``'s flash backend, batch 1, 4 heads
   of 64, fp32, at seq 512-2048; target >= 0.5x SDPA's speed;
4. **NF4 dequantize vs bitsandbytes**: :func:`memlab.quant.dequantize_nf4` against
   ``bitsandbytes.functional.dequantize_4bit``, a 1024 x 1024 fp32 and bf16 matrix, blocksize 64;
   target >= 0.5x (:func:`memlab.bench.qlora.nf4_dequantize_ratio`).

The process wall times of ``memlab estimate`` and ``memlab plan`` are ``memlab bench estimate`` and
``memlab bench plan``'s. ``--tiny`` runs every figure at toy sizes (the format, not the figures: the
tests use it). Targets are printed as ``TARGET MET`` / ``TARGET MISSED`` lines; ``--strict`` makes a
miss exit 1.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from memlab.bench import add_strict, interleaved_medians, report_targets, table

FIGURES = ("tracker", "adamw", "flash", "nf4")
TRACKER_TARGET = 1.2  # tracked / untracked step time, at most
THREADS_TARGET = 1.0  # chunked step at one thread per core / at one thread, speed, at least
FLASH_TARGET = 0.5  # flash / SDPA speed, at least
NF4_TARGET = 0.5  # memlab / bitsandbytes dequantize speed, at least


def _sizes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return dict(batch=2, seq=16, adamw_n=50_000, seqs=(64, 128), nf4=64)
    return dict(batch=8, seq=128, adamw_n=6_000_000, seqs=(512, 1024, 2048), nf4=1024)


def tracker_figure(repeat: int, batch: int, seq: int) -> tuple[list[list[Any]], list[tuple[str, float, bool]]]:
    """Rows and targets of the tracker overhead on TinyGPT and the tiny Llama."""
    from memlab.bench.profiler import MODELS, tracker_overhead

    rows, checks = [], []
    for name in MODELS:
        med = tracker_overhead(name, repeat, batch, seq, torch_reference=False)
        base = med["untracked"]
        for k in ("memlab MemoryTracker", "memlab MemoryTracker(timeline=False)"):
            r = med[k] / base
            rows.append([f"{name}: {k}", med[k] * 1e3, base * 1e3, r])
            checks.append((f"{k} overhead on the {name} step (batch {batch} x {seq}, 1 thread) <= {TRACKER_TARGET:g}x "
                           f"(shown: tracked / untracked time)", r, r <= TRACKER_TARGET))
    return rows, checks


def chunked_adamw_rounds(n: int, repeat: int, threads: tuple[int, ...]) -> dict[int, tuple[float, float]]:
    """Median seconds and median cores used (the process's CPU time over the wall time) of chapter 04's eager
    chunked AdamW step on ``n`` parameters at each torch thread count of ``threads``.

    Every count steps the same buffers with the same step number (the same work). One untimed round, then
    ``repeat`` rounds that call each count once, in an order that flips every round, so a load that comes
    and goes hits every count alike; the thread count is set before the clock starts and the caller's is
    restored after each call.
    """
    import statistics
    import time

    from memlab import offload

    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
    before = torch.get_num_threads()
    samples: dict[int, list[tuple[float, float]]] = {k: [] for k in threads}
    for r in range(repeat + 1):
        for k in threads if r % 2 else threads[::-1]:
            torch.set_num_threads(k)
            try:
                cpu, t0 = time.process_time(), time.perf_counter()
                offload.adamw_step_eager_chunked_(*bufs, 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                                  weight_decay=1e-2)
                wall = time.perf_counter() - t0
                cpu = time.process_time() - cpu
            finally:
                torch.set_num_threads(before)
            if r:
                samples[k].append((wall, cpu / wall))
    return {k: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s)) for k, s in samples.items()}


def adamw_figure(repeat: int, n: int) -> tuple[list[list[Any]], list[tuple[str, float, bool]]]:
    """Rows and targets of the eager chunked AdamW step at one thread per core against one thread; each
    verdict says how many cores the step got at that count (about 1: another process held the others)."""
    import os

    from memlab.offload.kernel import MIN_PER_WORKER

    med = chunked_adamw_rounds(n, repeat, tuple(sorted({1, os.cpu_count() or 1})))
    one = med[1][0]
    rows = [[f"chunked eager AdamW, {k} thread(s)", t * 1e3, one * 1e3, one / t] for k, (t, _) in med.items()]
    checks = []
    for k, (t, cores) in med.items():
        if k > 1:
            workers = min(k, n // MIN_PER_WORKER)
            note = (f"; one worker at this size (under {2 * MIN_PER_WORKER:,} params)" if workers < 2 else
                    ": no second core was free" if cores < 1.25 else "")
            checks.append((f"chunked eager AdamW step ({n:,} params) at {k} threads >= {THREADS_TARGET:g}x its "
                           f"1-thread speed (shown: speed ratio; it used {cores:.2f} cores{note})",
                           one / t, one / t >= THREADS_TARGET))
    return rows, checks


def flash_figure(repeat: int, seqs: tuple[int, ...]) -> tuple[list[list[Any]], list[tuple[str, float, bool]]]:
    """Rows and targets of memlab's PyTorch flash attention against SDPA's flash backend, causal fwd+bwd."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memlab.attention import flash_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows, checks = [], []
    for s in seqs:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(1, 4, s, 64, generator=g).requires_grad_() for _ in range(3))
        do = torch.randn(1, 4, s, 64, generator=g)

        def step(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(do)
            return run

        med = interleaved_medians({"flash": step(lambda a, b, c: flash_attention(a, b, c, causal=True)),
                                   "sdpa": step(sdpa)}, repeat, "cpu", warmup=1)
        r = med["sdpa"] / med["flash"]
        rows.append([f"flash attention fwd+bwd, seq {s}", med["flash"] * 1e3, med["sdpa"] * 1e3, r])
        checks.append((f"flash attention (PyTorch) fwd+bwd >= {FLASH_TARGET:g}x SDPA's speed at seq {s} "
                       f"(shown: speed ratio)", r, r >= FLASH_TARGET))
    return rows, checks


def nf4_figure(repeat: int, size: int) -> tuple[list[list[Any]], list[tuple[str, float, bool]]]:
    """Rows and targets of memlab's NF4 dequantize against bitsandbytes' (no rows without bitsandbytes)."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        print("NF4 vs bitsandbytes: bitsandbytes is not installed: skipped")
        return [], []
    from memlab.bench.qlora import nf4_dequantize_ratio

    rows, checks = [], []
    for dtype in (torch.float32, torch.bfloat16):
        ours, ref = nf4_dequantize_ratio(size, dtype, repeat)
        name = str(dtype).replace("torch.", "")
        rows.append([f"NF4 dequantize {size}x{size} {name}", ours * 1e3, ref * 1e3, ref / ours])
        checks.append((f"NF4 dequantize {size}x{size} {name} >= {NF4_TARGET:g}x bitsandbytes' speed "
                       f"(shown: speed ratio)",
                       ref / ours, ref / ours >= NF4_TARGET))
    return rows, checks


def _load() -> str:
    # the 1-minute load average against the core count: a ratio measured on a busy machine says so
    import os

    try:
        return f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores"
    except OSError:  # pragma: no cover - no getloadavg on this platform
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Run the figures and print one table and the targets; exit code 0, or 1 with ``--strict`` when a
    target is missed (2 for bad arguments)."""
    ap = argparse.ArgumentParser(prog="memlab bench speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=11, help="interleaved rounds per comparison (median)")
    ap.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated subset of {', '.join(FIGURES)}")
    ap.add_argument("--tiny", action="store_true", help="toy sizes: checks the output, not the figures")
    add_strict(ap)
    args = ap.parse_args(list(argv or []))
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    bad = [f for f in only if f not in FIGURES]
    if bad or not only or args.repeat < 1:
        ap.error(f"--only={args.only!r} / --repeat={args.repeat} is invalid; allowed: a subset of "
                 f"{', '.join(FIGURES)} and a repeat >= 1")
    z = _sizes(args.tiny)
    rows: list[list[Any]] = []
    checks: list[tuple[str, float | None, bool]] = []
    for name in only:
        if name == "tracker":
            r, c = tracker_figure(args.repeat, z["batch"], z["seq"])
        elif name == "adamw":
            r, c = adamw_figure(args.repeat, z["adamw_n"])
        elif name == "flash":
            r, c = flash_figure(args.repeat, z["seqs"])
        else:
            r, c = nf4_figure(args.repeat, z["nf4"])
        rows += r
        checks += c
    print(table(f"memlab bench speed: issue 42's figures, medians of {args.repeat} interleaved rounds"
                f"{' (--tiny: toy sizes)' if args.tiny else ''}",
                ["figure", "ours (ms)", "reference (ms)", "ratio"], rows, "cpu"))
    print("ratio: tracked / untracked time for the tracker; ours' speed / the reference's otherwise "
          "(references: the untracked step, the 1-thread step, SDPA's flash backend, bitsandbytes)")
    print(f"machine load: {_load()}")
    if "nf4" in only:
        from memlab.quant import nf4_kernel_name

        print(f"NF4 dequantize ran: {nf4_kernel_name()}")
    return report_targets(checks, "cpu", strict=args.strict)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
