"""The worst batch of a data set: every calculator assumes one sequence length, but a run pads each batch to its
longest sample (or packs), so its peak is set by the worst batch the sampler draws in an epoch.

:func:`batch_shapes` lays out one epoch as a DataLoader would (``shuffle_seed``: the order of
``DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(seed))``'s first epoch: its iterator draws a
base seed from the generator, then its RandomSampler a ``torch.randperm``;
None: the file's order) and gives each batch's padded shape under a collator:

* ``pad-longest``: rows x the batch's longest sample (``DataCollatorWithPadding``'s ``padding="longest"``);
* ``pad-multiple:N``: that length rounded up to a multiple of N (``pad_to_multiple_of=N``);
* ``pack:N``: the epoch's samples concatenated in order and cut into rows of N tokens (a sample may span rows), so
  every batch is ``batch_size x N`` but the last.

:func:`worst_batch` traces each distinct shape once (cached) with :func:`memlab.estimate.estimate_training_memory`.
By default a shape that another shape covers (no more rows and no longer) is not traced: the peak is taken to grow
with rows and with length, which the result says; ``exact=True`` traces every distinct shape.
:func:`max_batch_size` is the largest micro-batch whose worst batch fits a budget.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from memlab.core.validation import check_positive_int, invalid

__all__ = ["COLLATORS", "read_lengths", "parse_collator", "batch_shapes", "WorstBatch", "worst_batch",
           "max_batch_size"]

COLLATORS = ("pad-longest", "pad-multiple:N", "pack:N")


def read_lengths(path: str | Path) -> list[int]:
    """Token counts, one per sample: a text file of one int per line (blank lines skipped), a 1-D ``.npy`` of ints,
    or a tokenized data set as ``.jsonl`` (each line's ``input_ids`` counted).

    Raises:
        ValueError: a line that is no int, a count below 1, an empty file, a ``.npy`` that is not 1-D ints (one line
            naming the file and what was expected).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    want = "one token count (an int >= 1) per line, or a 1-D .npy of ints"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; expected {want}")
    if path.suffix == ".jsonl":
        return _jsonl_lengths(path)
    if path.suffix == ".npy":
        import numpy as np

        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path}: not a readable .npy ({str(exc).splitlines()[0]}); expected {want}") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"{path}: a .npy of shape {arr.shape} and dtype {arr.dtype}; expected {want}")
        out = [int(v) for v in arr]
        bad = next((i for i, v in enumerate(out) if v < 1), None)
        if bad is not None:
            raise ValueError(f"{path}: entry {bad} is {out[bad]}; expected {want}")
    else:
        out = []
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            s = line.strip()
            if not s:
                continue
            if not s.lstrip("+").isdigit() or int(s) < 1:
                raise ValueError(f"{path}: line {n} is {s[:40]!r}; expected {want}")
            out.append(int(s))
    if not out:
        raise ValueError(f"{path}: no lengths in it; expected {want}")
    return out


def _jsonl_lengths(path: Path) -> list[int]:
    """A tokenized data set as JSON lines: each line's ``input_ids`` (a list of ints) counted."""
    import json

    want = "a JSON object with input_ids (a non-empty list of token ids) on every line"
    out = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {n} is not JSON; expected {want}") from None
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not ids:
            keys = sorted(row)[:6] if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path}: line {n} has no input_ids (has {keys}); expected {want}")
        out.append(len(ids))
    if not out:
        raise ValueError(f"{path}: no rows in it; expected {want}")
    return out


def parse_collator(collator: str) -> tuple[str, int]:
    """``("pad-longest", 1)``, ``("pad-multiple", N)`` or ``("pack", N)``.

    Raises:
        ValueError: anything else, naming the value and the allowed forms.
    """
    kind, _, n = str(collator).partition(":")
    if kind == "pad-longest" and not n:
        return kind, 1
    if kind in ("pad-multiple", "pack") and n.isdigit() and int(n) >= 1:
        return kind, int(n)
    raise invalid("collator", collator, "pad-longest, pad-multiple:N or pack:N (N an int >= 1)")


def _order(n: int, shuffle_seed: int | None) -> list[int]:
    if shuffle_seed is None:
        return list(range(n))
    import torch

    g = torch.Generator().manual_seed(int(shuffle_seed))
    torch.empty((), dtype=torch.int64).random_(generator=g)  # a DataLoader's iterator draws its base seed first
    return torch.randperm(n, generator=g).tolist()


def batch_shapes(lengths: Sequence[int], batch_size: int, collator: str = "pad-longest",
                 shuffle_seed: int | None = None, drop_last: bool = False) -> list[tuple[int, int]]:
    """Each batch of one epoch as ``(rows, padded length)``, in the order the sampler draws them."""
    check_positive_int("batch_size", batch_size)
    kind, n = parse_collator(collator)
    order = _order(len(lengths), shuffle_seed)
    if kind == "pack":
        rows = math.ceil(sum(int(lengths[i]) for i in order) / n)
        full, rest = divmod(rows, batch_size)
        return [(batch_size, n)] * full + ([(rest, n)] if rest and not drop_last else [])
    out = []
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        if drop_last and len(idx) < batch_size:
            break
        longest = max(int(lengths[i]) for i in idx)
        out.append((len(idx), longest if kind == "pad-longest" else math.ceil(longest / n) * n))
    return out


def _uncovered(shapes: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The shapes no other shape covers (at least as many rows and at least as long): a sweep from the most rows."""
    out, longest_above = [], 0  # the longest shape among those with more rows than the current group
    for rows in sorted({r for r, _ in shapes}, reverse=True):
        top = max(s for r, s in shapes if r == rows)
        if top > longest_above:  # only a group's longest can be uncovered, and only if nothing above reaches it
            out.append((rows, top))
        longest_above = max(longest_above, top)
    return sorted(out)


@dataclass
class WorstBatch:
    """The worst batch of an epoch: ``estimate`` is its :class:`~memlab.estimate.MemoryEstimate` (``peak`` its
    compared figure, as :meth:`~memlab.estimate.MemoryEstimate.fits` compares: reserved on a CUDA target, else the
    traced tensor peak), ``shape`` its
    ``(rows, padded length)``, ``index`` the first batch of that shape. ``peaks`` holds every traced shape's figure,
    ``shapes`` how many batches have each shape, ``skipped`` the shapes not traced because another covers them."""

    shape: tuple[int, int]
    index: int
    peak: int
    estimate: Any
    batches: int
    peaks: dict[tuple[int, int], int] = field(default_factory=dict)
    shapes: dict[tuple[int, int], int] = field(default_factory=dict)
    skipped: list[tuple[int, int]] = field(default_factory=list)

    def describe(self) -> str:
        """Where the worst batch is, and how it was found."""
        how = (f"{len(self.peaks)} distinct shape(s) traced"
               + (f", {len(self.skipped)} covered by a larger one not traced (the peak taken to grow with rows and "
                  f"length; exact=True / --exact-shapes traces them)" if self.skipped else ""))
        return (f"worst batch: #{self.index} of {self.batches}, {self.shape[0]} x {self.shape[1]} tokens padded; "
                f"{how}")


def _figure(est: Any) -> int:
    return est.reserved_bytes if est.device.startswith("cuda") else est.peak_bytes


def worst_batch(model: Any, lengths: Sequence[int], batch_size: int, collator: str = "pad-longest",
                shuffle_seed: int | None = None, *, drop_last: bool = False, exact: bool = False,
                cache: dict | None = None, **estimate_kwargs: Any) -> WorstBatch:
    """The worst batch of one epoch of ``lengths`` (:func:`batch_shapes`), each distinct shape traced once.

    Args:
        model: what :func:`memlab.estimate.estimate_training_memory` takes.
        estimate_kwargs: its settings other than ``batch_size`` and ``seq_len`` (dtype, optimizer, checkpointing, ...).
        exact: trace every distinct shape, also those another shape covers.
        cache: shape -> estimate, shared between calls (:func:`max_batch_size` passes one).
    """
    from memlab.estimate.api import estimate_training_memory

    for key in ("batch_size", "seq_len"):
        if key in estimate_kwargs:
            raise TypeError(f"unexpected keyword argument {key!r}: the batches set it")
    shapes = batch_shapes(lengths, batch_size, collator, shuffle_seed, drop_last)
    if not shapes:
        raise invalid("lengths", f"{len(lengths)} samples", f"at least one batch of {batch_size} (drop_last)")
    counts = Counter(shapes)
    todo = sorted(counts) if exact else _uncovered(set(counts))
    cache = {} if cache is None else cache
    peaks = {}
    for shape in todo:
        if shape not in cache:
            cache[shape] = estimate_training_memory(model, batch_size=shape[0], seq_len=shape[1], **estimate_kwargs)
        peaks[shape] = _figure(cache[shape])
    worst = max(todo, key=lambda s: (peaks[s], cache[s].peak_bytes, s))
    return WorstBatch(shape=worst, index=shapes.index(worst), peak=peaks[worst], estimate=cache[worst],
                      batches=len(shapes), peaks=peaks, shapes=dict(counts),
                      skipped=sorted(set(counts) - set(todo)))


def max_batch_size(model: Any, lengths: Sequence[int], budget: int, collator: str = "pad-longest",
                   shuffle_seed: int | None = None, *, upto: int = 4096, **kwargs: Any) -> tuple[int, WorstBatch | None]:
    """The largest micro-batch (up to ``upto``) whose worst batch's figure is at most ``budget`` bytes, and that
    worst batch; ``(0, None)`` when one sample a batch does not fit. Doubles, then bisects (the worst batch taken
    to grow with the batch size); every shape is traced once across the search."""
    check_positive_int("budget", budget)
    cache: dict = {}

    def fits(b: int) -> WorstBatch | None:
        w = worst_batch(model, lengths, b, collator, shuffle_seed, cache=cache, **kwargs)
        return w if w.peak <= budget else None

    best = fits(1)
    if best is None:
        return 0, None
    lo, hi, found = 1, None, best
    b = 2
    while b <= min(upto, len(lengths)) and hi is None:
        w = fits(b)
        if w is None:
            hi = b
        else:
            lo, found, b = b, w, b * 2
    hi = hi if hi is not None else min(upto, len(lengths)) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        w = fits(mid)
        if w is None:
            hi = mid
        else:
            lo, found = mid, w
    return lo, found
