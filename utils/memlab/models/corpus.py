"""Byte-level training data that needs no download: the Python standard library itself.

The course trains its small models on the ``.py`` source files of the standard library of
the Python that runs it (megabytes of real, structured text, identical on every machine with
the same Python version). Tokens are bytes (vocabulary 256), so :func:`encode` / :func:`decode`
are the whole tokenizer.

* :func:`stdlib_corpus` -- the corpus as a 1-D ``uint8`` tensor (cached in-process).
* :func:`batches` -- an endless stream of random ``(x, y)`` windows from the train or
  validation part, with ``y`` = ``x`` shifted by one token.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch

from memlab.core.validation import check_choice, check_int, check_positive_int, invalid

__all__ = [
    "TRAIN_FRACTION",
    "VAL_SEED_OFFSET",
    "stdlib_root",
    "stdlib_files",
    "stdlib_corpus",
    "clear_corpus_cache",
    "split_bounds",
    "batches",
    "encode",
    "decode",
]

# The first TRAIN_FRACTION of the corpus (rounded down to whole bytes) is the train split,
# the rest is the validation split.
TRAIN_FRACTION = 0.9
# Added to the seed of the validation stream so train and val never draw the same offsets.
VAL_SEED_OFFSET = 1_000_003

# Directory names never descended into.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_SPLITS = ("train", "val")


def stdlib_root() -> Path:
    """Directory of the running Python's standard library (where ``os.py`` lives, resolved)."""
    return Path(os.__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _stdlib_paths() -> tuple[str, ...]:
    # relative POSIX paths of the corpus files, sorted as strings
    root = stdlib_root()
    found: list[str] = []

    def visit(directory: Path) -> None:
        for entry in directory.iterdir():
            if entry.is_file() and entry.suffix == ".py":
                found.append(entry.relative_to(root).as_posix())
            elif (
                entry.is_dir()
                and entry.name not in _EXCLUDED_DIRS
                and (entry / "__init__.py").is_file()  # only packages, recursively
            ):
                visit(entry)

    visit(root)
    return tuple(sorted(found))


def stdlib_files() -> list[str]:
    """The files that make up :func:`stdlib_corpus`, in corpus order.

    Paths are relative to :func:`stdlib_root`, with ``/`` separators. The rule: every
    ``.py`` file directly in the standard-library directory, plus the ``.py`` files of its
    packages (directories with an ``__init__.py``) and their sub-packages, skipping any
    directory named ``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idlelib``
    or ``lib2to3``. Sorted by the path string.
    """
    return list(_stdlib_paths())


@functools.lru_cache(maxsize=16)
def _stdlib_tensor(max_bytes: int | None) -> torch.Tensor:
    # the corpus (or its first max_bytes bytes), reading no more files than needed
    root = stdlib_root()
    parts: list[bytes] = []
    size = 0
    for i, rel in enumerate(_stdlib_paths()):
        if i > 0:
            parts.append(b"\n")
            size += 1
        data = (root / rel).read_bytes()
        parts.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    blob = b"".join(parts)
    if max_bytes is not None:
        blob = blob[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def stdlib_corpus(max_bytes: int | None = None) -> torch.Tensor:
    """The standard library's Python source as one 1-D ``torch.uint8`` tensor of bytes.

    The files listed by :func:`stdlib_files` are concatenated in that order with ``b"\\n"``
    between consecutive files. ``max_bytes`` keeps only the first ``max_bytes`` bytes (and
    stops reading files once it has them). Results are cached per process; each call
    returns a fresh copy, so modifying it is safe. The content depends on the Python version.

    Raises:
        ValueError: for a ``max_bytes`` that is not None or an int >= 1.
    """
    # measured: CPython 3.11 gives about 11 MB from about 600 files
    if max_bytes is not None:
        check_positive_int("stdlib_corpus: max_bytes", max_bytes)
    return _stdlib_tensor(max_bytes).clone()


def clear_corpus_cache() -> None:
    """Forget the cached file list and corpus, so the next :func:`stdlib_corpus` reads the files again."""
    _stdlib_tensor.cache_clear()
    _stdlib_paths.cache_clear()


def split_bounds(n: int, split: str) -> tuple[int, int]:
    """``(start, stop)`` of ``split`` in a corpus of ``n`` tokens: ``"train"`` is
    ``[0, int(n * TRAIN_FRACTION))``, ``"val"`` is ``[int(n * TRAIN_FRACTION), n)``.

    Raises:
        ValueError: for another split.
    """
    check_choice("split", split, _SPLITS)
    cut = int(n * TRAIN_FRACTION)
    return (0, cut) if split == "train" else (cut, n)


def batches(
    corpus: torch.Tensor,
    batch_size: int,
    seq_len: int,
    split: str = "train",
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random ``(x, y)`` batches of shape ``(batch_size, seq_len)`` (``torch.long``).

    ``y[b, t]`` is the token after ``x[b, t]``: each row is a window of ``seq_len + 1``
    consecutive tokens taken entirely inside the chosen split (see :func:`split_bounds`:
    first 90% train, last 10% val), so train and val batches never share a token position.
    Window starts are uniform, drawn from a ``torch.Generator`` seeded with ``seed`` for
    train and ``seed + VAL_SEED_OFFSET`` for val: the same arguments give the same stream.
    Arguments are checked when ``batches`` is called, not at the first ``next``.

    Args:
        corpus: 1-D token ids.
        seq_len: an int >= 1 with ``seq_len + 1`` tokens in the split.
        device: where the batches go, or None to leave them on the corpus's device.

    Raises:
        ValueError: naming the argument, its value and what is allowed.
    """
    if not isinstance(corpus, torch.Tensor) or corpus.dim() != 1:
        shape = tuple(corpus.shape) if isinstance(corpus, torch.Tensor) else type(corpus).__name__
        raise invalid("batches: corpus", shape, "a 1-D tensor of token ids")
    check_positive_int("batches: batch_size", batch_size)
    check_positive_int("batches: seq_len", seq_len)
    check_int("batches: seed", seed)
    start, stop = split_bounds(corpus.numel(), split)
    length = stop - start
    if seq_len + 1 > length:
        raise invalid("batches: seq_len", seq_len, f"seq_len <= {length - 1} (a window needs seq_len + 1 tokens "
                      f"and the {split!r} split has only {length} of the corpus's {corpus.numel()})")
    data = corpus[start:stop]
    generator = torch.Generator().manual_seed(seed + (VAL_SEED_OFFSET if split == "val" else 0))
    return _batch_stream(data, batch_size, seq_len, generator, device)


def _batch_stream(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    device: torch.device | str | None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    window = torch.arange(seq_len + 1)
    n_starts = data.numel() - seq_len  # valid starts: 0 .. len - seq_len - 1
    while True:
        starts = torch.randint(0, n_starts, (batch_size,), generator=generator)
        chunk = data[starts[:, None] + window].long()  # (batch_size, seq_len + 1)
        x = chunk[:, :-1].contiguous()
        y = chunk[:, 1:].contiguous()
        if device is not None:
            x, y = x.to(device), y.to(device)
        yield x, y


def encode(text: str) -> torch.Tensor:
    """The tokenizer: ``text``'s UTF-8 bytes as a 1-D ``torch.long`` tensor (ready to index a model)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Inverse of :func:`encode`: the text of byte values 0..255 (a 1-D tensor or a sequence),
    undecodable bytes as U+FFFD.

    Raises:
        ValueError: for a tensor of more than one dimension or a value outside 0..255.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() > 1:
            raise invalid("decode: tokens.shape", tuple(tokens.shape), "a 1-D tensor (decode rows one at a time)")
        values = tokens.reshape(-1).tolist()
    else:
        values = list(tokens)
    bad = [v for v in values if not 0 <= int(v) <= 255]
    if bad:
        raise invalid("decode: token value", bad[0], "0..255 (bytes)")
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")
