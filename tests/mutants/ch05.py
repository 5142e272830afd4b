"""Plausible wrong answers to chapter 05's exercises; tests/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs.
"""
from __future__ import annotations

import math

import torch


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


# ----------------------------------------------------------------------------- 05.chunked_forward
def _scores(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def chunked_no_rescale(q, k, v, kv_chunk):
    """forgets to rescale the running output and sum by exp(m_old - m_new)."""
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    l = torch.zeros(q.shape[:-1], dtype=q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for s0 in range(0, k.shape[-2], kv_chunk):
        s = _scores(q, k[..., s0:s0 + kv_chunk, :])
        m = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m.unsqueeze(-1))
        l = l + p.sum(-1)
        acc = acc + p @ v[..., s0:s0 + kv_chunk, :]
    return acc / l.unsqueeze(-1), m + torch.log(l)


def chunked_drops_tail(q, k, v, kv_chunk):
    """whole chunks only: the last keys are lost when kv_chunk does not divide the length."""
    n = k.shape[-2] // kv_chunk * kv_chunk or k.shape[-2]
    s = _scores(q, k[..., :n, :])
    return torch.softmax(s, -1) @ v[..., :n, :], torch.logsumexp(s, -1)


def chunked_no_max(q, k, v, kv_chunk):
    """sums exp(scores) without subtracting a running max: overflows for large scores."""
    l = torch.zeros(q.shape[:-1], dtype=q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for s0 in range(0, k.shape[-2], kv_chunk):
        p = torch.exp(_scores(q, k[..., s0:s0 + kv_chunk, :]))
        l = l + p.sum(-1)
        acc = acc + p @ v[..., s0:s0 + kv_chunk, :]
    return acc / l.unsqueeze(-1), torch.log(l)


def chunked_local_softmax(q, k, v, kv_chunk):
    """softmax within each chunk, then the chunks' outputs averaged."""
    outs, lses = [], []
    for s0 in range(0, k.shape[-2], kv_chunk):
        s = _scores(q, k[..., s0:s0 + kv_chunk, :])
        outs.append(torch.softmax(s, -1) @ v[..., s0:s0 + kv_chunk, :])
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs).mean(0), torch.logsumexp(torch.stack(lses), 0)


def chunked_lse_without_max(q, k, v, kv_chunk):
    """right output, but returns log(l) as the logsumexp, forgetting the running max m."""
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    l = torch.zeros(q.shape[:-1], dtype=q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for s0 in range(0, k.shape[-2], kv_chunk):
        s = _scores(q, k[..., s0:s0 + kv_chunk, :])
        m_new = torch.maximum(m, s.amax(-1))
        a = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        l = l * a + p.sum(-1)
        acc = acc * a.unsqueeze(-1) + p @ v[..., s0:s0 + kv_chunk, :]
        m = m_new
    return acc / l.unsqueeze(-1), torch.log(l)


# ----------------------------------------------------------------------------- 05.flash_backward
def _p(q, k, lse):
    return torch.exp(_scores(q, k) - lse.unsqueeze(-1))


def backward_no_delta(q, k, v, o, lse, do):
    """dS = P * dP: forgets the softmax Jacobian's - D term."""
    p = _p(q, k, lse)
    ds = p * (do @ v.mT)
    sc = 1 / math.sqrt(q.shape[-1])
    return ds @ k * sc, ds.mT @ q * sc, p.mT @ do


def backward_no_scale(q, k, v, o, lse, do):
    """forgets the 1/sqrt(d) of the scores in dQ and dK."""
    p = _p(q, k, lse)
    ds = p * (do @ v.mT - (do * o).sum(-1, keepdim=True))
    return ds @ k, ds.mT @ q, p.mT @ do


def backward_unnormalised_p(q, k, v, o, lse, do):
    """recomputes exp(S - rowmax) instead of exp(S - logsumexp): P not normalised."""
    s = _scores(q, k)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    ds = p * (do @ v.mT - (do * o).sum(-1, keepdim=True))
    sc = 1 / math.sqrt(q.shape[-1])
    return ds @ k * sc, ds.mT @ q * sc, p.mT @ do


def backward_delta_over_columns(q, k, v, o, lse, do):
    """D summed over the wrong axis (per key instead of per query)."""
    p = _p(q, k, lse)
    dp = do @ v.mT
    ds = p * (dp - (p * dp).sum(-2, keepdim=True))
    sc = 1 / math.sqrt(q.shape[-1])
    return ds @ k * sc, ds.mT @ q * sc, p.mT @ do


# ----------------------------------------------------------------------------- 05.causal_mask
def _ij(qs, qe, ks, ke):
    return torch.arange(qs, qe).unsqueeze(1), torch.arange(ks, ke).unsqueeze(0)


def mask_ignores_bottom_right(qs, qe, ks, ke, lq, lk, causal):
    if causal is False:
        return None
    i, j = _ij(qs, qe, ks, ke)
    return j <= i


def mask_offset_sign(qs, qe, ks, ke, lq, lk, causal):
    if causal is False:
        return None
    i, j = _ij(qs, qe, ks, ke)
    return j <= i + (lq - lk if causal == "bottom_right" else 0)


def mask_strict(qs, qe, ks, ke, lq, lk, causal):
    """a query does not see its own key (j < i)."""
    if causal is False:
        return None
    i, j = _ij(qs, qe, ks, ke)
    return j < i + (lk - lq if causal == "bottom_right" else 0)


def mask_local_indices(qs, qe, ks, ke, lq, lk, causal):
    """indices inside the block, forgetting where the block starts."""
    if causal is False:
        return None
    i, j = _ij(0, qe - qs, 0, ke - ks)
    return j <= i + (lk - lq if causal == "bottom_right" else 0)


def mask_block_lengths(qs, qe, ks, ke, lq, lk, causal):
    """bottom-right offset from the block's sizes, not the full lengths."""
    if causal is False:
        return None
    i, j = _ij(qs, qe, ks, ke)
    return j <= i + ((ke - ks) - (qe - qs) if causal == "bottom_right" else 0)


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


MUTANTS = {
    "05.merge_partials": [
        ("no renormalisation", merge_no_renormalise),
        ("lse = max", merge_lse_is_max),
        ("exp overflow", merge_unstable),
        ("NaN when both empty", merge_nan_when_empty),
        ("average", merge_averages),
    ],
    "05.chunked_forward": [
        ("no rescale", chunked_no_rescale),
        ("drops the tail chunk", chunked_drops_tail),
        ("no running max", chunked_no_max),
        ("softmax per chunk", chunked_local_softmax),
        ("lse without max", chunked_lse_without_max),
    ],
    "05.flash_backward": [
        ("no D term", backward_no_delta),
        ("no scale", backward_no_scale),
        ("P not normalised", backward_unnormalised_p),
        ("D over columns", backward_delta_over_columns),
    ],
    "05.causal_mask": [
        ("top-left only", mask_ignores_bottom_right),
        ("offset sign", mask_offset_sign),
        ("strict <", mask_strict),
        ("block-local indices", mask_local_indices),
        ("offset from block sizes", mask_block_lengths),
    ],
    "05.predict_saved_bytes": [
        ("flash quadratic", predict_flash_quadratic_too),
        ("2 bytes per element", predict_16bit),
        ("flash counts q, k, v", predict_flash_counts_qkv),
        ("naive keeps S and P", predict_scores_and_probs),
        ("forgets heads", predict_no_heads),
    ],
}
