"""FlashAttention-2 as Triton kernels, at module level (imported lazily: importing this imports triton).

CPU tensors run in Triton's interpreter, which is chosen when triton is first imported: this module
sets ``TRITON_INTERPRET=1`` itself when no CUDA device is present and triton is not imported yet.

:func:`flash_fwd_kernel` is lab 05's exercise ``05.triton_forward`` (memlab's answer): one program
per (query block, batch x head), the online softmax over key blocks, writing O in O's dtype and the
logsumexp in fp32. Causal is bottom-right aligned: query ``i`` sees keys ``j <= i + Lk - Lq``
(FlashAttention >= 2.1, ``torch.nn.attention.bias.causal_lower_right``; for ``Lq == Lk`` the same
as SDPA's ``is_causal``, which is top-left aligned). The kernels behind
:func:`memlab.attention.triton_flash_attention` (GQA, any head dim, backward) are ``fwd``,
``bwd_dq`` and ``bwd_dkdv`` below (Dao 2023, "FlashAttention-2", arXiv:2307.08691).
"""
from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["flash_fwd_kernel", "launch_flash_fwd", "fwd", "bwd_dq", "bwd_dkdv"]


@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                     H, Lq, Lk, scale,
                     CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes O[b, h, rows] and LSE[b, h, rows] for one block of BLOCK_M query rows
    (grid: (cdiv(Lq, BLOCK_M), B * H)).

    Args:
        Q, K, V, O, LSE: pointers to q ``(B, H, Lq, D)``, k and v ``(B, H, Lk, D)``, the output like
            q, and the logsumexp ``(B, H, Lq)`` (contiguous fp32).
        sqb, sqh, sqm, sqd, ...: the element strides of q, k, v and o (batch, head, row, dim).
        H, Lq, Lk: heads and sequence lengths.
        scale: the score scale.
        CAUSAL, D, BLOCK_M, BLOCK_N: compile-time: bottom-right causal mask, head dim (a power of
            two), query rows per program, keys per loop step.
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=rows[:, None] < Lq, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offset = Lk - Lq
    end = Lk
    if CAUSAL:  # key blocks right of this query block's last row are fully masked: never loaded
        end = tl.minimum(Lk, (pid_m + 1) * BLOCK_M + offset)
    for start in range(0, end, BLOCK_N):
        cols = start + cols0
        kt = tl.load(K + b * skb + h * skh + cols[None, :] * skn + dims[:, None] * skd, mask=cols[None, :] < Lk,
                     other=0.0)
        s = tl.dot(q, kt) * scale
        ok = cols[None, :] < Lk
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no -inf - -inf
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        vv = tl.load(V + b * svb + h * svh + cols[:, None] * svn + dims[None, :] * svd, mask=cols[:, None] < Lk,
                     other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m = m_new
    l_safe = tl.where(l == 0.0, 1.0, l)  # a row that saw no key (bottom-right, Lq > Lk): O = 0, LSE = -inf
    tl.store(O + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod, acc / l_safe[:, None],
             mask=rows[:, None] < Lq)
    tl.store(LSE + bh * Lq + rows, m + tl.log(l), mask=rows < Lq)


# ----------------------------------------------------------------------------- memlab.attention.triton_flash_attention's kernels
# (GQA: query head h reads kv head h // G; head dims padded to powers of two BD, BDV; PREC: tl.dot precision)
@triton.jit
def fwd(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
        H, G, Lq, Lk, D, Dv, scale, offset,
        CAUSAL: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """The forward of one block of BM query rows (grid: (cdiv(Lq, BM), B * H)). Writes O and LSE.

    Args:
        Q, K, V, O, LSE: pointers to q, k, v (contiguous in their last dim), the output, the fp32 logsumexp.
        sqb, sqh, sqm, skb, ...: the batch, head and row strides of q, k, v and o.
        H, G, Lq, Lk, D, Dv: query heads, GQA group size (query head h reads kv head h // G),
            lengths, head dims (padded to the powers of two BD, BDV).
        scale, offset: the score scale; the causal diagonal's offset (``Lk - Lq`` bottom-right, 0 top-left).
        CAUSAL, PREC, BM, BN, BD, BDV: compile-time: causal mask, ``tl.dot`` precision, block sizes.
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :],
                mask=(rm[:, None] < Lq) & (rd[None, :] < D), other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    hi = Lk
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Lk, (pid_m + 1) * BM + offset), 0)
    for start in range(0, hi, BN):
        cn = start + rn
        kt = tl.load(K + b * skb + hk * skh + cn[None, :] * skn + rd[:, None],
                     mask=(cn[None, :] < Lk) & (rd[:, None] < D), other=0.0)
        s = tl.dot(q, kt, input_precision=PREC) * scale
        ok = (cn[None, :] < Lk) & (rm[:, None] >= 0)
        if CAUSAL:
            ok = ok & (cn[None, :] <= rm[:, None] + offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(V + b * svb + hk * svh + cn[:, None] * svn + rdv[None, :],
                     mask=(cn[:, None] < Lk) & (rdv[None, :] < Dv), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + rm[:, None] * som + rdv[None, :], out.to(O.dtype.element_ty),
             mask=(rm[:, None] < Lq) & (rdv[None, :] < Dv))
    lse = tl.where(empty, float("-inf"), m_fin + tl.log(l_safe))
    tl.store(LSE + bh * Lq + rm, lse, mask=rm < Lq)

@triton.jit
def bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
           H, G, Lq, Lk, D, Dv, scale, offset,
           CAUSAL: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """Writes dQ of one block of BM query rows, looping over key blocks (grid: (cdiv(Lq, BM), B * H)).

    Args:
        Q, K, V, DO, LSE, DELTA, DQ: pointers to q, k, v, dO (contiguous), the logsumexp,
            ``D = rowsum(dO * O)`` and the fp32 dq (contiguous).
        sqb, sqh, sqm, skb, ...: the batch, head and row strides of q, k and v.
        H, G, Lq, Lk, D, Dv, scale, offset, CAUSAL, PREC, BM, BN, BD, BDV: as :func:`fwd`.
    """
    # DO and DQ are contiguous: (B, H, Lq, Dv) and (B, H, Lq, D)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    mrow = rm < Lq
    q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :],
                mask=mrow[:, None] & (rd[None, :] < D), other=0.0)
    do = tl.load(DO + bh * Lq * Dv + rm[:, None] * Dv + rdv[None, :],
                 mask=mrow[:, None] & (rdv[None, :] < Dv), other=0.0)
    lse = tl.load(LSE + bh * Lq + rm, mask=mrow, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + bh * Lq + rm, mask=mrow, other=0.0)
    dq = tl.zeros([BM, BD], tl.float32)
    hi = Lk
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Lk, (pid_m + 1) * BM + offset), 0)
    for start in range(0, hi, BN):
        cn = start + rn
        kk = tl.load(K + b * skb + hk * skh + cn[:, None] * skn + rd[None, :],
                     mask=(cn[:, None] < Lk) & (rd[None, :] < D), other=0.0)
        vt = tl.load(V + b * svb + hk * svh + cn[None, :] * svn + rdv[:, None],
                     mask=(cn[None, :] < Lk) & (rdv[:, None] < Dv), other=0.0)
        s = tl.dot(q, tl.trans(kk), input_precision=PREC) * scale
        ok = (cn[None, :] < Lk) & mrow[:, None]
        if CAUSAL:
            ok = ok & (cn[None, :] <= rm[:, None] + offset)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kk.dtype), kk, input_precision=PREC) * scale
    tl.store(DQ + bh * Lq * D + rm[:, None] * D + rd[None, :], dq,
             mask=mrow[:, None] & (rd[None, :] < D))

@triton.jit
def bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
             H, HK, G, Lq, Lk, D, Dv, scale, offset,
             CAUSAL: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """dK and dV of one block of BN keys of one kv head, looping over its G query heads and the
    query blocks that can see it (grid: (cdiv(Lk, BN), B * HK)). Writes DK and DV.

    Args:
        Q, K, V, DO, LSE, DELTA, DK, DV: as :func:`bwd_dq`, with the fp32 dk and dv (contiguous).
        HK: key/value heads; the other arguments as :func:`bwd_dq`.
        H, G, Lq, Lk, D, Dv, scale, offset, CAUSAL, PREC, BM, BN, BD, BDV: as :func:`fwd`.
    """
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    cn = pid_n * BN + tl.arange(0, BN)
    rm0 = tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    mcol = cn < Lk
    kk = tl.load(K + b * skb + hk * skh + cn[:, None] * skn + rd[None, :],
                 mask=mcol[:, None] & (rd[None, :] < D), other=0.0)
    vv = tl.load(V + b * svb + hk * svh + cn[:, None] * svn + rdv[None, :],
                 mask=mcol[:, None] & (rdv[None, :] < Dv), other=0.0)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    lo = 0
    if CAUSAL:
        lo = tl.minimum(tl.maximum(pid_n * BN - offset, 0), Lq) // BM * BM
    for g in range(0, G):
        h = hk * G + g
        bh = b * H + h
        for start in range(lo, Lq, BM):
            rm = start + rm0
            mrow = rm < Lq
            q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :],
                        mask=mrow[:, None] & (rd[None, :] < D), other=0.0)
            do = tl.load(DO + bh * Lq * Dv + rm[:, None] * Dv + rdv[None, :],
                         mask=mrow[:, None] & (rdv[None, :] < Dv), other=0.0)
            lse = tl.load(LSE + bh * Lq + rm, mask=mrow, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
            delta = tl.load(DELTA + bh * Lq + rm, mask=mrow, other=0.0)
            s = tl.dot(q, tl.trans(kk), input_precision=PREC) * scale  # [BM, BN]
            ok = mcol[None, :] & mrow[:, None]
            if CAUSAL:
                ok = ok & (cn[None, :] <= rm[:, None] + offset)
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) * scale
    tl.store(DK + bhk * Lk * D + cn[:, None] * D + rd[None, :], dk, mask=mcol[:, None] & (rd[None, :] < D))
    tl.store(DV + bhk * Lk * Dv + cn[:, None] * Dv + rdv[None, :], dv,
             mask=mcol[:, None] & (rdv[None, :] < Dv))


def launch_flash_fwd(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     block_m: int = 16, block_n: int = 16, out: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a kernel with :func:`flash_fwd_kernel`'s signature on (B, H, L, D) tensors of any strides.

    Args:
        kernel: a ``@triton.jit`` kernel with :func:`flash_fwd_kernel`'s signature (the lab's answer or memlab's).
        q, k, v: ``(B, H, L, D)`` tensors, D a power of two >= 16.
        causal: bottom-right causal mask.
        out: where to write the output (any strides); None makes one.

    Returns:
        (O, LSE): O like q (or ``out``), LSE ``(B, H, Lq)`` fp32.
    """
    b, h, lq, d = q.shape
    lk = k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(lq, block_m), b * h)
    kernel[grid](q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), h, lq, lk, d ** -0.5,
                 CAUSAL=bool(causal), D=d, BLOCK_M=block_m, BLOCK_N=block_n)
    return o, lse
