"""What every attention implementation here shares: argument checks, causal masks, grouped query heads.

Causal masks follow two conventions: top-left (SDPA's ``is_causal``: query ``i`` sees keys
``j <= i``) and bottom-right (FlashAttention >= 2.1: ``j <= i + Lk - Lq``, the last query sees
every key). Grouped-query attention (Ainslie et al. 2023, "GQA") lets query head ``h`` read kv head
``h // (Hq // Hkv)``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from memlab.core.validation import check_positive_int, invalid

__all__ = ["CAUSAL_MODES", "causal_mask", "block_mask"]
# check_attention_args, accumulation_dtype, diagonal_offset, loop_block_mask, visible_kv_end,
# first_visible_query and group_queries are the shared internals of reference, flash and triton_flash

#: the accepted values of ``causal``
CAUSAL_MODES = (False, True, "top_left", "bottom_right")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------- arguments
def _mode(where: str, causal: Any) -> str | None:
    # ``causal`` as None (no mask), "top_left" or "bottom_right"
    if causal is False or causal is None:
        return None
    if causal is True or causal == "top_left":
        return "top_left"
    if causal == "bottom_right":
        return "bottom_right"
    raise invalid(f"{where}: causal", causal, ", ".join(map(repr, CAUSAL_MODES)))


def check_attention_args(where: str, q: Any, k: Any, v: Any, causal: Any, scale: Any,
                         **blocks: Any) -> tuple[str | None, float, int]:
    """Validate q, k, v, causal, scale and each block size in ``blocks`` (name -> positive int);
    return (causal mode, scale, group size G = Hq // Hkv). ``where`` names the caller in errors."""
    for name, value in blocks.items():
        check_positive_int(f"{where}: {name}", value)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{where}: {name}.shape={tuple(t.shape)} must be 4-d (batch, heads, seq, head_dim)")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{where}: {name}.dtype={t.dtype} is not supported; allowed: "
                             f"{', '.join(str(d) for d in _DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{where}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); they must be equal")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k, v devices differ ({q.device}, {k.device}, {v.device})")
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"{where}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"{where}: k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must agree on heads and seq")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{where}: head_dim of q ({q.shape[-1]}) and k ({k.shape[-1]}) differ")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{where}: q has {q.shape[1]} heads, k/v {k.shape[1]}: the query heads must be a multiple "
                         f"of the key/value heads (GQA)")
    mode = _mode(where, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise invalid(f"{where}: scale", scale, "a finite number, or None (1/sqrt(head_dim))")
    return mode, float(scale), q.shape[1] // k.shape[1]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def diagonal_offset(mode: str | None, lq: int, lk: int) -> int:
    """Query ``i`` sees keys ``j <= i + offset``: ``lk - lq`` bottom-right, 0 top-left."""
    return lk - lq if mode == "bottom_right" else 0


def causal_mask(lq: int, lk: int, causal: Any = True, *, device: Any = None) -> torch.Tensor | None:
    """Boolean ``(lq, lk)`` mask, True where query ``i`` may see key ``j``; None when ``causal`` is False.

    ``True`` / ``"top_left"``: ``j <= i`` (SDPA's ``is_causal``); ``"bottom_right"``:
    ``j <= i + lk - lq`` (flash-attn >= 2.1). Blocks use the same rule with absolute indices.

    Raises:
        ValueError: an unknown ``causal`` or a length < 1.
    """
    mode = _mode("causal_mask", causal)
    check_positive_int("causal_mask: lq", lq)
    check_positive_int("causal_mask: lk", lk)
    return block_mask(mode, 0, lq, 0, lk, lq, lk, device)


def block_mask(mode: str | None, qs: int, qe: int, ks: int, ke: int, lq: int, lk: int,
               device: Any = None) -> torch.Tensor | None:
    """The causal mask of one block: query rows ``[qs, qe)`` against key columns ``[ks, ke)``.

    Boolean ``(qe - qs, ke - ks)``, True where the query may see the key; None when ``mode`` is None.

    Args:
        mode: None (no mask), ``"top_left"`` or ``"bottom_right"`` (as :func:`causal_mask` spells
            them after parsing ``causal``).
        qs, qe, ks, ke: the block's absolute row and column ranges, end exclusive.
        lq, lk: the whole sequence lengths of the queries and the keys (for bottom-right).
    """
    if mode is None:
        return None
    i = torch.arange(qs, qe, device=device).unsqueeze(1)
    j = torch.arange(ks, ke, device=device).unsqueeze(0)
    return j <= i + diagonal_offset(mode, lq, lk)


def loop_block_mask(mode: str | None, qs: int, qe: int, ks: int, ke: int, lq: int, lk: int,
                    device: Any) -> torch.Tensor | None:
    """The block's mask inside the loops: None also when the block lies wholly below the diagonal
    (every query sees every key of it), so most blocks of a causal matrix pay nothing for masking."""
    if mode is None or ke - 1 <= qs + diagonal_offset(mode, lq, lk):
        return None
    return block_mask(mode, qs, qe, ks, ke, lq, lk, device)


def visible_kv_end(mode: str | None, qe: int, lq: int, lk: int) -> int:
    """Keys ``[0, end)`` can be seen by query rows < qe; later key blocks are fully masked (skipped)."""
    if mode is None:
        return lk
    return max(0, min(lk, qe + diagonal_offset(mode, lq, lk)))


def first_visible_query(mode: str | None, ks: int, lq: int, lk: int) -> int:
    """The first query row that sees key ``ks``; earlier rows are fully masked for this key block."""
    if mode is None:
        return 0
    return max(0, min(lq, ks - diagonal_offset(mode, lq, lk)))


def group_queries(q: torch.Tensor, g: int) -> torch.Tensor:
    """(B, Hq, L, D) -> (B, Hkv, G, L, D): query head h = hk * G + g shares kv head hk."""
    b, h, l, d = q.shape
    return q.view(b, h // g, g, l, d)

