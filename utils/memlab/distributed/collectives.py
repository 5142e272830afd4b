"""Flat buffers cut into one equal shard per rank, and the two collectives that move them.

A buffer of P elements is padded to ``N * S`` elements, ``S = ceil(P / N)``, so that it splits into
N equal contiguous pieces: what ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` need (ZeRO,
Rajbhandari et al. 2020, sec. 5; PyTorch's FSDP1 flat parameters do the same).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from memlab.core.validation import check_int, check_positive_int, invalid

__all__ = ["padded_size", "shard_range", "shard_flat", "gather_flat", "reduce_scatter_flat", "all_gather_flat"]


def padded_size(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``, so that every rank gets an equal shard.

    Raises:
        ValueError: ``world_size`` is not an int >= 1.
    """
    check_positive_int("world_size", world_size)
    return -(-int(numel) // world_size) * world_size


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Where ``rank``'s contiguous shard lies in a flat buffer of ``numel`` elements padded to
    :func:`padded_size`: ``(start, stop)``; with ``S = ceil(numel / world_size)``, rank ``r`` owns
    ``[r S, (r+1) S)``.

    Raises:
        ValueError: a rank or world size out of range.
    """
    check_positive_int("world_size", world_size)
    check_int("rank", rank, minimum=0, maximum=world_size - 1)
    s = padded_size(numel, world_size) // world_size
    return rank * s, (rank + 1) * s


def shard_flat(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of a 1-D tensor: the ``rank``-th of ``world_size`` equal contiguous pieces.

    ``flat`` is zero-padded to a multiple of ``world_size``; the shard is a view of ``flat`` when no
    padding was needed, else a piece of a padded copy.

    Raises:
        ValueError: ``flat`` is not 1-D; a rank or world size out of range.
    """
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError(f"flat={type(flat).__name__}{tuple(getattr(flat, 'shape', ()))} is invalid; "
                         f"allowed: a 1-D tensor")
    a, b = shard_range(flat.numel(), rank, world_size)
    pad = padded_size(flat.numel(), world_size) - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat[a:b]


def gather_flat(shards: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """The flat buffer back from every rank's shard (in rank order): what an all-gather followed by
    ``[:numel]`` gives, the padding dropped.

    Raises:
        ValueError: no shards, or fewer than ``numel`` elements in them.
    """
    if not shards:
        raise invalid("shards", shards, "one shard per rank")
    full = torch.cat([s.reshape(-1) for s in shards])
    if full.numel() < numel:
        raise invalid("numel", numel, f"at most the {full.numel()} elements of the shards")
    return full[:numel]


# torch 2.13 names the tensor forms *_single; older releases only have *_tensor / *_into_tensor
def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def reduce_scatter_flat(flat: torch.Tensor, group: Any = None, average: bool = True) -> torch.Tensor:
    """This rank's shard of the sum (or mean) of every rank's ``flat``: one reduce-scatter.

    Args:
        flat: this rank's 1-D buffer, its length a multiple of the world size (:func:`padded_size`).
        average: divide the sum by the world size (gloo has no AVG: SUM, then divide).

    Returns:
        A new tensor of ``len(flat) / world_size`` elements.

    Raises:
        ValueError: ``flat`` is not 1-D or its length not a multiple of the world size.
    """
    ws = dist.get_world_size(group)
    if flat.dim() != 1 or flat.numel() % ws:
        raise ValueError(f"flat of shape {tuple(flat.shape)} is invalid; allowed: 1-D with a length that is a multiple "
                         f"of the world size {ws} (pad it: padded_size)")
    out = flat.new_empty(flat.numel() // ws)
    _reduce_scatter(out, flat, group)
    if average:
        out.div_(ws)
    return out


def all_gather_flat(shard: torch.Tensor, group: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``shard`` (all of one size) concatenated in rank order: one all-gather, into ``out``
    (``world_size * shard.numel()`` elements) or a new buffer, which is returned."""
    ws = dist.get_world_size(group)
    if out is None:
        out = shard.new_empty(shard.numel() * ws)
    _all_gather(out, shard.contiguous(), group)
    return out
