"""``memlab bench attention``: memlab.attention against F.scaled_dot_product_attention.

One forward + backward of causal attention, ``(batch, heads, seq, head_dim)``, for each sequence
length, by

* ``naive``: :func:`memlab.attention.naive_attention` (the whole score matrix);
* ``chunked``: :func:`memlab.attention.chunked_attention` (online softmax, through autograd);
* ``flash``: :func:`memlab.attention.flash_attention` (PyTorch, FA2 backward from the logsumexp);
* ``triton``: :func:`memlab.attention.triton_flash_attention` (CUDA only: on CPU the interpreter
  is far too slow to time);
* ``sdpa-math`` and ``sdpa-flash``: SDPA forced to its math and FlashAttention backends.

Time: median over ``--repeat`` interleaved rounds (every configuration once per round, so a busy
machine slows them alike), after a warm-up; CUDA synchronised before reading the clock. Memory: the
allocator's peak over one step whose inputs (q, k, v and the output gradient) are made inside the
measured window, so every implementation pays for the same inputs: on CPU rebuilt from the
allocator's events (``memlab.profiler.allocator_peak``: ``torch.profiler`` with
``profile_memory=True``, which also sees scratch a kernel allocates inside itself, such as SDPA's
CPU flash kernel's buffers), on CUDA ``torch.cuda.max_memory_allocated``. (A dispatch-mode tracker
is not used here: it cannot see kernel scratch, and under any Python dispatch mode autograd adds
the gradients of a tensor used several times out of place, which raises chunked's peak.) Ratios
are against ``sdpa-flash`` in the same run:
``speed`` = its time / ours (1 = as fast, higher is faster), ``mem`` = our peak / its peak. On a
GPU also TFLOP/s, counted as FlashAttention-2's benchmark does: forward 4*b*h*s^2*d, backward
2.5x the forward (the recomputation not counted), halved by the causal mask: 7*b*h*s^2*d.

Targets (issue 13), printed as TARGET MET / TARGET MISSED lines: flash (PyTorch) fwd+bwd >= 0.5x SDPA on CPU; on a
GPU, triton >= 0.7x SDPA's flash backend at seq 4096, bf16.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.nn.functional as F

from memlab.bench import add_strict, interleaved_medians, report_targets, sync, table
from memlab.core.validation import check_positive_int

IMPLS = ("naive", "chunked", "flash", "triton", "sdpa-math", "sdpa-flash")
REFERENCE = "sdpa-flash"
FULL_MATRIX = ("naive", "chunked", "sdpa-math")  # skipped above --max-naive-seq


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memlab bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=str, default=None,
                   help="comma-separated sequence lengths (default 256,512,1024,2048 on CPU; 1024,4096,16384 on GPU)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 4 on CPU, 16 on GPU)")
    p.add_argument("--head-dim", type=int, default=64, help="head_dim (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype (default float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--block", type=int, default=128, help="block / chunk size of chunked and flash (default 128)")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds (default 3 on CPU, 10 on GPU)")
    p.add_argument("--only", type=str, default=None, help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--max-naive-seq", type=int, default=None,
                   help="skip naive/chunked/sdpa-math above this length (default 4096 on GPU, none on CPU)")
    add_strict(p)
    return p


def _settings(argv: list[str] | None, on_gpu: bool) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    # parse and check the command line, fill the device's defaults: the parser (for later errors) and the
    # settings seqs, b, heads, d, dtype, blk, repeat, max_naive, only, strict
    p = _parser()
    args = p.parse_args(argv)
    try:
        seqs = [check_positive_int("--seqs", int(s)) for s in
                (args.seqs or ("1024,4096,16384" if on_gpu else "256,512,1024,2048")).split(",")]
        for name, v in (("--batch", args.batch), ("--heads", args.heads), ("--head-dim", args.head_dim),
                        ("--block", args.block), ("--repeat", args.repeat), ("--max-naive-seq", args.max_naive_seq)):
            if v is not None:
                check_positive_int(name, v)
    except ValueError as exc:
        p.error(str(exc))
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    if on_gpu and dtype == torch.float32:
        p.error("--dtype float32 on CUDA: SDPA's flash backend (the reference) needs float16 or bfloat16")
    return p, dict(seqs=seqs, b=args.batch, heads=args.heads or (16 if on_gpu else 4), d=args.head_dim, dtype=dtype,
                   blk=args.block, repeat=args.repeat or (10 if on_gpu else 3),
                   max_naive=args.max_naive_seq or (4096 if on_gpu else 1 << 30), only=args.only, strict=args.strict)


def _impls(blk: int, on_gpu: bool, only: str | None, p: argparse.ArgumentParser) -> tuple[dict[str, Callable], list[str]]:
    # The implementations to run, each ``fn(q, k, v) -> o`` (causal), and notes on those left out.
    from memlab import attention as att
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend: Any) -> Callable:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run

    impls: dict[str, Callable] = {
        "naive": lambda q, k, v: att.naive_attention(q, k, v, causal=True),
        "chunked": lambda q, k, v: att.chunked_attention(q, k, v, causal=True, q_chunk=blk, kv_chunk=blk),
        "flash": lambda q, k, v: att.flash_attention(q, k, v, causal=True, block_q=blk, block_k=blk),
        "triton": lambda q, k, v: att.triton_flash_attention(q, k, v, causal=True, block_q=64, block_k=64),
        "sdpa-math": sdpa(SDPBackend.MATH),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }
    notes = []
    if not on_gpu:
        impls.pop("triton")
        notes.append("triton: not timed on CPU (the interpreter runs kernels in Python; tests check it)")
    elif not att.triton_available():
        impls.pop("triton")
        notes.append("triton: not installed")
    if only:
        keep = set(only.split(","))
        unknown = keep - set(impls) - {"triton"}
        if unknown:
            p.error(f"--only={only}: unknown {sorted(unknown)}; allowed: {', '.join(impls)}")
        impls = {k: v for k, v in impls.items() if k in keep or k == REFERENCE}
    return impls, notes


def _peak(impl: Callable, q: torch.Tensor, do: torch.Tensor, on_gpu: bool) -> int:
    # Peak bytes of one forward + backward whose inputs are made inside the measured window.
    from memlab.config import DEVICE
    from memlab.profiler import allocator_peak

    def fresh() -> None:
        qq, kk, vv = (torch.randn_like(q).requires_grad_() for _ in range(3))
        impl(qq, kk, vv).backward(torch.randn_like(do))

    if not on_gpu:
        return allocator_peak(fresh)[0]
    sync(DEVICE)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fresh()
    sync(DEVICE)
    return torch.cuda.max_memory_allocated() - base


def _measure_seq(s: int, impls: dict[str, Callable], cfg: dict[str, Any], on_gpu: bool
                 ) -> tuple[dict[str, float], dict[str, int]]:
    # Median fwd+bwd time and peak bytes of each implementation at sequence length ``s``.
    from memlab.config import DEVICE

    b, heads, d, dtype = cfg["b"], cfg["heads"], cfg["d"], cfg["dtype"]
    q, k, v = (torch.randn(b, heads, s, d, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(b, heads, s, d, device=DEVICE, dtype=dtype)

    def step(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(do)
        return run

    fns = {name: step(fn) for name, fn in impls.items() if not (s > cfg["max_naive"] and name in FULL_MATRIX)}
    peaks = {}
    for name, fn in fns.items():
        fn()  # warm-up (and Triton compilation)
        q.grad = k.grad = v.grad = None
        peaks[name] = _peak(impls[name], q, do, on_gpu)
    return interleaved_medians(fns, cfg["repeat"], DEVICE), peaks


def _targets(seqs: list[int], results: dict[tuple[str, int], tuple[float, int, float]], on_gpu: bool,
             d: int, dtype: torch.dtype) -> list[tuple[str, float, bool]]:
    # The targets as ``(text, ratio, holds)``.
    checks = []
    if not on_gpu:
        for s in seqs:
            if ("flash", s) in results:
                t, _, tref = results[("flash", s)]
                checks.append((f"flash (PyTorch) fwd+bwd >= 0.5x SDPA flash backend at seq {s}", tref / t, tref / t >= 0.5))
    elif ("triton", 4096) in results:
        t, _, tref = results[("triton", 4096)]
        checks.append((f"triton fwd+bwd >= 0.7x SDPA flash backend at seq 4096, head_dim {d}, {dtype}", tref / t,
                       tref / t >= 0.7))
    for s in seqs:
        if ("flash", s) in results and ("flash", 2 * s) in results:
            r = results[("flash", 2 * s)][1] / results[("flash", s)][1]
            checks.append((f"flash peak grows <= 2.2x from seq {s} to {2 * s} (linear)", r, r <= 2.2))
    return checks


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table and targets; exit code 0, or 1 with ``--strict`` when a target is missed."""
    from memlab.config import DEVICE, seed_everything
    from memlab.core.units import format_bytes

    on_gpu = DEVICE.type == "cuda"
    p, cfg = _settings(argv, on_gpu)
    impls, notes = _impls(cfg["blk"], on_gpu, cfg["only"], p)
    b, heads, d, dtype, repeat = cfg["b"], cfg["heads"], cfg["d"], cfg["dtype"], cfg["repeat"]
    seed_everything(0)
    rows, results = [], {}
    for s in cfg["seqs"]:
        med, peaks = _measure_seq(s, impls, cfg, on_gpu)
        for name in med:
            row = [name, s, f"{med[name] * 1e3:.2f}", f"{med[REFERENCE] / med[name]:.2f}", format_bytes(peaks[name]),
                   f"{peaks[name] / peaks[REFERENCE]:.2f}"]
            if on_gpu:
                flops = 7 * b * heads * s * s * d  # FA2's count: (4 + 2.5 * 4) / 2 (causal) * b*h*s^2*d
                row += [f"{flops / med[name] / 1e12:.1f}"]
            rows.append(row)
            results[(name, s)] = (med[name], peaks[name], med[REFERENCE])
    header = ["impl", "seq", "fwd+bwd ms", "speed vs sdpa-flash",
              "peak (max_memory_allocated)" if on_gpu else "peak (allocator events)", "mem vs sdpa-flash"]
    if on_gpu:
        header += ["TFLOP/s"]
    print(table(f"memlab bench attention: causal, batch {b}, {heads} heads, head_dim {d}, {dtype}, block {cfg['blk']}; "
                f"median of {repeat} interleaved rounds; peak: one step, its inputs q, k, v, dO made inside "
                f"(4 x {b}x{heads}xseqx{d})"
                + ("" if on_gpu else f", {torch.get_num_threads()} threads"), header, rows, device=DEVICE))
    for n in notes:
        print(n)
    return report_targets(_targets(cfg["seqs"], results, on_gpu, d, dtype), DEVICE, strict=cfg["strict"])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
