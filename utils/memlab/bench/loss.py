"""``memlab bench loss``: memlab.loss's fused linear cross-entropy against the loss on materialised logits.

One forward + backward of a language-model loss, the head's matmul included, for ``N`` tokens,
hidden size ``H`` and a vocabulary ``V`` (gradients of the hidden states and of the head), by

* ``materialized``: ``F.cross_entropy(F.linear(h, W).float(), t)`` (transformers' default loss);
* ``chunked``: :func:`memlab.loss.chunked_cross_entropy` (chunks through autograd);
* ``torchtune``: torchtune's ``CEWithChunkedOutputLoss`` on 8 logits chunks, where torchtune is
  installed (see :mod:`memlab.loss.peers`);
* ``fused``: :func:`memlab.loss.fused_linear_cross_entropy` (PyTorch, backward recomputes chunks);
* ``triton``: :func:`memlab.loss.triton_fused_linear_cross_entropy` and ``liger``: Liger-Kernel's
  ``LigerFusedLinearCrossEntropyLoss``, on CUDA only (on a CPU both run in Triton's interpreter, far
  too slow to time; tests check them).

Time: median over ``--repeat`` interleaved rounds after a warm-up, CUDA synchronised before
reading the clock. Memory: the allocator's peak over one step above what was live before it (the
inputs): on CPU rebuilt from its events (``memlab.profiler.allocator_peak``), on CUDA
``torch.cuda.max_memory_allocated``; ``saved for backward``: the bytes autograd keeps beyond h and W
(``saved_tensors_hooks``, :func:`memlab.accounting.saved_activation_bytes`). Ratios against ``materialized`` in the same run: ``speed`` =
its time / ours, ``mem`` = our peak / its peak. A size whose ``N x V`` fp32 logits pass
``--max-logits-gib`` is left out (the materialised loss keeps several such tensors at once).

Targets (issue 37), printed as TARGET MET / TARGET MISSED lines: at a vocabulary of 128k or more, the fused loss's
peak <= 0.1x the materialised loss's and its time <= 1.5x.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.nn.functional as F

from memlab.bench import add_strict, interleaved_medians, progress, report_targets, sync, table
from memlab.core.validation import check_positive_int

IMPLS = ("materialized", "chunked", "torchtune", "fused", "triton", "liger")
REFERENCE = "materialized"
GPU_ONLY = ("triton", "liger")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memlab bench loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=str, default=None,
                   help="comma-separated token counts N (default 1024,4096,16384)")
    p.add_argument("--vocabs", type=str, default="32000,128256", help="comma-separated vocabularies (default 32000,128256)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size H (default 64 on CPU, 4096 on GPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of h and W (default float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk of chunked and fused (default 128 on "
                   "CPU, 1024 on GPU)")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds (default 3 on CPU, 10 on GPU)")
    p.add_argument("--max-logits-gib", type=float, default=None,
                   help="skip sizes whose N x V fp32 logits pass this (default 2 on CPU, 16 on GPU)")
    p.add_argument("--only", type=str, default=None, help=f"comma-separated subset of {','.join(IMPLS)}")
    add_strict(p)
    return p


def _settings(argv: list[str] | None, on_gpu: bool) -> dict[str, Any]:
    # the command line checked, the device's defaults filled in
    p = _parser()
    args = p.parse_args(argv)
    try:
        tokens = [check_positive_int("--tokens", int(s)) for s in (args.tokens or "1024,4096,16384").split(",")]
        vocabs = [check_positive_int("--vocabs", int(s)) for s in args.vocabs.split(",")]
        for name, v in (("--hidden", args.hidden), ("--chunk", args.chunk), ("--repeat", args.repeat)):
            if v is not None:
                check_positive_int(name, v)
    except ValueError as exc:
        p.error(str(exc))
    only = set(args.only.split(",")) if args.only else set(IMPLS)
    if only - set(IMPLS):
        p.error(f"--only={args.only}: unknown {sorted(only - set(IMPLS))}; allowed: {', '.join(IMPLS)}")
    return dict(tokens=tokens, vocabs=vocabs, hidden=args.hidden or (4096 if on_gpu else 64),
                dtype=getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32")),
                chunk=args.chunk or (1024 if on_gpu else 128), repeat=args.repeat or (10 if on_gpu else 3),
                max_logits=(args.max_logits_gib or (16.0 if on_gpu else 2.0)) * 2 ** 30, only=only | {REFERENCE},
                strict=args.strict)


def _impls(cfg: dict[str, Any], on_gpu: bool) -> tuple[dict[str, Callable], list[str]]:
    # name -> loss(h, W, t), and notes on those left out
    from memlab import loss as ml
    from memlab.loss import peers

    chunk = cfg["chunk"]
    impls: dict[str, Callable] = {
        "materialized": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t),
        "chunked": lambda h, w, t: ml.chunked_cross_entropy(h, w, t, chunk_size=chunk),
        "fused": lambda h, w, t: ml.fused_linear_cross_entropy(h, w, t, chunk_size=chunk),
    }
    notes = []
    tt = peers.torchtune_chunked_loss()
    if tt is not None:
        tt_loss = tt(num_output_chunks=8)
        impls["torchtune"] = lambda h, w, t: tt_loss([F.linear(c, w) for c in h.unsqueeze(0).chunk(8, dim=1)],
                                                     t.unsqueeze(0))
    else:
        notes.append("torchtune: not installed (its package needs torchao and datasets; memlab loads its loss "
                     "module alone from an install made with pip install --no-deps torchtune)")
    if on_gpu:
        if ml.triton_available():
            impls["triton"] = lambda h, w, t: ml.triton_fused_linear_cross_entropy(h, w, t, chunk_size=chunk)
        liger = peers.liger_fused_loss()
        if liger is not None:
            liger_loss = liger()
            impls["liger"] = lambda h, w, t: liger_loss(w, h, t)
        else:
            notes.append("liger: liger-kernel is not installed")
    else:
        notes.append("triton, liger: not timed on CPU (Triton's interpreter runs kernels in Python; tests check both)")
    keep = {k: v for k, v in impls.items() if k in cfg["only"]}
    return dict(sorted(keep.items(), key=lambda kv: IMPLS.index(kv[0]))), notes


def _peak(fn: Callable[[], None], on_gpu: bool) -> int:
    # peak bytes of one step above what was live before it
    from memlab.profiler import allocator_peak

    if not on_gpu:
        return allocator_peak(fn)[0]
    sync("cuda")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync("cuda")
    return torch.cuda.max_memory_allocated() - base


def _measure(n: int, v: int, impls: dict[str, Callable], cfg: dict[str, Any], on_gpu: bool
             ) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    # median fwd+bwd time, peak bytes and bytes saved for backward (beyond h and W) of each implementation
    from memlab.config import DEVICE

    g = torch.Generator(device=DEVICE).manual_seed(n + v)
    h = torch.randn(n, cfg["hidden"], device=DEVICE, generator=g).to(cfg["dtype"]).requires_grad_(True)
    w = (torch.randn(v, cfg["hidden"], device=DEVICE, generator=g) * cfg["hidden"] ** -0.5).to(cfg["dtype"])
    w.requires_grad_(True)
    t = torch.randint(0, v, (n,), device=DEVICE, generator=g)
    t[::10] = -100  # a few ignored tokens, as in a batch with prompts or padding

    def step(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            dh, dw = torch.autograd.grad(fn(h, w, t), (h, w))
            del dh, dw
        return run

    from memlab.accounting import saved_activation_bytes

    fns = {name: step(fn) for name, fn in impls.items()}
    peaks, saved = {}, {}
    for name, fn in fns.items():
        fn()  # warm-up (and Triton compilation)
        peaks[name] = _peak(fn, on_gpu)
        saved[name] = saved_activation_bytes(lambda hh, ww, f=impls[name]: f(hh, ww, t), h, w, exclude=[h, w])
    return interleaved_medians(fns, cfg["repeat"], DEVICE), peaks, saved


def _targets(results: dict[tuple[str, int, int], tuple[float, int]]) -> list[tuple[str, float, bool]]:
    # issue 37's targets at every measured size with V >= 128k, as (text, ratio, holds)
    checks = []
    for (name, n, v), (t, peak) in sorted(results.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if name != "fused" or v < 128_000 or (REFERENCE, n, v) not in results:
            continue
        t_ref, p_ref = results[(REFERENCE, n, v)]
        checks.append((f"fused peak <= 0.1x materialized at N={n}, V={v}", peak / p_ref, peak / p_ref <= 0.1))
        checks.append((f"fused time <= 1.5x materialized at N={n}, V={v}", t / t_ref, t / t_ref <= 1.5))
    return checks


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table and targets; exit code 0, or 1 with ``--strict`` when a target is missed."""
    from memlab.config import DEVICE, seed_everything
    from memlab.core.units import format_bytes

    on_gpu = DEVICE.type == "cuda"
    cfg = _settings(argv, on_gpu)
    impls, notes = _impls(cfg, on_gpu)
    seed_everything(0)
    rows, results, skipped = [], {}, []
    for v in cfg["vocabs"]:
        for n in cfg["tokens"]:
            if n * v * 4 > cfg["max_logits"]:
                skipped.append(f"N={n} x V={v}")
                continue
            med, peaks, saved = _measure(n, v, impls, cfg, on_gpu)
            for name in med:
                progress(f"bench loss N={n} V={v} {name}: {med[name] * 1e3:.2f} ms, peak {peaks[name]:,} B, "
                         f"saved {saved[name]:,} B")
                rows.append([name, n, v, f"{med[name] * 1e3:.1f}", f"{med[REFERENCE] / med[name]:.2f}",
                             format_bytes(peaks[name]), f"{peaks[name] / peaks[REFERENCE]:.3f}",
                             format_bytes(saved[name])])
                results[(name, n, v)] = (med[name], peaks[name])
    header = ["impl", "tokens", "vocab", "fwd+bwd ms", "speed vs materialized",
              "peak (max_memory_allocated)" if on_gpu else "peak (allocator events)", "mem vs materialized",
              "saved for backward"]
    print(table(f"memlab bench loss: head matmul + cross-entropy, forward + backward (dh, dW); hidden {cfg['hidden']}, "
                f"{cfg['dtype']}, chunk {cfg['chunk']} tokens; median of {cfg['repeat']} interleaved rounds; peak: one "
                f"step above its inputs" + ("" if on_gpu else f", {torch.get_num_threads()} threads"),
                header, rows, device=DEVICE))
    if skipped:
        notes.append(f"left out (N x V fp32 logits over --max-logits-gib): {', '.join(skipped)}")
    for note in notes:
        print(note)
    checks = _targets(results)
    if not checks:
        print("\ntargets: none measured (they apply at a vocabulary of 128k or more, with materialized and fused run)")
    return report_targets(checks, DEVICE, strict=cfg["strict"])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
