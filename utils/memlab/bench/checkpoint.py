"""``memlab bench checkpoint``: memlab.checkpoint against torch.utils.checkpoint on one TinyGPT.

One training step (forward + backward) of a TinyGPT with ``--layers`` blocks, run

* without checkpointing (the baseline);
* with the blocks cut into ``k = sqrt_segments(n)`` segments by ``memlab.checkpoint.checkpoint_sequential``
  and by ``torch.utils.checkpoint.checkpoint_sequential(use_reentrant=False)``;
* with every block checkpointed (``TinyGPT.gradient_checkpointing_enable``) by
  ``memlab.checkpoint.checkpoint``, by ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, and
  by ``memlab.checkpoint.selective_checkpoint`` (matmul outputs kept).

Memory: ``memlab.profiler.MemoryTracker``'s activation peak; time: the median over ``--repeat``
interleaved rounds. The targets (printed as TARGET MET / TARGET MISSED lines) are stated in :func:`_targets`.
"""
from __future__ import annotations

import argparse
import functools
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

from memlab.bench import add_strict, interleaved_medians, report_targets, table


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    # The command line; ``--layers`` below 1 is refused by argparse (exit 2).
    p = argparse.ArgumentParser(prog="memlab bench checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="number of TinyGPT blocks (default 16)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 64 on CPU, 512 on GPU)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 4 on CPU, 8 on GPU)")
    p.add_argument("--width", type=int, default=None, help="n_embd (default 128 on CPU, 768 on GPU)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout (default 0.1)")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds (default 21 on CPU, 10 on GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_strict(p)
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers={args.layers} must be >= 1")
    return args


def _configurations(model, x: torch.Tensor, y: torch.Tensor, k: int) -> tuple[dict[str, Callable[[], None]],
                                                                               Callable[[], None]]:
    # One training step per configuration (name -> step), and the step with the blocks skipped.
    from memlab.checkpoint import checkpoint, checkpoint_sequential, selective_checkpoint

    s, dev = x.shape[1], x.device

    def embed():
        return model.drop(model.tok_emb(x) + model.pos_emb(torch.arange(s, device=dev)))

    def head_loss(hid):
        logits = model.lm_head(model.ln_f(hid))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def segmented(impl: str) -> Callable[[], None]:
        def run():
            model.gradient_checkpointing_disable()
            model.zero_grad(set_to_none=True)
            hid = embed()
            if impl == "memlab":
                hid = checkpoint_sequential(model.blocks, k, hid)
            else:
                hid = tuc.checkpoint_sequential(model.blocks, k, hid, use_reentrant=False)
            head_loss(hid).backward()
        return run

    def per_block(fn) -> Callable[[], None]:
        def run():
            if fn is None:
                model.gradient_checkpointing_disable()
            else:
                model.gradient_checkpointing_enable(fn)
            model.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
        return run

    def rest_only():
        model.zero_grad(set_to_none=True)
        head_loss(embed()).backward()

    configs = {
        "no checkpointing": per_block(None),
        f"memlab, {k} segments": segmented("memlab"),
        f"torch, {k} segments": segmented("torch"),
        "memlab, every block": per_block(checkpoint),
        "torch, every block": per_block(functools.partial(tuc.checkpoint, use_reentrant=False)),
        "memlab selective, every block": per_block(selective_checkpoint),
    }
    return configs, rest_only


def _rows(peaks: dict[str, int], times: dict[str, float]) -> list[list[str]]:
    # The table's rows: each configuration against no checkpointing and against torch's same cut.
    from memlab.core.units import format_bytes

    base_p, base_t = peaks["no checkpointing"], times["no checkpointing"]
    rows = []
    for name in peaks:
        ref = name.replace("memlab", "torch") if name.startswith("memlab") and "selective" not in name else None
        vs_torch_p = f"{peaks[name] / peaks[ref]:.3f}" if ref else "-"
        vs_torch_t = f"{times[name] / times[ref]:.3f}" if ref else "-"
        rows.append([name, format_bytes(peaks[name]), f"{peaks[name] / base_p:.3f}", vs_torch_p,
                     f"{times[name] * 1e3:.1f}", f"{times[name] / base_t:.3f}", vs_torch_t])
    return rows


def _targets(peaks: dict[str, int], times: dict[str, float], n: int, k: int, predicted: int, boundary: int,
             layer: int, rest: int) -> list[tuple[str, float, bool]]:
    # The targets as ``(text, ratio, holds)``.
    #
    # * the activation peak with sqrt(n) segments is within 15% of the model
    #   ``k * boundary + ceil(n/k) * layer`` plus the rest of the model (embedding, head, loss: the
    #   same step with the blocks skipped), ``layer`` and ``boundary`` measured by saved_tensors_hooks;
    # * step time with sqrt(n) segments is less than 40% above no checkpointing;
    # * memlab's peak is within 2% of torch.utils.checkpoint's and its step time at most 10% above it,
    #   for the same segments (being faster is not a miss).
    from memlab.core.units import format_bytes

    seg, tseg = f"memlab, {k} segments", f"torch, {k} segments"
    base_t = times["no checkpointing"]
    every_p = peaks["memlab, every block"] / peaks["torch, every block"]
    every_t = times["memlab, every block"] / times["torch, every block"]
    return [
        (f"activation peak with k={k} segments within 15% of the model "
         f"({format_bytes(predicted)} = {k}*{format_bytes(boundary)} + {-(-n // k)}*{format_bytes(layer)} "
         f"+ rest {format_bytes(rest)})", peaks[seg] / predicted, abs(peaks[seg] / predicted - 1) <= 0.15),
        (f"step time overhead with k={k} segments under 40% vs no checkpointing",
         times[seg] / base_t, times[seg] / base_t < 1.40),
        (f"memory within 2% of torch.utils.checkpoint (k={k} segments)",
         peaks[seg] / peaks[tseg], abs(peaks[seg] / peaks[tseg] - 1) <= 0.02),
        ("memory within 2% of torch.utils.checkpoint (every block)", every_p, abs(every_p - 1) <= 0.02),
        (f"time at most 10% above torch.utils.checkpoint (k={k} segments)",
         times[seg] / times[tseg], times[seg] / times[tseg] <= 1.10),
        ("time at most 10% above torch.utils.checkpoint (every block)", every_t, every_t <= 1.10),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table and targets; exit code 0, or 1 with ``--strict`` when a target is missed."""
    from memlab.accounting import saved_activation_bytes
    from memlab.checkpoint import activation_memory_model, sqrt_segments
    from memlab.config import DEVICE, seed_everything
    from memlab.models import TinyGPT, TinyGPTConfig
    from memlab.profiler import MemoryTracker

    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = DEVICE
    on_gpu = dev.type == "cuda"
    n = args.layers
    s = args.seq or (512 if on_gpu else 64)
    b = args.batch or (8 if on_gpu else 4)
    h = args.width or (768 if on_gpu else 128)
    repeat = args.repeat or (10 if on_gpu else 21)
    k = sqrt_segments(n)

    seed_everything(0)
    model = TinyGPT(TinyGPTConfig(n_layer=n, n_embd=h, n_head=args.heads, block_size=s,
                                  dropout=args.dropout)).to(dev)
    x = torch.randint(0, 256, (b, s), device=dev)
    y = torch.randint(0, 256, (b, s), device=dev)
    configs, rest_only = _configurations(model, x, y, k)

    def activation_peak(fn) -> int:
        with MemoryTracker(model) as tracker:
            fn()
        return max(e.bytes["activations"] + e.bytes["other"] for e in tracker.timeline)

    peaks = {name: activation_peak(fn) for name, fn in configs.items()}
    times = interleaved_medians(configs, repeat, dev, warmup=1)

    hid0 = torch.randn(b, s, h, device=dev, requires_grad=True)
    layer = saved_activation_bytes(model.blocks[0], hid0)
    boundary = hid0.numel() * hid0.element_size()
    rest = activation_peak(rest_only)
    predicted = activation_memory_model(n, k, layer, boundary) + rest

    print(table(
        f"memlab bench checkpoint: {n}-layer TinyGPT, seq {s}, batch {b}, width {h}, dropout {args.dropout}, "
        f"fp32; median of {repeat} interleaved rounds",
        ["configuration", "act. peak", "peak / none", "peak / torch", "step ms", "time / none", "time / torch"],
        _rows(peaks, times), device=dev))
    checks = _targets(peaks, times, n, k, predicted, boundary, layer, rest)
    return report_targets(checks, dev, strict=args.strict)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
