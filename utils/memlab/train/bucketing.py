"""Length bucketing: batches of sequences of similar length, so that padding wastes little memory."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from memlab.core.validation import check_positive_int

__all__ = ["random_batches", "bucket_batches", "padding_stats", "pad_batch"]


def _check_lengths(lengths: Any) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    try:
        out = [int(n) for n in lengths]
    except (TypeError, ValueError):
        raise ValueError(f"lengths={str(lengths)[:60]!r} is invalid; allowed: a sequence of ints >= 1") from None
    bad = [n for n in out if n < 1]
    if bad or not out:
        raise ValueError(f"lengths: {'empty' if not out else f'length {bad[0]}'} is invalid; allowed: a non-empty "
                         "sequence of ints >= 1")
    return out


def random_batches(lengths: Sequence[int], batch_size: int, *, seed: int = 0) -> list[list[int]]:
    """Random batching, the baseline bucketing is compared with: the indices of ``lengths`` (ints >= 1)
    shuffled and cut into batches of ``batch_size`` (the last may be short).

    Raises:
        ValueError: naming a bad ``lengths`` or ``batch_size``.
    """
    n = len(_check_lengths(lengths))
    check_positive_int("batch_size", batch_size)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def bucket_batches(lengths: Sequence[int], batch_size: int, *, pool: int | None = None, seed: int = 0,
                   shuffle: bool = True) -> list[list[int]]:
    """Batches of indices whose sequences have similar lengths, so that padding to the longest wastes little.

    Shuffle the indices (``seed``), take pools of ``pool`` batches (``None``: the whole data set),
    sort each pool by length (stable) and cut it into batches of ``batch_size``; then shuffle the
    order of the batches, so that training does not see lengths in order. Smaller pools keep more
    randomness and save less padding. Every index appears exactly once.

    Args:
        lengths: each sequence's length (ints >= 1).
        shuffle: shuffle the indices before and the batches after (False: sorted, in order).

    Raises:
        ValueError: naming a bad ``lengths``, ``batch_size`` or ``pool``.
    """
    lens = _check_lengths(lengths)
    check_positive_int("batch_size", batch_size)
    if pool is not None:
        check_positive_int("pool", pool)
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
    size = n if pool is None else pool * batch_size
    out: list[list[int]] = []
    for start in range(0, n, size):
        chunk = sorted(order[start:start + size], key=lambda i: lens[i])
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    if shuffle:
        out = [out[i] for i in torch.randperm(len(out), generator=g).tolist()]
    return out


def padding_stats(lengths: Sequence[int], batches: Sequence[Sequence[int]], *, bytes_per_token: int = 1) -> dict[str, Any]:
    """Tokens, padded slots and padding bytes when each batch is padded to its longest sequence.

    Args:
        batches: batches of indices into ``lengths``, every index exactly once.
        bytes_per_token: the bytes one token position costs in whatever you pad (1 for the ids
            counted as tokens; the activation bytes per token of a model for its activations).

    Returns:
        ``{"tokens", "slots", "padding", "padding_fraction", "padding_bytes"}``.

    Raises:
        ValueError: an index is missing or repeated.
    """
    lens = _check_lengths(lengths)
    seen: list[int] = [i for b in batches for i in b]
    if sorted(seen) != list(range(len(lens))):
        raise ValueError("batches: every index 0..len(lengths)-1 must appear exactly once")
    tokens = sum(lens)
    slots = sum(len(b) * max(lens[i] for i in b) for b in batches if len(b))
    return {"tokens": tokens, "slots": slots, "padding": slots - tokens, "padding_fraction": (slots - tokens) / slots,
            "padding_bytes": (slots - tokens) * bytes_per_token}


def pad_batch(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D token tensors (at least one) to the longest with ``pad_id``.

    Returns:
        ``(ids, mask)``: ``(B, T)`` long ids and a ``(B, T)`` bool mask, True on real tokens.
    """
    if not seqs:
        raise ValueError("seqs: empty; allowed: a non-empty sequence of 1-D tensors")
    T = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :s.numel()] = s.reshape(-1)
        mask[i, :s.numel()] = True
    return ids, mask
