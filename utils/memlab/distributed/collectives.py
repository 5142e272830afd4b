"""Flat buffers cut into one equal shard per rank, and the two collectives that move them.

A buffer of P elements is padded to ``N * S`` elements, ``S = ceil(P / N)``, so that it splits into
N equal contiguous pieces (ZeRO, Rajbhandari et al. 2020, sec. 5; PyTorch's FSDP1 flat parameters do
the same). The reduce-scatter is one ``reduce`` of each piece to its owner, the all-gather one
``broadcast`` of each owner's piece into its view of the flat buffer: the same bytes as ring
collectives, ``(N - 1) S`` elements per rank each, without the whole-buffer copies that gloo's
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` allocate inside themselves.
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


def _global(group: Any, r: int) -> int:
    # rank r of ``group`` as the default group numbers it (what src= and dst= take)
    return dist.get_global_rank(group, r) if group is not None else r


def _check_flat(flat: Any, ws: int) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() % ws or not flat.is_contiguous():
        raise invalid("flat", f"{type(flat).__name__}{tuple(getattr(flat, 'shape', ()))}",
                      f"a contiguous 1-D tensor whose length is a multiple of the world size {ws} (pad it: padded_size)")


def reduce_scatter_flat(flat: torch.Tensor, group: Any = None, average: bool = True, *,
                        in_place: bool = False) -> torch.Tensor:
    """This rank's shard of the sum (or mean) of every rank's ``flat``: a reduce-scatter, written as one
    ``dist.reduce`` of each ``S``-element piece to the rank that owns it.

    Why not ``dist.reduce_scatter_tensor``: gloo implements it by cloning the whole input and
    all-reducing the clone (P + S elements allocated inside the op, where no tensor tracker sees
    them). Reduces to each owner send the same bytes, ``(N - 1) S`` per rank, as a ring
    reduce-scatter does (Rajbhandari et al. 2020, sec. 7), and gloo's reduce works in the buffer it
    is given.

    Args:
        flat: this rank's contiguous 1-D buffer, its length a multiple of the world size (:func:`padded_size`).
        average: divide the sum by the world size (gloo has no AVG: SUM, then divide).
        in_place: reduce each piece in ``flat`` itself and return the view of this rank's piece: nothing
            is allocated, and the pieces this rank does not own are left as the reduce leaves them
            (partial sums: scratch). Otherwise ``flat`` is left unchanged and the result is a new tensor
            (S elements, plus one S-element scratch buffer for the pieces sent to other ranks).

    Returns:
        ``S = len(flat) / world_size`` elements: this rank's piece of the sum (or mean).

    Raises:
        ValueError: ``flat`` is not contiguous and 1-D, or its length is not a multiple of the world size.
    """
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_flat(flat, ws)
    S = flat.numel() // ws
    mine = flat[rank * S:(rank + 1) * S]
    if in_place:
        for r in range(ws):
            dist.reduce(flat[r * S:(r + 1) * S], dst=_global(group, r), op=dist.ReduceOp.SUM, group=group)
    else:
        mine = mine.clone()
        scratch = flat.new_empty(S) if ws > 1 else None  # gloo's reduce writes partial sums into a sender's buffer
        for r in range(ws):
            buf = mine if r == rank else scratch.copy_(flat[r * S:(r + 1) * S])
            dist.reduce(buf, dst=_global(group, r), op=dist.ReduceOp.SUM, group=group)
    if average:
        mine.div_(ws)
    return mine


def all_gather_flat(shard: torch.Tensor, group: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``shard`` (all of one size) concatenated in rank order, into ``out``
    (``world_size * shard.numel()`` elements) or a new buffer, which is returned.

    Written as one ``dist.broadcast`` per rank, each owner's shard sent into its view of ``out``:
    gloo's ``all_gather_into_tensor`` allocates a whole flat copy of the output inside the op (and
    the caller usually a copy of its shard, since input and output overlap). Here nothing is
    allocated but ``out`` when it is not given: pass ``shard=out[r S:(r + 1) S]`` (this rank's piece
    of ``out``) and the gather is in place. Each rank sends its shard once to the N - 1 others,
    ``(N - 1) S`` elements per rank, as a ring all-gather does.

    Raises:
        ValueError: ``out`` is not a contiguous 1-D tensor of ``world_size * shard.numel()`` elements
            of the shard's dtype and device.
    """
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    S = shard.numel()
    if out is None:
        out = shard.new_empty(S * ws)
    elif (not isinstance(out, torch.Tensor) or out.dim() != 1 or out.numel() != S * ws or not out.is_contiguous()
          or out.dtype != shard.dtype or out.device != shard.device):
        raise invalid("out", f"{type(out).__name__}{tuple(getattr(out, 'shape', ()))}",
                      f"a contiguous 1-D {shard.dtype} tensor of world_size x shard = {ws} x {S} elements on {shard.device}")
    mine = out[rank * S:(rank + 1) * S]
    if not (shard.data_ptr() == mine.data_ptr() and shard.is_contiguous() and shard.dim() == 1):
        mine.copy_(shard.reshape(-1))  # not already this rank's piece of out
    for r in range(ws):
        dist.broadcast(out[r * S:(r + 1) * S], src=_global(group, r), group=group)
    return out
