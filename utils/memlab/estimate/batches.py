"""The worst batch of a data set: every calculator assumes one sequence length, but a run pads each batch to its
longest sample (or packs), so its peak is set by the worst batch the sampler draws in an epoch.

:func:`read_lengths` reads the token counts: a file of counts, a ``.npy``, a ``.jsonl`` of ``input_ids``, a
``.jsonl`` of texts with a local tokenizer (:func:`load_tokenizer`, offline), or a tokenized Hugging Face data set
saved with ``datasets.Dataset.save_to_disk``.

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
from typing import Any, Callable, Sequence

from memlab.core.validation import check_positive_int, invalid

__all__ = ["COLLATORS", "read_lengths", "load_tokenizer", "parse_collator", "batch_shapes", "WorstBatch", "worst_batch",
           "max_batch_size"]

COLLATORS = ("pad-longest", "pad-multiple:N", "pack:N")


def read_lengths(path: str | Path, *, tokenizer: str | Path | None = None, text_field: str = "text") -> list[int]:
    """Token counts, one per sample, from any of:

    * a text file of one int per line (blank lines skipped), or a 1-D ``.npy`` of ints;
    * a tokenized data set as ``.jsonl`` (each line's ``input_ids`` counted);
    * a ``.jsonl`` of texts with ``tokenizer``, a LOCAL tokenizer (a folder saved with ``save_pretrained`` or a
      ``tokenizer.json``; nothing is downloaded): each line's ``text_field`` tokenized, in batches;
    * a folder holding a tokenized Hugging Face data set saved with ``datasets.Dataset.save_to_disk`` (read with
      ``datasets.load_from_disk``; its ``input_ids`` column counted; a ``DatasetDict``'s ``train`` split).

    Raises:
        ValueError: a line that is no int, a count below 1, an empty file, a ``.npy`` that is not 1-D ints, a data
            set or a JSONL line without ``input_ids`` (one line naming the file and what was expected).
        FileNotFoundError: no such file, folder or tokenizer.
        memlab.core.optional.MissingExtraError: a data set folder without the ``datasets`` package.
    """
    path = Path(path)
    want = ("one token count (an int >= 1) per line, a 1-D .npy of ints, a .jsonl of input_ids (or of texts with a "
            "local tokenizer), or a tokenized data set folder (datasets.Dataset.save_to_disk)")
    if tokenizer is not None and not (path.is_file() and path.suffix == ".jsonl"):
        raise invalid("tokenizer", str(tokenizer), f"given only with a .jsonl of texts (lengths is {path})")
    if path.is_dir():
        return _dataset_lengths(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or folder; expected {want}")
    if path.suffix == ".jsonl":
        return _jsonl_lengths(path, tokenizer, text_field)
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


_TOKENIZER_WANT = ("a local tokenizer: a folder saved with save_pretrained (tokenizer_config.json, tokenizer.json, "
                   "...) or a tokenizer.json file; nothing is downloaded")
_BATCH = 1000  # texts tokenized at a time


def load_tokenizer(tokenizer: str | Path) -> Callable[[list[str]], list[int]]:
    """A function counting the tokens of each of a list of texts with a LOCAL tokenizer, offline: a ``tokenizer.json``
    (the ``tokenizers`` library's ``Tokenizer.from_file``), or a folder (``transformers.AutoTokenizer.from_pretrained``
    with ``local_files_only=True``; a folder holding only a ``tokenizer.json`` is read as that file). Special tokens
    are added as the tokenizer adds them when a collator tokenizes (``add_special_tokens=True``).

    Raises:
        FileNotFoundError: no such file or folder (naming ``tokenizer`` and what was expected).
        ValueError: a file or folder that holds no tokenizer.
    """
    p = Path(tokenizer)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer={str(tokenizer)!r}: no such file or folder; expected {_TOKENIZER_WANT}")
    if p.is_dir() and not (p / "tokenizer_config.json").is_file():
        if not (p / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer={str(tokenizer)!r}: a folder without tokenizer_config.json or "
                             f"tokenizer.json; expected {_TOKENIZER_WANT}")
        p = p / "tokenizer.json"
    if p.is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(p))
        except Exception as exc:  # the Rust parser's error: a file that is no tokenizer.json
            raise ValueError(f"tokenizer={str(tokenizer)!r}: not a readable tokenizer.json "
                             f"({str(exc).splitlines()[0][:120]}); expected {_TOKENIZER_WANT}") from None
        return lambda texts: [len(e.ids) for e in tok.encode_batch(texts)]
    from memlab.core.optional import needs

    with needs("memlab estimate --tokenizer"):
        from transformers import AutoTokenizer
    try:
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"tokenizer={str(tokenizer)!r}: transformers could not load it offline "
                         f"({str(exc).splitlines()[0][:160]}); expected {_TOKENIZER_WANT}") from None
    return lambda texts: [len(ids) for ids in hf(texts, add_special_tokens=True)["input_ids"]]


def _jsonl_lengths(path: Path, tokenizer: str | Path | None = None, text_field: str = "text") -> list[int]:
    """A tokenized data set as JSON lines (each line's ``input_ids`` counted), or with ``tokenizer`` a JSONL of
    texts (each line's ``text_field`` tokenized, :data:`_BATCH` lines at a time)."""
    import json

    count = load_tokenizer(tokenizer) if tokenizer is not None else None
    want = (f"a JSON object with a string {text_field!r} on every line (tokenizer={str(tokenizer)!r})" if count else
            "a JSON object with input_ids (a non-empty list of token ids) on every line, or texts with a local "
            "tokenizer (tokenizer=, --tokenizer PATH)")
    out: list[int] = []
    texts: list[tuple[int, str]] = []

    def flush() -> None:
        for (n, _), k in zip(texts, count([t for _, t in texts])):
            if k < 1:
                raise ValueError(f"{path}: line {n}'s {text_field!r} is no token; expected {want}")
            out.append(k)
        texts.clear()

    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {n} is not JSON; expected {want}") from None
        keys = sorted(row)[:6] if isinstance(row, dict) else type(row).__name__
        if count is not None:
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}: line {n} has no string {text_field!r} (has {keys}); expected {want}")
            texts.append((n, text))
            if len(texts) >= _BATCH:
                flush()
            continue
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{path}: line {n} has no input_ids (has {keys}); expected {want}")
        out.append(len(ids))
    if texts:
        flush()
    if not out:
        raise ValueError(f"{path}: no rows in it; expected {want}")
    return out


def _dataset_lengths(folder: Path) -> list[int]:
    """The ``input_ids`` lengths of a data set saved with ``save_to_disk`` (a ``DatasetDict``: its train split)."""
    from memlab.core.optional import MissingExtraError

    want = ("a tokenized data set saved with datasets.Dataset.save_to_disk: an input_ids column of non-empty "
            "token id lists")
    try:
        import datasets
    except ModuleNotFoundError:
        raise MissingExtraError("memlab estimate --lengths DIR (a data set folder)", "datasets", "hf") from None
    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"{folder}: not a data set saved with save_to_disk ({str(exc).splitlines()[0][:160]}); "
                         f"expected {want}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{folder}: a DatasetDict with splits {sorted(ds)} and no 'train'; give one split's "
                             f"folder ({folder}/NAME); expected {want}")
        ds = ds["train"]
    if "input_ids" not in ds.column_names:
        raise ValueError(f"{folder}: a data set with columns {ds.column_names[:8]} and no input_ids; expected {want}")
    import pyarrow.compute as pc

    col = ds.with_format("arrow")["input_ids"]
    try:
        lengths = pc.list_value_length(col).to_pylist()
    except Exception:  # noqa: BLE001 - pyarrow's type errors: a column that is no list
        raise ValueError(f"{folder}: its input_ids column is {ds.features['input_ids']}, not lists of token ids; "
                         f"expected {want}") from None
    bad = next((i for i, v in enumerate(lengths) if not v), None)
    if bad is not None:
        raise ValueError(f"{folder}: row {bad}'s input_ids is {'missing' if lengths[bad] is None else 'empty'}; "
                         f"expected {want}")
    if not lengths:
        raise ValueError(f"{folder}: no rows in it; expected {want}")
    return lengths


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
