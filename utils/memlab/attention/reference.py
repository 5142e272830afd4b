"""Attention written plainly: the whole score matrix (naive), and query/key chunks with the online softmax.

The online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
arXiv:1805.02867) keeps per query row a running max ``m``, denominator ``l`` and unnormalised
output ``acc``; after key block ``j`` with scores ``S_j``::

    m' = max(m, rowmax(S_j))
    l' = l * exp(m - m') + rowsum(exp(S_j - m'))
    acc' = acc * exp(m - m') + exp(S_j - m') V_j          and at the end  O = acc / l,
    LSE = m + log(l)

Chunking queries and keys this way follows Rabe & Staats 2021 ("Self-attention does not need
O(n^2) memory", arXiv:2112.05682). Through autograd it still keeps every block's probabilities.
"""
from __future__ import annotations

from typing import Any

import torch

from memlab.attention.masks import (accumulation_dtype, block_mask, check_attention_args, group_queries,
                                    loop_block_mask, visible_kv_end)

__all__ = ["sdpa_reference", "naive_attention", "merge_partials", "chunked_attention"]


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                   scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with memlab's options (bottom-right as a boolean mask).

    Arguments and errors as :func:`naive_attention`; GQA by repeating k and v.
    """
    import torch.nn.functional as F

    mode, scale, g = check_attention_args("sdpa_reference", q, k, v, causal, scale)
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if mode == "bottom_right":
        mask = block_mask(mode, 0, q.shape[2], 0, k.shape[2], q.shape[2], k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=mode == "top_left", scale=scale)


# ----------------------------------------------------------------------------- naive
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                    scale: float | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` with the whole ``Lq x Lk`` matrix (the baseline).

    Args:
        q: queries ``(B, Hq, Lq, D)``.
        k: keys ``(B, Hkv, Lk, D)``, ``Hq`` a multiple of ``Hkv`` (GQA).
        v: values ``(B, Hkv, Lk, Dv)``.
        causal: False, True / ``"top_left"`` or ``"bottom_right"``.
        scale: the score scale; None is ``1 / sqrt(D)``.

    Returns:
        ``(B, Hq, Lq, Dv)`` in q's dtype, computed in fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError: a tensor of the wrong rank, dtype, device or shape, or a bad option.
    """
    mode, scale, g = check_attention_args("naive_attention", q, k, v, causal, scale)
    acc = accumulation_dtype(q.dtype)
    lq, lk = q.shape[2], k.shape[2]
    s = torch.einsum("bhgqd,bhkd->bhgqk", group_queries(q, g).to(acc), k.to(acc)) * scale
    mask = block_mask(mode, 0, lq, 0, lk, lq, lk, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
        empty = ~mask.any(-1, keepdim=True)  # rows that see no key: output 0, like SDPA
        s = s.masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        p = p.masked_fill(empty, 0.0)
    o = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(acc))
    return o.reshape(q.shape[0], q.shape[1], lq, v.shape[-1]).to(q.dtype)


# ----------------------------------------------------------------------------- online softmax
def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial results over disjoint key sets into one.

    ``o_i`` (..., L, D) is the softmax-weighted output over key set ``i``, ``lse_i`` (..., L) its
    logsumexp. The merged ``lse = log(exp(lse1) + exp(lse2))`` and
    ``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``. Rows with ``lse = -inf`` (no key) weigh 0.
    Returns ``(o, lse)`` over the union of the two key sets.
    """
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return w1 * o1 + w2 * o2, lse


def online_softmax_forward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str | None, scale: float,
                           q_chunk: int, kv_chunk: int, lq: int, lk: int) -> tuple[list, list]:
    """The online softmax over key blocks on grouped queries ``(B, Hkv, G, Lq, D)``, used by
    :func:`chunked_attention` (the flash forward has its own batched loop); per query chunk, the output and
    logsumexp (acc dtype)."""
    acc = accumulation_dtype(q5.dtype)
    outs, lses = [], []
    for qs in range(0, lq, q_chunk):
        qe = min(lq, qs + q_chunk)
        qi = q5[..., qs:qe, :].to(acc)
        shape = qi.shape[:-1]
        m = torch.full(shape, float("-inf"), dtype=acc, device=q5.device)
        l = torch.zeros(shape, dtype=acc, device=q5.device)
        o = torch.zeros(*shape, v.shape[-1], dtype=acc, device=q5.device)
        for ks in range(0, visible_kv_end(mode, qe, lq, lk), kv_chunk):
            ke = min(lk, ks + kv_chunk)
            s = torch.einsum("bhgqd,bhkd->bhgqk", qi, k[:, :, ks:ke].to(acc)) * scale
            mask = loop_block_mask(mode, qs, qe, ks, ke, lq, lk, q5.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            # the running max only stabilises exp(); the result does not depend on it: no gradient
            m_new = torch.maximum(m, s.detach().amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            l = l * alpha + p.sum(-1)
            o = o * alpha.unsqueeze(-1) + torch.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, ks:ke].to(acc))
            m = m_new
        empty = l == 0
        l_safe = torch.where(empty, torch.ones_like(l), l)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        outs.append(o / l_safe.unsqueeze(-1))
        lses.append(torch.where(empty, torch.full_like(l, float("-inf")), m_safe + torch.log(l_safe)))
    return outs, lses


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                      scale: float | None = None, q_chunk: int = 128, kv_chunk: int = 128,
                      return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention by query chunks and key chunks with the online softmax, in plain PyTorch.

    Differentiable through autograd, which keeps every block's probabilities for backward, so in
    training it keeps as much as :func:`naive_attention` (see :func:`attention_saved_bytes`).

    Arguments as :func:`naive_attention`, plus ``q_chunk`` query rows and ``kv_chunk`` keys per
    chunk. With ``return_lse`` returns (output, logsumexp ``(B, Hq, Lq)`` in the accumulation dtype).

    Raises:
        ValueError: as :func:`naive_attention`, or a block size < 1.
    """
    mode, scale, g = check_attention_args("chunked_attention", q, k, v, causal, scale,
                                          q_chunk=q_chunk, kv_chunk=kv_chunk)
    b, h, lq, _ = q.shape
    outs, lses = online_softmax_forward(group_queries(q, g), k, v, mode, scale, q_chunk, kv_chunk, lq, k.shape[2])
    o = torch.cat(outs, dim=-2).reshape(b, h, lq, v.shape[-1]).to(q.dtype)
    if return_lse:
        return o, torch.cat(lses, dim=-1).reshape(b, h, lq)
    return o

