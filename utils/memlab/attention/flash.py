"""FlashAttention-2 in PyTorch: a ``torch.autograd.Function`` that saves only the logsumexp for backward.

Dao 2023 ("FlashAttention-2", arXiv:2307.08691, Algorithm 2): the forward is the online softmax
over key blocks; backward recomputes ``P = exp(scale * Q K^T - LSE)`` block by block, with
``D = rowsum(dO * O)``::

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q

Fully masked causal blocks are skipped in both directions.

How the loops run: the query heads of one key/value head are laid out as rows (``(B * Hkv,
Lq * G, D)``, query ``i`` of group member ``g`` at row ``i * G + g``), so every block product is one
``bmm`` over the batch and the heads; the scale is folded into the queries once; the softmax, its
rescaling and the backward's ``dS`` are computed in place on the block's scores, and the
accumulators are updated with ``baddbmm_`` (no temporaries beyond one score block and its
gradient). On a CPU the batch and heads are split between ``torch.get_num_threads()`` Python
threads, each running its share of the loops while torch's intra-op threads are held at 1
(:func:`memlab.offload.intra_op_threads`): one op on one block is too small to split again, and
split ops wait for a scheduled thread each time on a busy machine.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from memlab.attention.masks import (accumulation_dtype, check_attention_args, first_visible_query, loop_block_mask,
                                    visible_kv_end)
from memlab.offload.kernel import intra_op_threads

__all__ = ["flash_attention_forward", "flash_attention_backward", "FlashAttentionFunction", "flash_attention",
           "attention_saved_bytes"]


def _rows(x: torch.Tensor, g: int, acc: torch.dtype) -> torch.Tensor:
    # (B, Hkv * G, L, D) -> (B * Hkv, L * G, D) in acc: query i of group member j at row i * G + j
    b, h, l, d = x.shape
    x = x.to(acc)
    if g == 1:
        return x.reshape(b * h, l, d)
    return x.view(b, h // g, g, l, d).transpose(2, 3).reshape(b * (h // g), l * g, d)


def _unrows(x: torch.Tensor, b: int, h: int, g: int) -> torch.Tensor:
    # the inverse of _rows, for (B * Hkv, L * G, ...) with a trailing dim or without
    if x.dim() == 2:
        return _unrows(x.unsqueeze(-1), b, h, g).squeeze(-1)
    n, lg, d = x.shape
    if g == 1:
        return x.reshape(b, h, lg, d)
    return x.view(b, h // g, lg // g, g, d).transpose(2, 3).reshape(b, h, lg // g, d)


def _mask(mode: str | None, qs: int, qe: int, ks: int, ke: int, lq: int, lk: int, g: int, device: Any):
    # the block's causal mask over its rows (each query repeated G times), or None when all visible
    mask = loop_block_mask(mode, qs, qe, ks, ke, lq, lk, device)
    if mask is not None and g > 1:
        mask = mask.repeat_interleave(g, dim=0)
    return mask


#: multiply-adds of score blocks a CPU worker thread gets at least (a few milliseconds): below it, starting a
#: thread and waiting for it to be scheduled on a busy machine costs more than it saves
MIN_WORK_PER_THREAD = 1 << 24


def _split(n: int, device: torch.device, work: Callable[[int, int], None], per_row: int) -> None:
    # work(lo, hi) over [0, n) of the batch-and-heads dim (per_row multiply-adds each): on a CPU in up to
    # torch.get_num_threads() Python threads at one intra-op thread each, elsewhere at once
    workers = min(n, torch.get_num_threads(), n * per_row // MIN_WORK_PER_THREAD) if device.type == "cpu" else 1
    if workers <= 1:
        if device.type == "cpu":
            with intra_op_threads(1):
                work(0, n)
        else:
            work(0, n)
        return
    bounds = [n * i // workers for i in range(workers + 1)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread: the workers' in-place ops on views of q, k, v
                work(bounds[i], bounds[i + 1])
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    with intra_op_threads(1):
        pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, workers)]
        for t in pool:
            t.start()
        run(0)
        for t in pool:
            t.join()
    if errors:
        raise errors[0]


def _forward_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  mode: str | None, g: int, lq: int, block_q: int, block_k: int) -> None:
    # the online softmax on rows (q scaled): fills o (N, Lq * G, Dv) and lse (N, Lq * G)
    lk = k.shape[1]
    n = q.shape[0]
    for qs in range(0, lq, block_q):
        qe = min(lq, qs + block_q)
        r0, r1 = qs * g, qe * g
        qi, oi = q[:, r0:r1], o[:, r0:r1]
        m = torch.full((n, r1 - r0), float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros((n, r1 - r0), dtype=q.dtype, device=q.device)
        for ks in range(0, visible_kv_end(mode, qe, lq, lk), block_k):
            ke = min(lk, ks + block_k)
            s = torch.bmm(qi, k[:, ks:ke].transpose(1, 2))
            mask = _mask(mode, qs, qe, ks, ke, lq, lk, g, q.device)
            if mask is not None:
                s.masked_fill_(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # a row with no key seen yet: exp(-inf) = 0
            alpha = (m - m_safe).exp_()
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()
            l.mul_(alpha).add_(p.sum(-1))
            oi.mul_(alpha.unsqueeze(-1)).baddbmm_(p, v[:, ks:ke])
            m = m_new
        empty = l == 0
        oi.div_(l.masked_fill(empty, 1.0).unsqueeze(-1))
        lse[:, r0:r1] = torch.where(empty, float("-inf"), m.masked_fill(torch.isinf(m), 0.0) + l.log())


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
    acc = accumulation_dtype(q.dtype)
    b, h, lq, _ = q.shape
    with torch.no_grad():
        qr = _rows(q, g, acc) * scale  # a new tensor: exp(scale q k^T) as exp((scale q) k^T)
        kr, vr = _rows(k, 1, acc), _rows(v, 1, acc)
        n = qr.shape[0]
        o = torch.zeros(n, lq * g, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.empty(n, lq * g, dtype=acc, device=q.device)
        _split(n, q.device, lambda lo, hi: _forward_rows(qr[lo:hi], kr[lo:hi], vr[lo:hi], o[lo:hi], lse[lo:hi],
                                                         mode, g, lq, block_q, block_k),
               qr.shape[1] * kr.shape[1] * (qr.shape[2] + vr.shape[2]))
        return _unrows(o, b, h, g).to(q.dtype), _unrows(lse, b, h, g)


def _backward_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                   mode: str | None, g: int, lq: int, block_q: int, block_k: int) -> None:
    # FA2's loops on rows (q scaled): dq (unscaled), dk and dv accumulate in place
    lk = k.shape[1]
    for ks in range(0, lk, block_k):
        ke = min(lk, ks + block_k)
        kj, vj, dkj, dvj = k[:, ks:ke], v[:, ks:ke], dk[:, ks:ke], dv[:, ks:ke]
        first = first_visible_query(mode, ks, lq, lk) // block_q * block_q
        for qs in range(first, lq, block_q):
            qe = min(lq, qs + block_q)
            r0, r1 = qs * g, qe * g
            qi, doi = q[:, r0:r1], do[:, r0:r1]
            p = torch.bmm(qi, kj.transpose(1, 2)).sub_(lse[:, r0:r1].unsqueeze(-1)).exp_()
            mask = _mask(mode, qs, qe, ks, ke, lq, lk, g, q.device)
            if mask is not None:
                p.masked_fill_(~mask, 0.0)
            dvj.baddbmm_(p.transpose(1, 2), doi)
            ds = torch.bmm(doi, vj.transpose(1, 2)).sub_(delta[:, r0:r1].unsqueeze(-1)).mul_(p)
            dq[:, r0:r1].baddbmm_(ds, kj)
            dkj.baddbmm_(ds.transpose(1, 2), qi)


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
    mode, scale, g = check_attention_args("flash_attention_backward", q, k, v, causal, scale,
                                          block_q=block_q, block_k=block_k)
    acc = accumulation_dtype(q.dtype)
    b, h, lq, d = q.shape
    with torch.no_grad():
        qr = _rows(q, g, acc) * scale  # dK = scale * dS^T Q = dS^T (scale Q)
        dor = _rows(do, g, acc)
        lser = _rows(lse.unsqueeze(-1), g, acc).squeeze(-1)
        lser = lser.masked_fill(torch.isinf(lser) & (lser < 0), float("inf"))  # empty rows: P = 0
        delta = (dor * _rows(o, g, acc)).sum(-1)  # D = rowsum(dO * O)
        kr, vr = _rows(k, 1, acc), _rows(v, 1, acc)
        n = qr.shape[0]
        dq = torch.zeros_like(qr)
        dk, dv = torch.zeros_like(kr), torch.zeros_like(vr)
        _split(n, q.device, lambda lo, hi: _backward_rows(qr[lo:hi], kr[lo:hi], vr[lo:hi], dor[lo:hi], lser[lo:hi],
                                                          delta[lo:hi], dq[lo:hi], dk[lo:hi], dv[lo:hi], mode, g, lq,
                                                          block_q, block_k),
               2 * qr.shape[1] * kr.shape[1] * (qr.shape[2] + vr.shape[2]))
        dq.mul_(scale)  # dQ = scale * dS K
        return (_unrows(dq, b, h, g).to(q.dtype), dk.reshape(k.shape).to(k.dtype),
                dv.reshape(v.shape).to(v.dtype))
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
