"""``memlab estimate MODEL --lengths FILE``: the worst batch of a data set's epoch, the padded lengths over its
batches, and with ``--gpu`` the verdict and ``--max-batch-size`` (:mod:`memlab.estimate.batches`)."""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from memlab.core.units import format_bytes


def _error(msg: Any) -> int:
    print(f"memlab estimate: error: {msg}", file=sys.stderr)
    return 2


def _histogram(values: list[int], bins: int = 8, width: int = 40) -> list[str]:
    lo, hi = min(values), max(values)
    step = max(1, -(-(hi - lo + 1) // bins))
    counts = [0] * (-(-(hi - lo + 1) // step))
    for v in values:
        counts[(v - lo) // step] += 1
    top = max(counts)
    return [f"  {lo + i * step:>7}-{lo + (i + 1) * step - 1:<7} {c:>6}  {'#' * max(1 if c else 0, round(width * c / top))}"
            for i, c in enumerate(counts)]


def _settings(args: argparse.Namespace, run_kwargs: dict, adapter_kw: dict, overrides: dict | None) -> dict:
    from memlab.estimate.step import load_step

    kw = dict(run_kwargs)
    if args.step is not None:
        kw["step"] = load_step(args.step)
    return dict(dtype=args.dtype, optimizer=args.optimizer, checkpointing=args.checkpointing,
                config_overrides=overrides, world_size=args.world_size, zero_stage=args.zero_stage,
                optimizer_kwargs={"offload_gradients": True} if args.offload_gradients else None, **kw, **adapter_kw)


def run_worst_batch(args: argparse.Namespace, run_kwargs: dict, adapter_kw: dict, overrides: dict | None) -> int:
    """Print the worst batch of ``args.lengths`` (and ``--max-batch-size``); 0, or 2 on bad input (one line)."""
    from memlab.estimate.batches import batch_shapes, max_batch_size, read_lengths, worst_batch

    if args.max_batch_size and args.gpu is None:
        return _error("--max-batch-size needs --gpu (a card or a memory): the budget the worst batch must fit")
    try:
        lengths = read_lengths(args.lengths, tokenizer=getattr(args, "tokenizer", None))  # --tokenizer: args.py
        kw = _settings(args, run_kwargs, adapter_kw, overrides)
        shapes = batch_shapes(lengths, args.batch_size, args.collator, args.shuffle_seed)
        w = worst_batch(args.model, lengths, args.batch_size, args.collator, args.shuffle_seed,
                        exact=args.exact_shapes, **kw)
    except (KeyError, ValueError, TypeError, FileNotFoundError, OverflowError) as exc:
        return _error(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    except RuntimeError as exc:
        return _error(str(exc).splitlines()[0][:300])
    order = "the file's order" if args.shuffle_seed is None else f"shuffled with seed {args.shuffle_seed}"
    print(f"{args.lengths}: {len(lengths):,} samples, tokens min {min(lengths):,} / median "
          f"{statistics.median(lengths):,.0f} / max {max(lengths):,}; collator {args.collator}, batch size "
          f"{args.batch_size}, {order}: {len(shapes):,} batches (--seq-len is not used)")
    print("padded length of each batch (tokens, batches):")
    print("\n".join(_histogram([s for _, s in shapes])))
    print()
    print(w.estimate.table())
    print(f"\n{w.describe()}")
    for shape, figure in sorted(w.peaks.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {shape[0]} x {shape[1]}: {format_bytes(figure)} ({w.shapes[shape]} batch(es))")
    if args.gpu is None:
        return 0
    label, usable = args.gpu
    verdict = "FITS" if w.peak <= usable else "DOES NOT FIT"
    print(f"\nGPU: {label}\nverdict for the worst batch: {verdict}: {format_bytes(w.peak)} in {format_bytes(usable)} "
          f"usable")
    if args.max_batch_size:
        b, best = max_batch_size(args.model, lengths, usable, args.collator, args.shuffle_seed,
                                 exact=args.exact_shapes, **kw)
        if best is None:
            print("max batch size: none: one sample a batch does not fit")
        else:
            print(f"max batch size: {b} (its worst batch {best.shape[0]} x {best.shape[1]}: "
                  f"{format_bytes(best.peak)})")
    return 0
