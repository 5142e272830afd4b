"""Plausible wrong answers to chapter 05's exercises; tests/course/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs. The Triton kernels run in Triton's
interpreter on a CPU: TRITON_INTERPRET=1 is set below before triton is imported (when no GPU is present).
"""
from __future__ import annotations

import functools
import math
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# ----------------------------------------------------------------------------- 05.merge_partials
def merge_no_renormalise(o1, lse1, o2, lse2):
    """adds the two outputs as they are: each was normalised over its own keys only."""
    return o1 + o2, torch.logaddexp(lse1, lse2)


def merge_lse_is_max(o1, lse1, o2, lse2):
    """logsumexp of the union taken as the larger of the two."""
    lse = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - torch.logaddexp(lse1, lse2)), torch.exp(lse2 - torch.logaddexp(lse1, lse2))
    return w1.unsqueeze(-1) * o1 + w2.unsqueeze(-1) * o2, lse


def merge_unstable(o1, lse1, o2, lse2):
    """right maths, exp() of raw logsumexps: overflows to inf/NaN for large scores."""
    e1, e2 = torch.exp(lse1), torch.exp(lse2)
    return (e1.unsqueeze(-1) * o1 + e2.unsqueeze(-1) * o2) / (e1 + e2).unsqueeze(-1), torch.log(e1 + e2)


def merge_nan_when_empty(o1, lse1, o2, lse2):
    """stable, but subtracts a max that is -inf when both parts are empty: NaN."""
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse).unsqueeze(-1) * o1 + torch.exp(lse2 - lse).unsqueeze(-1) * o2, lse


def merge_averages(o1, lse1, o2, lse2):
    """weights 1/2 and 1/2, whatever the number of keys on each side."""
    return (o1 + o2) / 2, torch.logaddexp(lse1, lse2)


def merge_weights_swapped(o1, lse1, o2, lse2):
    """each output weighted by the other part's share."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse2 - safe).unsqueeze(-1) * o1 + torch.exp(lse1 - safe).unsqueeze(-1) * o2, lse


def merge_lse_added(o1, lse1, o2, lse2):
    """right output, but the logsumexps added (log of a product) instead of log-added."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse1 - safe).unsqueeze(-1) * o1 + torch.exp(lse2 - safe).unsqueeze(-1) * o2, lse1 + lse2


def merge_in_fp32(o1, lse1, o2, lse2):
    """right formula, computed in fp32 and cast back: the check's fp64 inputs lose half their digits."""
    o, lse = merge_weights(o1.float(), lse1.float(), o2.float(), lse2.float())
    return o.to(o1.dtype), lse.to(lse1.dtype)


def merge_weights(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse1 - safe).unsqueeze(-1) * o1 + torch.exp(lse2 - safe).unsqueeze(-1) * o2, lse


# ----------------------------------------------------------------------------- 05.chunked_forward
def _offset(offset, lq, lk):
    """The causal offset (query i sees key j <= i + offset): right, or one of the mistakes."""
    return {"bottom_right": lk - lq, "sign": lq - lk, "top_left": 0, "clamp": max(0, lk - lq), "abs": abs(lk - lq)}[offset]


def _online(q, k, v, kv_chunk, causal=False, *, rescale=True, stable=True, lse_max=True, offset="bottom_right",
            acc_dtype="fp32", device=True, lse_dtype=None, whole_scores=False, drop_tail=False, safe=True,
            empty_lse="-inf", fill="-inf", head_dim=None):
    """A correct online-softmax forward, unless a flag says otherwise (one flag = one mistake). ``safe=False`` is the
    lab's forward before issue 36: a row that sees no key (causal, Lq > Lk) gets -inf - -inf and 0 / 0, NaN."""
    dt = torch.promote_types(q.dtype, torch.float32) if acc_dtype == "fp32" else q.dtype
    dev = {"device": q.device} if device else {}
    lq, lk = q.shape[-2], k.shape[-2]
    off = _offset(offset, lq, lk) if causal else None
    hidden = float("-inf") if fill == "-inf" else torch.finfo(dt).min
    c = 1 / math.sqrt(head_dim or q.shape[-1])
    qq = q.to(dt)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=dt, **dev)
    l = torch.zeros(q.shape[:-1], dtype=dt, **dev)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=dt, **dev)
    full = qq @ k.to(dt).transpose(-1, -2) * c if whole_scores else None
    end = lk // kv_chunk * kv_chunk if drop_tail and lk >= kv_chunk else lk
    for s0 in range(0, end, kv_chunk):
        s1 = min(end, s0 + kv_chunk)
        s = full[..., s0:s1] if whole_scores else qq @ k[..., s0:s1, :].to(dt).transpose(-1, -2) * c
        if off is not None:
            j = torch.arange(s0, s1, device=q.device)
            i = torch.arange(lq, device=q.device)
            s = s.masked_fill(j[None, :] > i[:, None] + off, hidden)
        if stable:
            m_new = torch.maximum(m, s.detach().amax(-1))
        else:
            m_new = torch.zeros_like(m)
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new) if safe else m_new
        a = torch.exp(m - m_safe) if rescale else torch.ones_like(m)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        l = l * a + p.sum(-1)
        acc = acc * a.unsqueeze(-1) + p @ v[..., s0:s1, :].to(dt)
        m = m_new
    if not safe:
        lse = m + torch.log(l) if lse_max else torch.log(l)
        return (acc / l.unsqueeze(-1)).to(q.dtype), lse.to(lse_dtype or dt)
    empty = l == 0
    l_safe = torch.where(empty, 1.0, l)
    lse = torch.where(empty, 0.0, m) + torch.log(l_safe) if lse_max else torch.log(l_safe)
    lse = torch.where(empty, float("-inf") if empty_lse == "-inf" else 0.0, lse)
    return (acc / l_safe.unsqueeze(-1)).to(q.dtype), lse.to(lse_dtype or dt)


def chunked_local_softmax(q, k, v, kv_chunk, causal=False):
    """softmax within each chunk, then the chunks' outputs averaged."""
    outs, lses = [], []
    for s0 in range(0, k.shape[-2], kv_chunk):
        o, l = _online(q, k[..., s0:s0 + kv_chunk, :], v[..., s0:s0 + kv_chunk, :], kv_chunk, causal)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs).mean(0), torch.logsumexp(torch.stack(lses), 0)


def chunked_naive_then_split(q, k, v, kv_chunk, causal=False):
    """right numbers from the whole score matrix; kv_chunk only splits the work after it is built."""
    return _online(q, k, v, kv_chunk, causal, whole_scores=True)


# ----------------------------------------------------------------------------- 05.flash_backward
def _tiled(q, k, v, o, lse, do, causal=False, block=16, *, bq=None, bk=None, skip=True, delta="rows", scale=True,
           offset="bottom_right", acc_dtype="fp32", lse_norm=True, safe=True, hide="fill", head_dim=None):
    """A correct tiled FA2 backward, unless a flag says otherwise (one flag = one mistake). ``safe``: a logsumexp
    of -inf (a row that saw no key) taken as +inf, so that P = 0 there; ``hide="multiply"`` masks P by multiplying
    with the mask, which without ``safe`` is inf * 0 = NaN on such a row."""
    bq, bk = bq or block, bk or block
    dt = torch.promote_types(q.dtype, torch.float32) if acc_dtype == "fp32" else q.dtype
    lq, lk = q.shape[-2], k.shape[-2]
    off = _offset(offset, lq, lk) if causal else None
    if safe:
        lse = torch.where(lse == float("-inf"), float("inf"), lse)
    c = 1 / math.sqrt(head_dim or q.shape[-1])
    q_, k_, v_, o_, do_ = (t.to(dt) for t in (q, k, v, o, do))
    dd = (do_ * o_).sum(-1)
    dq, dk, dv = torch.zeros_like(q_), torch.zeros_like(k_), torch.zeros_like(v_)
    for qs in range(0, lq, bq):
        qe = min(lq, qs + bq)
        for ks in range(0, lk, bk):
            ke = min(lk, ks + bk)
            if off is not None and skip and ks > qe - 1 + off:
                break
            s = q_[..., qs:qe, :] @ k_[..., ks:ke, :].transpose(-1, -2) * c
            p = torch.exp(s - (lse[..., qs:qe, None].to(dt) if lse_norm else s.amax(-1, keepdim=True)))
            if off is not None:
                j, i = torch.arange(ks, ke), torch.arange(qs, qe)
                if hide == "multiply":
                    p = p * (j[None, :] <= i[:, None] + off)
                else:
                    p = p.masked_fill(j[None, :] > i[:, None] + off, 0.0)
            dv[..., ks:ke, :] += p.transpose(-1, -2) @ do_[..., qs:qe, :]
            dp = do_[..., qs:qe, :] @ v_[..., ks:ke, :].transpose(-1, -2)
            if delta == "rows":
                ds = p * (dp - dd[..., qs:qe, None])
            elif delta == "none":
                ds = p * dp
            else:  # "tile": rowsum(P * dP) over this tile's keys only, not all keys
                ds = p * (dp - (p * dp).sum(-1, keepdim=True))
            sc = c if scale else 1.0
            dq[..., qs:qe, :] += ds @ k_[..., ks:ke, :] * sc
            dk[..., ks:ke, :] += ds.transpose(-1, -2) @ q_[..., qs:qe, :] * sc
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def backward_one_block(q, k, v, o, lse, do, causal=False, block=16):
    """right numbers, but one tile covering the whole matrices (plain recomputation, not FA2's tiles)."""
    return _tiled(q, k, v, o, lse, do, causal, max(q.shape[-2], k.shape[-2]))


def backward_row_blocks(q, k, v, o, lse, do, causal=False, block=16):
    """tiles the queries only: each query block against every key at once."""
    return _tiled(q, k, v, o, lse, do, causal, block, bk=k.shape[-2])


# ----------------------------------------------------------------------------- 05.flash_function
def _fwd(q, k, v, causal, **mistake):
    return _online(q, k, v, 16, causal, **mistake)


def _function(save="right", lse_dtype=None, bwd_block=16, bwd_acc="fp32", fwd=None, bwd=None, keep=False):
    """An autograd.Function over the correct pieces above, saving what ``save`` says (``keep``: and each call's
    logsumexp in a list on the class, "for debugging")."""

    class Flash(torch.autograd.Function):
        kept: list = []

        @staticmethod
        def forward(ctx, q, k, v, causal=False):
            o, lse = _fwd(q, k, v, causal, **(fwd or {}))
            if keep:
                Flash.kept.append(lse)
            if lse_dtype == "input":
                lse = lse.to(q.dtype)
            ctx.causal = causal
            if save == "right" or save == "lse16":
                ctx.save_for_backward(q, k, v, o, lse)
            elif save == "P":  # the probabilities too, "to save recomputing them"
                p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
                ctx.save_for_backward(q, k, v, o, lse, p)
            elif save == "attr":
                ctx.save_for_backward(q, k, v, o)
                ctx.lse = lse
            elif save == "upcast":
                acc = torch.promote_types(q.dtype, torch.float32)
                ctx.save_for_backward(q.to(acc), k.to(acc), v.to(acc), o, lse)
            elif save == "contiguous":
                ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), o, lse)
            elif save == "qkv":  # backward recomputes the forward under autograd
                ctx.save_for_backward(q, k, v)
            return o

        @staticmethod
        def backward(ctx, do):
            if save == "qkv":
                q, k, v = ctx.saved_tensors
                with torch.enable_grad():
                    q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
                    o, _ = _fwd(q2, k2, v2, ctx.causal)
                    return (*torch.autograd.grad(o, (q2, k2, v2), do), None)
            if save == "attr":
                q, k, v, o = ctx.saved_tensors
                lse = ctx.lse
            else:
                q, k, v, o, lse = ctx.saved_tensors[:5]
            block = bwd_block or max(q.shape[-2], k.shape[-2])
            lse = lse.to(torch.promote_types(q.dtype, torch.float32))
            return (*_tiled(q, k, v, o, lse, do, ctx.causal, block, acc_dtype=bwd_acc, **(bwd or {})), None)

    Flash.__name__ = Flash.__qualname__ = "FlashAttention"
    return Flash


# ----------------------------------------------------------------------------- 05.triton_forward
@triton.jit
def _fwd_body(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BUG: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    if BUG == 2:  # assumes head_dim is contiguous (stride 1) in q and k
        sqd = 1
        skd = 1
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=rows[:, None] < Lq, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offset = Lk - Lq
    if BUG == 1:  # top-left causal: SDPA's is_causal, not the lab's bottom-right alignment
        offset = 0
    end = Lk
    if CAUSAL:
        end = tl.minimum(Lk, (pid_m + 1) * BLOCK_M + offset)
    for start in range(0, end, BLOCK_N):
        cols = start + cols0
        kt = tl.load(K + b * skb + h * skh + cols[None, :] * skn + dims[:, None] * skd, mask=cols[None, :] < Lk, other=0.0)
        s = tl.dot(q, kt) * scale
        ok = cols[None, :] < Lk
        if BUG == 3:  # keys past Lk load as 0, but their score 0 is not masked: e^0 joins the sum
            ok = cols[None, :] >= 0
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        if BUG == 5:  # forgets to rescale what was summed under the old max
            alpha = tl.full([BLOCK_M], 1.0, tl.float32)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        vv = tl.load(V + b * svb + h * svh + cols[:, None] * svn + dims[None, :] * svd, mask=cols[:, None] < Lk, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m = m_new
    tl.store(O + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod, acc / l[:, None], mask=rows[:, None] < Lq)
    if BUG == 4:  # the logsumexp without the running max
        tl.store(LSE + bh * Lq + rows, tl.log(l), mask=rows < Lq)
    else:
        tl.store(LSE + bh * Lq + rows, m + tl.log(l), mask=rows < Lq)


@triton.jit
def triton_top_left(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                    H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _fwd_body(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 1)


@triton.jit
def triton_unit_stride(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                       H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _fwd_body(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 2)


@triton.jit
def triton_tail_unmasked(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                         H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _fwd_body(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 3)


@triton.jit
def triton_lse_no_max(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                      H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _fwd_body(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 4)


@triton.jit
def triton_no_rescale(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                      H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _fwd_body(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 5)


# ----------------------------------------------------------------------------- 05.predict_saved_bytes
def predict_flash_quadratic_too(b, h, s, d):
    return b * h * s * s * 4, b * h * s * s * 4


def predict_16bit(b, h, s, d):
    return b * h * s * s * 2, b * h * s * (d + 1) * 2


def predict_flash_counts_qkv(b, h, s, d):
    """q, k and v are the caller's tensors, not extra bytes the attention saves."""
    return b * h * s * s * 4, b * h * s * (4 * d + 1) * 4


def predict_scores_and_probs(b, h, s, d):
    """naive keeps P only (softmax saves its output), not S and P."""
    return 2 * b * h * s * s * 4, b * h * s * (d + 1) * 4


def predict_no_heads(b, h, s, d):
    return b * s * s * 4, b * s * (d + 1) * 4


P = functools.partial
def predict_flash_without_lse(b, h, s, d):
    """flash keeps the output only, forgetting the logsumexp row."""
    return b * h * s * s * 4, b * h * s * d * 4


def predict_lse_fp64(b, h, s, d):
    """the logsumexp taken as 8 bytes per row."""
    return b * h * s * s * 4, b * h * s * (4 * d + 8)


def predict_naive_with_mask_row(b, h, s, d):
    """naive counted as (s + 1) x s: an extra row for the softmax's sum."""
    return b * h * s * (s + 1) * 4, b * h * s * (d + 1) * 4


MUTANTS = {
    "05.merge_partials": [
        ("no renormalisation", merge_no_renormalise),
        ("lse = max", merge_lse_is_max),
        ("exp overflow", merge_unstable),
        ("NaN when both empty", merge_nan_when_empty),
        ("average", merge_averages),
        ("weights swapped", merge_weights_swapped),
        ("logsumexps added", merge_lse_added),
        ("computed in fp32", merge_in_fp32),
    ],
    "05.chunked_forward": [
        ("no rescale", P(_online, rescale=False)),
        ("drops the tail chunk", P(_online, drop_tail=True)),
        ("no running max", P(_online, stable=False)),
        ("softmax per chunk", chunked_local_softmax),
        ("lse without max", P(_online, lse_max=False)),
        ("causal top-left (SDPA's is_causal) for Lq != Lk", P(_online, offset="top_left")),
        ("causal offset Lq - Lk", P(_online, offset="sign")),
        ("running sums in the input's dtype (bf16)", P(_online, acc_dtype="input")),
        ("logsumexp returned in the input's dtype", P(_online, lse_dtype=torch.bfloat16)),
        ("buffers made on the CPU (no device=)", P(_online, device=False)),
        ("whole score matrix, then split", chunked_naive_then_split),
    ],
    "05.flash_backward": [
        ("no D term", P(_tiled, delta="none")),
        ("D from the tile's keys only", P(_tiled, delta="tile")),
        ("no scale", P(_tiled, scale=False)),
        ("P not normalised by the logsumexp", P(_tiled, lse_norm=False)),
        ("causal top-left for Lq != Lk", P(_tiled, offset="top_left")),
        ("one block (plain recomputation)", backward_one_block),
        ("query blocks against all keys", backward_row_blocks),
        ("masked tiles computed, not skipped", P(_tiled, skip=False)),
        ("accumulates dq, dk, dv in bf16", P(_tiled, acc_dtype="input")),
    ],
    "05.flash_function": [
        ("saves P too", _function(save="P")),
        ("logsumexp as a ctx attribute", _function(save="attr")),
        ("saves fp32 copies of bf16 q, k, v", _function(save="upcast")),
        ("saves q.contiguous() copies", _function(save="contiguous")),
        ("saves a bf16 logsumexp", _function(save="lse16", lse_dtype="input")),
        ("saves q, k, v only, backward recomputes with autograd", _function(save="qkv")),
        ("backward in one block", _function(bwd_block=None)),
        ("backward accumulates in bf16", _function(bwd_acc="input")),
    ],
    "05.triton_forward": [
        ("top-left causal", triton_top_left),
        ("assumes head_dim stride 1", triton_unit_stride),
        ("tail keys not masked", triton_tail_unmasked),
        ("logsumexp without the max", triton_lse_no_max),
        ("no rescale", triton_no_rescale),
    ],
    "05.predict_saved_bytes": [
        ("flash quadratic", predict_flash_quadratic_too),
        ("2 bytes per element", predict_16bit),
        ("flash counts q, k, v", predict_flash_counts_qkv),
        ("naive keeps S and P", predict_scores_and_probs),
        ("forgets heads", predict_no_heads),
        ("flash without the logsumexp", predict_flash_without_lse),
        ("logsumexp in fp64", predict_lse_fp64),
        ("naive with an extra row", predict_naive_with_mask_row),
    ],
}


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
def merge_into_o1(o1, lse1, o2, lse2):
    """Merges the partials into o1 in place (saves a buffer): the caller's partial is overwritten."""
    from memlab.attention import merge_partials

    o, lse = merge_partials(o1, lse1, o2, lse2)
    o1.copy_(o)
    return o1, lse


def merge_4d_only(o1, lse1, o2, lse2):
    """Unpacks (B, H, L, d) from the shapes (every graded partial has a batch dimension before L)."""
    from memlab.attention import merge_partials

    b, l, d = o1.shape
    return merge_partials(o1, lse1, o2, lse2)


def chunked_scales_q_in_place(q, k, v, kv_chunk, causal=False):
    """Scales q by 1/sqrt(d) in place before the loop (saves a copy): the caller's q changes."""
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        q.mul_(scale)
    from memlab.attention import chunked_attention

    q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
    o, lse = chunked_attention(q4, k4, v4, kv_chunk=kv_chunk, q_chunk=q.shape[-2], causal="bottom_right" if causal else False,
                               return_lse=True, scale=1.0)
    return o.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])


def chunked_4d_only(q, k, v, kv_chunk, causal=False):
    """Unpacks b, h, L, d from q.shape (every graded input is 4-D): 3-D and 5-D inputs raise."""
    from memlab.attention import chunked_attention

    b, h, lq, d = q.shape
    o, lse = chunked_attention(q, k, v, kv_chunk=kv_chunk, q_chunk=lq, causal="bottom_right" if causal else False,
                               return_lse=True)
    return o, lse


def flash_bwd_scales_do_in_place(q, k, v, o, lse, do, causal=False, block=16):
    """Folds a factor into the output gradient in place and takes it out again: rounding leaves do changed."""
    from memlab.attention import flash_attention_backward

    with torch.no_grad():
        do.mul_(3.0)
    grads = flash_attention_backward(do / 3.0, q, k, v, o, lse, causal="bottom_right" if causal else False,
                                     block_q=block, block_k=block)
    with torch.no_grad():
        do.div_(3.0)
    return grads


def saved_bytes_blocks_of_64(batch, heads, seq, head_dim):
    """Rounds the sequence up to whole 64-query blocks for flash (every graded length is a multiple of 64)."""
    padded = -(-seq // 64) * 64
    return batch * heads * seq * seq * 4, batch * heads * padded * (head_dim + 1) * 4


MUTANTS["05.merge_partials"] += [("merged into o1 in place", merge_into_o1), ("3 dims unpacked", merge_4d_only)]
MUTANTS["05.chunked_forward"] += [("q scaled in place", chunked_scales_q_in_place), ("4-D inputs only", chunked_4d_only)]
MUTANTS["05.flash_backward"] += [("do scaled in place and back", flash_bwd_scales_do_in_place)]
MUTANTS["05.predict_saved_bytes"] += [("length rounded up to blocks of 64", saved_bytes_blocks_of_64)]


# ----------------------------------------------------------------------------- 05.triton_forward after issue 36
# _fwd_body above is the lab's kernel as it was: a query row that sees no key (bottom-right, Lq > Lk) subtracts a
# max of -inf from -inf and divides by a sum of 0, NaN. _fwd_safe is that kernel fixed; each BUG is one mistake.
@triton.jit
def _fwd_safe(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BUG: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    if BUG == 13:  # one block size for both loops (every graded launch had BLOCK_M == BLOCK_N)
        cols0 = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    if BUG == 12:  # head_dim 16 written in (the lab's first examples)
        dims = tl.arange(0, 16)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=rows[:, None] < Lq, other=0.0)
    if BUG == 14:  # folds the scale into q and stores it back into Q (saves a multiply per key block)
        q = q * scale
        tl.store(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, q, mask=rows[:, None] < Lq)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if BUG == 12:
        acc = tl.zeros([BLOCK_M, 16], tl.float32)
    offset = Lk - Lq
    if BUG == 10:  # Lq <= Lk taken for granted: a negative offset clamped to 0 (top-left when Lq > Lk)
        offset = tl.maximum(Lk - Lq, 0)
    end = Lk
    if CAUSAL:
        end = tl.minimum(Lk, (pid_m + 1) * BLOCK_M + offset)
    for start in range(0, end, BLOCK_N):
        cols = start + cols0
        kt = tl.load(K + b * skb + h * skh + cols[None, :] * skn + dims[:, None] * skd, mask=cols[None, :] < Lk, other=0.0)
        s = tl.dot(q, kt)
        if BUG != 14:
            s = s * scale
        ok = cols[None, :] < Lk
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        vv = tl.load(V + b * svb + h * svh + cols[:, None] * svn + dims[None, :] * svd, mask=cols[:, None] < Lk, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m = m_new
    l_safe = tl.where(l == 0.0, 1.0, l)
    tl.store(O + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod, acc / l_safe[:, None], mask=rows[:, None] < Lq)
    if BUG == 11:  # a row that sees no key gets logsumexp 0 (log 1 of the guarded sum), not -inf
        tl.store(LSE + bh * Lq + rows, tl.where(m == float("-inf"), 0.0, m) + tl.log(l_safe), mask=rows < Lq)
    else:
        tl.store(LSE + bh * Lq + rows, m + tl.log(l), mask=rows < Lq)


@triton.jit
def triton_lq_le_lk_assumed(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
        H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """a negative offset clamped to 0: Lq <= Lk taken for granted."""
    _fwd_safe(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 10)


@triton.jit
def triton_empty_lse_zero(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
        H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """a row that sees no key gets logsumexp 0, not -inf."""
    _fwd_safe(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 11)


@triton.jit
def triton_head_dim_16(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
        H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """head_dim 16 written in."""
    _fwd_safe(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 12)


@triton.jit
def triton_one_block_size(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
        H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_M used for the key block too."""
    _fwd_safe(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 13)


@triton.jit
def triton_scales_q_in_place(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
        H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """stores q * scale back into Q."""
    _fwd_safe(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 14)


@triton.jit
def triton_fixed(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                 H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """No mistake (tests/ch05 shows it passes: the mutants above fail for their own mistake)."""
    _fwd_safe(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 0)


@triton.jit
def triton_nan_rows(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                    H, Lq, Lk, scale, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The lab's kernel before issue 36: NaN rows where a query sees no key (bottom-right, Lq > Lk)."""
    _fwd_body(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
              H, Lq, Lk, scale, CAUSAL, D, BLOCK_M, BLOCK_N, 0)


MUTANTS["05.triton_forward"] += [
    ("NaN rows where a query sees no key (the lab's kernel before issue 36)", triton_nan_rows),
    ("Lq <= Lk assumed: offset clamped at 0", triton_lq_le_lk_assumed),
    ("logsumexp 0 for a row that sees no key", triton_empty_lse_zero),
    ("head_dim 16 written in", triton_head_dim_16),
    ("BLOCK_M used as the key block", triton_one_block_size),
    ("q scaled in place in Q", triton_scales_q_in_place),
]


# ----------------------------------------------------------------------------- exercises 2-4 after issue 36
# The checks now draw Lq > Lk with causal (the first Lq - Lk query rows see no key: output 0, logsumexp -inf,
# gradients 0) and non-causal Lq != Lk; each of these passed when they tried Lq <= Lk only.
def _function_fp32_in_bf16():
    """An autograd.Function whose forward rounds fp32 inputs to bf16 (fp64 stays): the backward is right."""
    base = _function()

    class Flash(base):
        @staticmethod
        def forward(ctx, q, k, v, causal=False):
            if q.dtype != torch.float32:
                return base.forward(ctx, q, k, v, causal)
            o, lse = _online(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), 16, causal)
            o = o.to(q.dtype)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal = causal
            return o

    Flash.__name__ = Flash.__qualname__ = "FlashAttention"
    return Flash


MUTANTS["05.chunked_forward"] += [
    ("NaN rows where a query sees no key (the lab's forward before issue 36)", P(_online, safe=False)),
    ("Lq <= Lk assumed: causal offset clamped at 0", P(_online, offset="clamp")),
    ("causal offset |Lk - Lq| (Lq <= Lk assumed)", P(_online, offset="abs")),
    ("logsumexp 0 for a row that sees no key", P(_online, empty_lse="zero")),
    ("hidden scores set to finfo.min, not -inf (an empty row averages every key)", P(_online, fill="min")),
]
MUTANTS["05.flash_backward"] += [
    ("P masked by multiplying: inf * 0 = NaN where the logsumexp is -inf", P(_tiled, safe=False, hide="multiply")),
    ("Lq <= Lk assumed: causal offset clamped at 0", P(_tiled, offset="clamp")),
    ("causal offset |Lk - Lq| (Lq <= Lk assumed)", P(_tiled, offset="abs")),
]
MUTANTS["05.flash_function"] += [
    ("NaN rows where a query sees no key (the lab's forward before issue 36)", _function(fwd={"safe": False})),
    ("Lq <= Lk assumed: causal offset clamped at 0", _function(fwd={"offset": "clamp"}, bwd={"offset": "clamp"})),
    ("causal offset |Lk - Lq| in backward only", _function(bwd={"offset": "abs"})),
    ("hidden scores set to finfo.min in forward", _function(fwd={"fill": "min"})),
    ("backward: P masked by multiplying, -inf logsumexp kept", _function(bwd={"safe": False, "hide": "multiply"})),
    ("fp32 inputs computed in bf16", _function_fp32_in_bf16()),
]
# right answers written another way: the same pieces, correct (the mutants above each change one thing)
RIGHT_ANSWERS = {
    "05.chunked_forward": [("online softmax with the two guards", _online)],
    "05.flash_backward": [("tiled backward, -inf logsumexp as +inf", _tiled),
                          ("tiled backward, masked_fill alone (P = inf there, then 0)", P(_tiled, safe=False))],
    "05.flash_function": [("the Function over those two", _function())],
}


# ----------------------------------------------------------------------------- issue 35: the kinds, labelled
_SAVED: dict = {}


def saved_bytes_memoised(batch, heads, seq, head_dim):
    """Right formula, memoised by the arguments in a module-level dict kept between calls."""
    key = (batch, heads, seq, head_dim)
    if key not in _SAVED:
        _SAVED[key] = (batch * heads * seq * seq * 4, batch * heads * seq * (head_dim + 1) * 4)
    return _SAVED[key]


MUTANTS["05.chunked_forward"] += [("scale 1/sqrt(8) written in", P(_online, head_dim=8))]
MUTANTS["05.flash_backward"] += [("scale 1/sqrt(8) written in", P(_tiled, head_dim=8))]
MUTANTS["05.flash_function"] += [("scale 1/sqrt(8) written in", _function(fwd={"head_dim": 8}, bwd={"head_dim": 8})),
                                 ("each logsumexp kept on the class", _function(keep=True))]
MUTANTS["05.predict_saved_bytes"] += [("memoised in a module dict", saved_bytes_memoised)]

KINDS = {
    "05.merge_partials": {"hygiene": ["merged into o1 in place"],
                          "space": ["3 dims unpacked", "NaN when both empty", "exp overflow"]},
    "05.chunked_forward": {"hygiene": ["q scaled in place"], "constants": ["scale 1/sqrt(8) written in"],
                           "space": ["4-D inputs only", "Lq <= Lk assumed: causal offset clamped at 0"]},
    "05.flash_backward": {"hygiene": ["do scaled in place and back"], "constants": ["scale 1/sqrt(8) written in"],
                          "space": ["Lq <= Lk assumed: causal offset clamped at 0"]},
    "05.flash_function": {"hygiene": ["each logsumexp kept on the class"], "constants": ["scale 1/sqrt(8) written in"],
                          "space": ["fp32 inputs computed in bf16", "Lq <= Lk assumed: causal offset clamped at 0"]},
    "05.triton_forward": {"constants": ["head_dim 16 written in"],
                          "space": ["Lq <= Lk assumed: offset clamped at 0"]},
    "05.predict_saved_bytes": {"hygiene": ["memoised in a module dict"],
                               "constants": ["length rounded up to blocks of 64"]},
}
NOT_APPLICABLE = {
    "05.triton_forward": {"hygiene": "a Triton kernel keeps no Python state between launches and is passed to the "
                                     "check as it is (its pointer arguments are not pictured call by call); a kernel "
                                     "that stores into q, k or v is the check's own comparison ('q scaled in place "
                                     "in Q' fails it)"},
    "05.merge_partials": {"constants": "no size, count or scale enters the merge (two partials of any shape and their "
                                       "logsumexps); the magnitudes a constant could be tuned to are drawn (x1e-3 to "
                                       "x1000) and the overflow they catch is the space mutant"},
    "05.predict_saved_bytes": {"space": "four ints into one closed formula: no part of the input space is handled "
                                        "apart; a constant tuned to the graded lengths is the constants mutant"},
}
