"""FlashAttention-2 in PyTorch: a ``torch.autograd.Function`` that saves only the logsumexp for backward.

Dao 2023 ("FlashAttention-2", arXiv:2307.08691, Algorithm 2): the forward is the online softmax
over key blocks; backward recomputes ``P = exp(scale * Q K^T - LSE)`` block by block, with
``D = rowsum(dO * O)``::

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q

Fully masked causal blocks are skipped in both directions.
"""
from __future__ import annotations

from typing import Any

import torch

from memlab.attention.masks import (accumulation_dtype, check_attention_args, first_visible_query, group_queries,
                                    loop_block_mask)
from memlab.attention.reference import online_softmax_forward

__all__ = ["flash_attention_forward", "flash_attention_backward", "FlashAttentionFunction", "flash_attention",
           "attention_saved_bytes"]


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                            scale: float | None = None, block_q: int = 128, block_k: int = 128
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blockwise forward without autograd (the online softmax over key blocks).

    Arguments as :func:`~memlab.attention.naive_attention`, plus ``block_q`` query rows and
    ``block_k`` keys per block. Returns (output ``(B, Hq, Lq, Dv)`` in q's dtype, logsumexp
    ``(B, Hq, Lq)`` in the accumulation dtype).

    Raises:
        ValueError: as :func:`~memlab.attention.naive_attention`, or a block size < 1.
    """
    mode, scale, g = check_attention_args("flash_attention_forward", q, k, v, causal, scale,
                                          block_q=block_q, block_k=block_k)
    b, h, lq, _ = q.shape
    with torch.no_grad():
        outs, lses = online_softmax_forward(group_queries(q, g), k, v, mode, scale, block_q, block_k, lq, k.shape[2])
        o = torch.cat(outs, dim=-2).reshape(b, h, lq, v.shape[-1]).to(q.dtype)
        return o, torch.cat(lses, dim=-1).reshape(b, h, lq)


def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             o: torch.Tensor, lse: torch.Tensor, *, causal: Any = False,
                             scale: float | None = None, block_q: int = 128, block_k: int = 128
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA2 Algorithm 2: the gradients from q, k, v, o and the logsumexp, recomputing P block by block.

    ``do`` is the output's gradient, ``o`` and ``lse`` ``(B, Hq, Lq)`` the forward's output and
    logsumexp; the rest as :func:`flash_attention_forward`. Returns ``(dq, dk, dv)`` in the dtypes
    of q, k and v.

    Raises:
        ValueError: as :func:`~memlab.attention.naive_attention`.
    """
    mode, scale, g = check_attention_args("flash_attention_backward", q, k, v, causal, scale)
    acc = accumulation_dtype(q.dtype)
    b, h, lq, d = q.shape
    lk = k.shape[2]
    q5, do5 = group_queries(q, g), group_queries(do, g)
    lse5 = group_queries(lse.unsqueeze(-1), g).squeeze(-1).to(acc)
    lse5 = torch.where(torch.isinf(lse5) & (lse5 < 0), torch.full_like(lse5, float("inf")), lse5)  # empty rows: P = 0
    delta = (do5.to(acc) * group_queries(o, g).to(acc)).sum(-1)  # D = rowsum(dO * O)
    dq = torch.zeros(q5.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for ks in range(0, lk, block_k):
        ke = min(lk, ks + block_k)
        kj, vj = k[:, :, ks:ke].to(acc), v[:, :, ks:ke].to(acc)
        first = first_visible_query(mode, ks, lq, lk) // block_q * block_q
        for qs in range(first, lq, block_q):
            qe = min(lq, qs + block_q)
            qi, doi = q5[..., qs:qe, :].to(acc), do5[..., qs:qe, :].to(acc)
            s = torch.einsum("bhgqd,bhkd->bhgqk", qi, kj) * scale
            p = torch.exp(s - lse5[..., qs:qe].unsqueeze(-1))
            mask = loop_block_mask(mode, qs, qe, ks, ke, lq, lk, q.device)
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv[:, :, ks:ke] += torch.einsum("bhgqk,bhgqd->bhkd", p, doi)
            dp = torch.einsum("bhgqd,bhkd->bhgqk", doi, vj)
            ds = p * (dp - delta[..., qs:qe].unsqueeze(-1))
            dq[..., qs:qe, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kj) * scale
            dk[:, :, ks:ke] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qi) * scale
    return dq.reshape(b, h, lq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, the output and the logsumexp; backward recomputes P blockwise (FA2)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k):  # type: ignore[override]
        o, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.opts = dict(causal=causal, scale=scale, block_q=block_q, block_k=block_k)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):  # type: ignore[override]
        # the logsumexp's gradient is ignored; None per option
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, **ctx.opts)
        return dq, dk, dv, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                    scale: float | None = None, block_q: int = 128, block_k: int = 128,
                    return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 in PyTorch: saves O(seq) for backward (q, k, v, output, logsumexp).

    Arguments as :func:`flash_attention_forward`; with ``return_lse`` returns (output, logsumexp),
    the logsumexp not differentiable.

    Raises:
        ValueError: as :func:`~memlab.attention.naive_attention`, or a block size < 1.
    """
    check_attention_args("flash_attention", q, k, v, causal, scale, block_q=block_q, block_k=block_k)
    o, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, block_q, block_k)
    return (o, lse) if return_lse else o


def attention_saved_bytes(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> int:
    """Bytes ``fn(q, k, v, **kwargs)`` saves for backward beyond q, k and v themselves (each storage
    once), counted by :func:`memlab.accounting.saved_activation_bytes`; q must need grad."""
    from memlab.accounting import saved_activation_bytes

    return saved_activation_bytes(fn, q, k, v, exclude=[q, k, v], **kwargs)
