"""``memlab bench offload``: the CPU AdamW step and CPU-offloaded training, from scratch vs production.

Two tables, each measured in one run:

* **CPU step throughput** (any machine): memlab's flat step (:func:`memlab.offload.adamw_step_flat_`,
  the C++/OpenMP kernel or its eager fallback: the table names which ran) against
  ``torch.optim.AdamW`` for-loop (``foreach=False``), ``foreach=True`` and ``fused=True``, in
  parameters per second and as a share of this machine's copy bandwidth **at the step's own
  working-set size**. AdamW reads p, g, m, v and writes p, m, v: 28 bytes per parameter, so the
  step is memory-bound and a streaming copy over the same bytes is its roofline. The copy measured
  is the in-place ``a += b`` (12 bytes per element read + written) over two arrays of ``2n``
  floats: the same 16 bytes per parameter of memory as the step's four ``n``-float buffers, so both
  run from the same level of the memory hierarchy (a 1M-parameter step fits in cache; a 128 MiB
  copy does not). A plain ``dst.copy_(src)`` is shown too;
  it moves fewer bytes per second than it counts, because writing ``dst`` first reads each cache
  line in (write-allocate).
* **Offloaded training** (CUDA only): step time and peak device memory of a >= 300M-parameter
  TinyGPT, one change at a time: on-device fused AdamW with pure bf16 weights (the baseline: the
  same weights and gradients as the offloaded runs, the optimizer on the device), on-device fused
  AdamW with fp32 weights and bf16 autocast (16 bytes/param, for reference), and
  :class:`memlab.offload.OffloadedAdamW` (bf16 weights on the device, fp32 master and moments on
  the host) with the update after backward, with the update during backward
  (``step_in_backward=True``), with the one-step delayed update (``delay_update=True``: another
  trajectory, timed here, not equal) and with offloaded gradients; torchao's ``CPUOffloadOptimizer``
  when it is importable (it needs CUDA or XPU).

* **Chapter 04's chunked eager step by thread count** (any machine): the eager fallback at one
  torch thread and at one per core, interleaved.

Targets (issues 12, 22, 42), as ``TARGET MET`` / ``TARGET MISSED`` lines (exit 1 on a miss with
``--strict``): CPU fast step >= 0.9x torch's fused CPU AdamW and >= 60% of the copy bandwidth at
the same working set; the chunked eager step at one thread per core >= its 1-thread speed; on a
GPU, step time <= 1.15x the on-device pure-bf16 step with >= 45% less peak device memory.
"""
from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from memlab.bench import add_strict, interleaved_medians, progress, report_targets, sync, table, time_median
from memlab.core.units import GiB, MiB, parse_size
from memlab.core.validation import check_choice, check_positive_int, invalid

BYTES_PER_PARAM = 28  # AdamW in fp32: read p, g, m, v (16) + write p, m, v (12)


def copy_bandwidth(n: int = 32 * MiB, repeat: int = 7, kind: str = "a += b") -> float:
    """Bytes per second read + written on float32 CPU tensors of ``n`` elements (128 MiB each by default).

    Args:
        repeat: timed repetitions (the median is kept).
        kind: ``"a += b"`` (in place, 12 bytes per element) or ``"copy"`` (``dst.copy_(src)``, 8 bytes counted).

    Raises:
        ValueError: an unknown ``kind``.
    """
    check_choice("kind", kind, ("a += b", "copy"))
    a, b = torch.randn(n), torch.randn(n)
    if kind == "copy":
        t = time_median(lambda: b.copy_(a), repeat=repeat, warmup=2, device="cpu")
        return 8 * n / t
    t = time_median(lambda: a.add_(b), repeat=repeat, warmup=2, device="cpu")
    return 12 * n / t


def parse_count(text: str, *, name: str = "--sizes") -> int:
    """A number of parameters such as ``"10M"`` (10**6 each: K, M, G as in :func:`memlab.core.parse_size`):
    an int, a float with an exponent, or with a suffix K, M or G (1M = 1,000,000); an int >= 1. ``name`` is the
    argument's name in the error message.

    Raises:
        ValueError: not a count, or a byte unit (``B``, ``MiB``, ...: these are parameters, not bytes;
            "1B" would read as one byte, not a billion).
    """
    allowed = "a number of parameters, e.g. 1M, 10M, 100M, 2500000 (K, M, G = 10**3, 10**6, 10**9)"
    if str(text).strip()[-1:].lower() == "b":
        raise invalid(name, text, allowed)
    try:
        n = parse_size(text, name=name)
    except ValueError:
        raise invalid(name, text, allowed) from None
    if n < 1:  # "0.2" rounds to no parameter at all
        raise invalid(name, text, allowed)
    return n


def cpu_step_rows(sizes: list[int], repeat: int = 5, n_tensors: int = 8) -> tuple[list[list[Any]], dict[str, Any]]:
    """Time memlab's flat step and torch's three AdamW implementations at each size (parameter counts).

    Args:
        repeat: timed repetitions per measurement (medians).
        n_tensors: how many tensors torch's optimizers get (memlab's step runs on one flat buffer).

    Returns:
        The table's rows, and a summary (the kernel's name; per size the copy bandwidths and the
        ratios the targets compare).
    """
    from memlab import offload

    kernel = offload.kernel_name()
    rows: list[list[Any]] = []
    summary: dict[str, Any] = {"kernel": kernel, "sizes": {}}
    for n in sizes:
        res: dict[str, float] = {}
        summary["sizes"][n] = {"plain_copy_bw": copy_bandwidth(2 * n, repeat=repeat, kind="copy")}
        gen = torch.Generator().manual_seed(0)
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = torch.zeros(n), torch.zeros(n)
        state = {"step": 0}

        def fast() -> None:
            state["step"] += 1
            offload.adamw_step_flat_(p, g, m, v, state["step"], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)

        def torch_adamw(**kw: Any) -> torch.optim.Optimizer:
            params = [torch.nn.Parameter(t) for t in torch.randn(n, generator=gen).chunk(n_tensors)]
            for q in params:
                q.grad = torch.randn(q.shape, generator=gen)
            return torch.optim.AdamW(params, lr=1e-3, **kw)

        # the two fast steps and the copy that is their roofline, in turns, round by round: a busy moment
        # of a shared machine hits all three alike
        fused_opt = torch_adamw(fused=True)
        a, b = torch.randn(2 * n, generator=gen), torch.randn(2 * n, generator=gen)  # the step's 16 bytes/param
        med = interleaved_medians({"fast": fast, "fused": fused_opt.step, "copy": lambda: a.add_(b)}, repeat, "cpu",
                                  warmup=1)
        bw = 12 * 2 * n / med["copy"]
        summary["sizes"][n]["copy_bw"] = bw
        res["memlab flat step"] = med["fast"]
        del p, g, m, v, fused_opt, a, b
        gc.collect()
        for label, kw in (("torch AdamW for-loop", dict(foreach=False)), ("torch AdamW foreach", dict(foreach=True))):
            opt = torch_adamw(**kw)
            res[label] = time_median(opt.step, repeat=max(2, repeat // 2), warmup=1, device="cpu")
            del opt
            gc.collect()
        res["torch AdamW fused"] = med["fused"]
        fused = res["torch AdamW fused"]
        for label, t in res.items():
            gps = n / t
            rows.append([f"{label}" + (f" [{kernel}]" if label.startswith("memlab") else ""), n, t * 1e3, gps / 1e9,
                         gps * BYTES_PER_PARAM / GiB, gps * BYTES_PER_PARAM / bw, fused / t])
        summary["sizes"][n].update({"vs_fused": fused / res["memlab flat step"],
                                    "of_bw": n / res["memlab flat step"] * BYTES_PER_PARAM / bw})
    return rows, summary


def chunked_step_threads(n: int, repeat: int = 5, threads: tuple[int, ...] | None = None) -> dict[int, float]:
    """Median seconds of the eager chunked AdamW step (:func:`memlab.offload.adamw_step_eager_chunked_`,
    chapter 04's chunked step) on ``n`` parameters at each torch thread count of ``threads`` (default 1 and
    the core count): the rounds of :func:`memlab.bench.speed.chunked_adamw_rounds` (the same work for every
    count, the order flipped each round, the thread count set outside the clock), the one helper both benches
    use; the caller's thread count is restored."""
    import os

    from memlab.bench.speed import chunked_adamw_rounds

    threads = threads or tuple(sorted({1, os.cpu_count() or 1}))
    return {k: seconds for k, (seconds, _cores) in chunked_adamw_rounds(n, repeat, threads).items()}


# ----------------------------------------------------------------------------- GPU: offloaded training
def _gpt(n_layer: int, n_embd: int, seq: int, dtype: torch.dtype) -> torch.nn.Module:
    from memlab.models import TinyGPT, TinyGPTConfig

    torch.manual_seed(0)
    cfg = TinyGPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64), block_size=seq, attention="sdpa")
    return TinyGPT(cfg).to("cuda", dtype)


def gpu_recipe(recipe: str, *, n_layer: int, n_embd: int, batch: int, seq: int, accum: int, repeat: int) -> dict[str, Any]:
    """Step time (median of ``repeat``) and peak device memory of one recipe (of :data:`GPU_RECIPES`) on a
    TinyGPT of ``n_layer`` x ``n_embd``, micro-batches ``batch`` x ``seq``, ``accum`` per optimizer step (CUDA).

    Returns:
        ``{"params", "peak", "seconds"}``, or ``{"skipped": why}``.

    Raises:
        ValueError: an unknown recipe.
    """
    from memlab.models import lm_loss
    from memlab.offload import OffloadedAdamW

    check_choice("recipe", recipe, GPU_RECIPES)
    autocast = recipe == "on-device fused AdamW, fp32 weights + bf16 autocast"
    model = _gpt(n_layer, n_embd, seq, torch.float32 if autocast else torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    if recipe.startswith("on-device"):
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif recipe.startswith("memlab"):
        opt = OffloadedAdamW(model.parameters(), lr=1e-4, offload_gradients="offload grads" in recipe,
                             accumulation_steps=accum, step_in_backward="in backward" in recipe,
                             delay_update="delayed" in recipe)
    else:
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError as exc:
            del model
            return {"skipped": f"torchao not importable ({exc.__class__.__name__})"}
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients="offload grads" in recipe,
                                  fused=True, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (batch, seq), generator=gen).cuda() for _ in range(2)]

    def step() -> None:
        for k in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = lm_loss(model, xs[k % 2], xs[(k + 1) % 2]) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # states exist
    sync("cuda")
    torch.cuda.reset_peak_memory_stats()
    step()
    sync("cuda")
    peak = torch.cuda.max_memory_allocated()
    seconds = time_median(step, repeat=repeat, warmup=0, device="cuda")
    out = {"params": n_params, "peak": peak, "seconds": seconds}
    del model, opt, xs
    gc.collect()
    torch.cuda.empty_cache()
    return out


BASELINE = "on-device fused AdamW, pure bf16"
GPU_RECIPES = (BASELINE, "on-device fused AdamW, fp32 weights + bf16 autocast", "memlab OffloadedAdamW",
               "memlab OffloadedAdamW, step in backward", "memlab OffloadedAdamW, delayed update",
               "memlab OffloadedAdamW + offload grads",
               "torchao CPUOffloadOptimizer", "torchao CPUOffloadOptimizer + offload grads")


def main(argv: list[str] | None = None) -> int:
    """Print the CPU tables and, on CUDA, the offloaded-training table, then the targets; exit code 0, or 1 with
    ``--strict`` when a target is missed."""
    from memlab.config import DEVICE, pick

    ap = argparse.ArgumentParser(prog="memlab bench offload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="CPU step sizes in parameters, comma-separated (default: 10M,100M; 1M,10M when small)")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions, median reported")
    ap.add_argument("--no-gpu", action="store_true", help="only the CPU step table")
    ap.add_argument("--no-cpu", action="store_true", help="only the offloaded-training table (CUDA): a short GPU "
                    "lease spends nothing on the CPU tables")
    ap.add_argument("--layers", type=int, default=24, help="GPU model: TinyGPT layers (24 x 1024 wide: 302M params)")
    ap.add_argument("--width", type=int, default=1024, help="GPU model: n_embd")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--accum", type=int, default=16, help="micro-batches per optimizer step")
    add_strict(ap)
    args = ap.parse_args(argv)
    try:
        sizes = [parse_count(s) for s in (args.sizes or pick(full="10M,100M", small="1M,10M")).split(",")]
        for name, v in (("--repeat", args.repeat), ("--layers", args.layers), ("--width", args.width),
                        ("--batch-size", args.batch_size), ("--seq-len", args.seq_len), ("--accum", args.accum)):
            check_positive_int(name, v)
        if args.no_cpu and (args.no_gpu or DEVICE.type != "cuda"):
            raise ValueError(f"--no-cpu with {'--no-gpu' if args.no_gpu else 'no CUDA device'} leaves nothing to run; "
                             f"allowed: --no-cpu on a CUDA machine, without --no-gpu")
    except ValueError as exc:
        ap.error(str(exc))
    checks: list[tuple[str, float | None, bool]] = [] if args.no_cpu else _cpu_tables(sizes, args.repeat)
    if args.no_gpu or DEVICE.type != "cuda":
        if not args.no_gpu:
            print("offloaded training: needs CUDA: skipped on cpu (host == device, nothing to offload)")
        return report_targets(checks, "cpu", strict=args.strict)
    kw = dict(n_layer=args.layers, n_embd=args.width, batch=args.batch_size, seq=args.seq_len, accum=args.accum, repeat=args.repeat)
    results = {}
    for r in GPU_RECIPES:
        results[r] = res = gpu_recipe(r, **kw)
        progress(f"bench offload {r}: " + (res["skipped"] if "skipped" in res else
                                            f"{res['seconds']:.3f} s/step, peak {res['peak']:,} B"))
    _gpu_table(results, args, checks)
    return report_targets(checks, DEVICE, strict=args.strict)


def _cpu_tables(sizes: list[int], repeat: int) -> list[tuple[str, float | None, bool]]:
    # the CPU step table and the chunked step by thread count, printed; their targets
    rows, summary = cpu_step_rows(sizes, repeat=repeat)
    header = ["CPU AdamW step", "params", "ms", "Gparam/s", "GiB/s (28 B/param)", "of copy bw", "speed vs fused"]
    bws = "; ".join(f"{n:,}: {s['copy_bw'] / GiB:.1f} GiB/s (dst.copy_(src) {s['plain_copy_bw'] / GiB:.1f})"
                    for n, s in summary["sizes"].items())
    print(table(f"memlab bench offload: CPU step; copy bandwidth at each step's working set (a += b over 2n floats) {bws}",
                header, rows, "cpu"))
    print(f"fast step ran: {summary['kernel']}")
    checks: list[tuple[str, float | None, bool]] = []
    for n, sz in summary["sizes"].items():
        checks.append((f"fast step >= 0.9x torch fused AdamW at {n:,} params (shown: speed ratio)", sz["vs_fused"],
                       sz["vs_fused"] >= 0.9))
        checks.append((f"fast step >= 60% of the copy bandwidth at {n:,} params (shown: share)", sz["of_bw"],
                       sz["of_bw"] >= 0.6))
    chunk_n = sizes[0]
    rates = chunked_step_threads(chunk_n, repeat=repeat)
    one = rates[min(rates)]
    print()
    print(table(f"memlab bench offload: chapter 04's chunked eager AdamW step, {chunk_n:,} params, by torch "
                f"thread count (medians of {repeat} interleaved rounds)", ["threads", "ms", "Mparam/s", "vs 1 thread"],
                [[k, t * 1e3, chunk_n / t / 1e6, one / t] for k, t in rates.items()], "cpu"))
    for k, t in rates.items():
        if k > 1:
            checks.append((f"chunked eager step at {k} threads >= its 1-thread speed (shown: speed ratio)", one / t,
                           one / t >= 1.0))
    print()
    return checks


def _gpu_table(results: dict[str, dict[str, Any]], args: Any, checks: list[tuple[str, float | None, bool]]) -> None:
    # the offloaded-training table (CUDA) and its targets, appended to ``checks``
    from memlab.config import DEVICE

    base = results[BASELINE]
    grows = []
    for r, res in results.items():
        if "skipped" in res:
            grows.append([r, "-", "-", "-", "-", res["skipped"]])
            continue
        note = ("torchao documents offload_gradients as incompatible with accumulation: the earlier micro-batches' "
                "gradients are overwritten" if r == "torchao CPUOffloadOptimizer + offload grads" and args.accum > 1 else "")
        grows.append([r, res["seconds"], res["seconds"] / base["seconds"], res["peak"] / GiB,
                      f"{1 - res['peak'] / base['peak']:.0%}", note])
    print(table(f"memlab bench offload: TinyGPT {base['params'] / 1e6:.0f}M params, {args.accum} micro-batches of "
                f"{args.batch_size} x {args.seq_len} per step (bf16 compute)",
                ["recipe", "step (s)", "time vs pure-bf16 on-device", "peak device (GiB)", "less device memory", "note"], grows, DEVICE))
    for r in ("memlab OffloadedAdamW", "memlab OffloadedAdamW, step in backward", "memlab OffloadedAdamW, delayed update",
              "memlab OffloadedAdamW + offload grads"):
        res = results[r]
        t, mem = res["seconds"] / base["seconds"], 1 - res["peak"] / base["peak"]
        checks.append((f"{r}: step time <= 1.15x the on-device pure-bf16 step (shown: time ratio)", t, t <= 1.15))
        checks.append((f"{r}: >= 45% less peak device memory (shown: share saved)", mem, mem >= 0.45))
