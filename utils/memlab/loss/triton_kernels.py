"""Fused linear + cross-entropy as Triton kernels, at module level (imported lazily: importing this imports triton).

CPU tensors run in Triton's interpreter, which is chosen when triton is first imported: this module
sets ``TRITON_INTERPRET=1`` itself when no CUDA device is present and triton is not imported yet.

* :func:`lce_fwd`: one program per block of ``BM`` tokens; it walks the vocabulary in blocks of
  ``BV``, computes each ``BM x BV`` logits tile ``h W^T (+ b)`` (a loop over the hidden size in
  blocks of ``BD``) in fp32, and keeps the online logsumexp and the target's logit. The logits
  never leave the program.
* :func:`lce_bwd`: one program per ``(token block, vocabulary block)`` tile; it recomputes the
  tile, turns it into ``dL/dz`` from the saved logsumexp, and adds ``dL/dz W`` into the hidden's
  gradient and ``dL/dz^T h`` into the head's (fp32 buffers, ``tl.atomic_add``: the order of the
  additions, hence the last bits, may change from run to run on a GPU).

The layout follows Cut Cross-Entropy (Wijmans et al. 2024, arXiv:2411.09009): a forward that
reduces each tile to a logsumexp, a backward that recomputes tiles and accumulates both matmuls.
"""
from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["lce_fwd", "lce_bwd", "logits_tile", "tanh"]


@triton.jit
def tanh(x):
    """tanh from exp, stable for any |x| (exp overflows to inf and the quotient to 0: +-1)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def logits_tile(H, W, B, rm, rv, N, V, D, shn, swv,
                HAS_BIAS: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """The fp32 ``BM x BV`` tile ``h[rm] W[rv]^T (+ b[rv])``, summing the hidden size in blocks of BD
    (rows or columns outside N or V are 0)."""
    acc = tl.zeros([BM, BV], tl.float32)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        h = tl.load(H + rm[:, None] * shn + rd[None, :], mask=(rm[:, None] < N) & (rd[None, :] < D), other=0.0)
        wt = tl.load(W + rv[None, :] * swv + rd[:, None], mask=(rv[None, :] < V) & (rd[:, None] < D), other=0.0)
        acc += tl.dot(h, wt, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(B + rv, mask=rv < V, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def lce_fwd(H, W, B, T, LSE, TGT, N, V, D, shn, swv, softcap,
            HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
            BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """Writes LSE[rows] and TGT[rows] (fp32) for one block of BM tokens (grid: (cdiv(N, BM),)).

    Args:
        H, W, B, T: the hidden states ``(N, D)`` and head ``(V, D)`` (contiguous in their last dim),
            the bias ``(V,)`` (any pointer when not HAS_BIAS) and the targets ``(N,)`` (int64, any
            value outside ``[0, V)`` matches no class).
        LSE, TGT: the fp32 outputs: per token, the logsumexp and the target's (soft-capped) logit.
        N, V, D, shn, swv: tokens, vocabulary, hidden size; the row strides of H and W.
        softcap: the soft-cap (used when SOFTCAP).
        HAS_BIAS, SOFTCAP, PREC, BM, BV, BD: compile-time: a bias, a soft-cap, ``tl.dot``'s precision,
            the block sizes (powers of two >= 16).
    """
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    mrow = rm < N
    t = tl.load(T + rm, mask=mrow, other=-1)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    tz = tl.zeros([BM], tl.float32)
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        z = logits_tile(H, W, B, rm, rv, N, V, D, shn, swv, HAS_BIAS, PREC, BM, BV, BD)
        if SOFTCAP:
            z = softcap * tanh(z / softcap)
        z = tl.where(rv[None, :] < V, z, float("-inf"))
        tz += tl.sum(tl.where(rv[None, :] == t[:, None], z, 0.0), 1)
        m_new = tl.maximum(m_i, tl.max(z, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m_i = m_new
    tl.store(LSE + rm, m_i + tl.log(l_i), mask=mrow)
    tl.store(TGT + rm, tz, mask=mrow)


@triton.jit
def lce_bwd(H, W, B, T, LSE, SCALE, DH, DW, DB, N, V, D, shn, swv, softcap, z_loss,
            HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ZLOSS: tl.constexpr, NEED_H: tl.constexpr,
            NEED_W: tl.constexpr, NEED_B: tl.constexpr, PREC: tl.constexpr,
            BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """Adds one ``(BM tokens, BV classes)`` tile's share into DH, DW and DB (grid: (cdiv(N, BM), cdiv(V, BV))).

    Args:
        H, W, B, T, LSE: as :func:`lce_fwd` (LSE now read).
        SCALE: per token, the loss's gradient over the count (0 for an ignored token), fp32.
        DH, DW, DB: the fp32 gradients ``(N, D)``, ``(V, D)``, ``(V,)``, zeroed, contiguous.
        z_loss: the z-loss weight (used when ZLOSS).
        NEED_H, NEED_W, NEED_B: compile-time: which gradients to compute.
        the rest: as :func:`lce_fwd`.
    """
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mrow = rm < N
    mcol = rv < V
    t = tl.load(T + rm, mask=mrow, other=-1)
    lse = tl.load(LSE + rm, mask=mrow, other=0.0)
    scale = tl.load(SCALE + rm, mask=mrow, other=0.0)
    z = logits_tile(H, W, B, rm, rv, N, V, D, shn, swv, HAS_BIAS, PREC, BM, BV, BD)
    if SOFTCAP:
        y = tanh(z / softcap)
        z = softcap * y
    p = tl.exp(z - lse[:, None])
    if ZLOSS:
        p = p * (1.0 + 2.0 * z_loss * lse)[:, None]
    g = (p - tl.where(rv[None, :] == t[:, None], 1.0, 0.0)) * scale[:, None]
    if SOFTCAP:
        g = g * (1.0 - y * y)
    g = tl.where(mrow[:, None] & mcol[None, :], g, 0.0)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        if NEED_H:
            w = tl.load(W + rv[:, None] * swv + rd[None, :], mask=mcol[:, None] & md[None, :], other=0.0)
            dh = tl.dot(g.to(w.dtype), w, input_precision=PREC)
            tl.atomic_add(DH + rm[:, None] * D + rd[None, :], dh, mask=mrow[:, None] & md[None, :])
        if NEED_W:
            h = tl.load(H + rm[:, None] * shn + rd[None, :], mask=mrow[:, None] & md[None, :], other=0.0)
            dw = tl.dot(tl.trans(g.to(h.dtype)), h, input_precision=PREC)
            tl.atomic_add(DW + rv[:, None] * D + rd[None, :], dw, mask=mcol[:, None] & md[None, :])
    if NEED_B:
        tl.atomic_add(DB + rv, tl.sum(g, 0), mask=mcol)
