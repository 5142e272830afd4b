"""Checks for chapter 05, "chunked and flash attention"."""
from __future__ import annotations

import math

import torch

from memlab import attention as ref
from memlab.checks import expect, expect_close, expect_equal, expect_tensor_close, expect_type, register


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _pair(name: str, got, n: int = 2) -> tuple:
    expect(isinstance(got, tuple) and len(got) == n,
           f"{name}: expected a tuple of {n} tensors, got {type(got).__name__} {str(got)[:60]}")
    return got


def _attn_lse(q, k, v, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


# ----------------------------------------------------------------------------- 05.merge_partials
@register("05.merge_partials", reference=lambda: ref.merge_partials, title="merge two partial softmax results")
def check_merge_partials(fn):
    q, k, v = _randn(2, 5, 8, seed=1), _randn(2, 9, 8, seed=2), _randn(2, 9, 4, seed=3)
    for cut, mult in ((4, 1.0), (1, 1.0), (8, 1.0), (3, 1000.0)):
        qq = q * mult  # scores in the thousands: exp() of them overflows even in fp64 unless you subtract a max
        o, lse = _attn_lse(qq, k, v)
        o1, l1 = _attn_lse(qq, k[:, :cut], v[:, :cut])
        o2, l2 = _attn_lse(qq, k[:, cut:], v[:, cut:])
        got = _pair(f"fn(o1, lse1, o2, lse2) with keys split at {cut}", fn(o1, l1, o2, l2))
        expect_tensor_close(f"merged output (keys split at {cut}, scores up to {float((qq @ k.mT).abs().max()):.0f})",
                            got[0], o, rtol=1e-10, atol=1e-10)
        expect_tensor_close(f"merged logsumexp (keys split at {cut})", got[1], lse, rtol=1e-10, atol=1e-10)
    o1, l1 = _attn_lse(q, k, v)
    empty_o, empty_l = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))
    got = _pair("fn(o1, lse1, zeros, -inf)", fn(o1, l1, empty_o, empty_l))
    expect_tensor_close("merging with an empty part (lse2 = -inf, no keys): output", got[0], o1, rtol=1e-12, atol=1e-12)
    expect_tensor_close("merging with an empty part: logsumexp", got[1], l1, rtol=1e-12, atol=1e-12)
    got = _pair("fn(zeros, -inf, zeros, -inf)", fn(empty_o, empty_l, empty_o, empty_l))
    expect(not torch.isnan(got[0]).any(), "merging two empty parts (both lse = -inf) gave NaN; a row that sees no key "
                                           "has output 0 (subtract a max that is 0 when it is -inf)")
    expect_tensor_close("merging two empty parts: output", got[0], empty_o, atol=0, rtol=0)
    expect(bool(torch.all(got[1] == float("-inf"))), "merging two empty parts: logsumexp should stay -inf")


# ----------------------------------------------------------------------------- 05.chunked_forward
def chunked_forward_reference(q, k, v, kv_chunk):
    """memlab's answer: all queries at once, keys kv_chunk at a time; (output, logsumexp)."""
    q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
    o, lse = ref.chunked_attention(q4, k4, v4, kv_chunk=kv_chunk, q_chunk=q.shape[-2], return_lse=True)
    return o.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])


@register("05.chunked_forward", reference=lambda: chunked_forward_reference, title="online-softmax forward over key chunks")
def check_chunked_forward(fn):
    q, k, v = _randn(2, 3, 7, 8, seed=4), _randn(2, 3, 13, 8, seed=5), _randn(2, 3, 13, 6, seed=6)
    for chunk, mult in ((4, 1.0), (5, 1.0), (1, 1.0), (13, 1.0), (100, 1.0), (3, 1000.0)):
        qq = q * mult
        want_o, want_l = _attn_lse(qq, k, v)
        got = _pair(f"fn(q, k, v, kv_chunk={chunk})", fn(qq, k, v, chunk))
        what = f"kv_chunk={chunk} (13 keys{', scores in the thousands' if mult > 1 else ''})"
        expect_tensor_close(f"output, {what}", got[0], want_o, rtol=1e-9, atol=1e-9)
        expect_tensor_close(f"logsumexp, {what}", got[1], want_l, rtol=1e-9, atol=1e-9)
    q32, k32, v32 = q.float().requires_grad_(True), k.float().requires_grad_(True), v.float().requires_grad_(True)
    o = _pair("fn(q, k, v, 4) on fp32 inputs", fn(q32, k32, v32, 4))[0]
    expect(o.dtype == torch.float32, f"fp32 inputs gave a {o.dtype} output, expected torch.float32")
    expect(o.requires_grad, "the output has no grad_fn: the forward must stay differentiable (plain torch ops)")


# ----------------------------------------------------------------------------- 05.flash_backward
def flash_backward_reference(q, k, v, o, lse, do):
    """memlab's answer: FA2's backward with one block covering the whole matrices."""
    return ref.flash_attention_backward(do, q, k, v, o, lse, block_q=1 << 30, block_k=1 << 30)


@register("05.flash_backward", reference=lambda: flash_backward_reference, title="backward from the logsumexp (FA2)")
def check_flash_backward(fn):
    for lq, lk, dv in ((6, 6, 8), (4, 9, 8), (9, 4, 5)):
        q, k, v = (_randn(2, 2, lq, 8, seed=7).requires_grad_(True), _randn(2, 2, lk, 8, seed=8).requires_grad_(True),
                   _randn(2, 2, lk, dv, seed=9).requires_grad_(True))
        o, lse = ref.chunked_attention(q.detach(), k.detach(), v.detach(), return_lse=True)
        do = _randn(2, 2, lq, dv, seed=10)
        want = torch.autograd.grad(ref.sdpa_reference(q, k, v), (q, k, v), do)
        got = _pair(f"fn(q, k, v, o, lse, do) with Lq={lq}, Lk={lk}",
                    fn(q.detach(), k.detach(), v.detach(), o, lse, do), 3)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            expect_tensor_close(f"{name} (Lq={lq}, Lk={lk}, head_dim=8, v dim={dv})", g, w, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- 05.causal_mask
def causal_mask_reference(q_start, q_end, k_start, k_end, lq, lk, causal):
    """memlab's answer: True where query i may see key j (absolute indices); None without a mask."""
    return ref._block_mask(ref._mode("causal_mask", causal), q_start, q_end, k_start, k_end, lq, lk, None)


@register("05.causal_mask", reference=lambda: causal_mask_reference, title="causal mask of one block, both corners")
def check_causal_mask(fn):
    cases = [(0, 4, 0, 4, 4, 4), (0, 3, 0, 5, 3, 5), (0, 5, 0, 3, 5, 3), (2, 5, 1, 4, 7, 7), (4, 8, 0, 4, 8, 12),
             (0, 4, 8, 12, 8, 12), (3, 6, 0, 2, 6, 2)]
    for qs, qe, ks, ke, lq, lk in cases:
        for causal in (True, "top_left", "bottom_right"):
            args = f"fn(q_start={qs}, q_end={qe}, k_start={ks}, k_end={ke}, Lq={lq}, Lk={lk}, causal={causal!r})"
            got = fn(qs, qe, ks, ke, lq, lk, causal)
            want = causal_mask_reference(qs, qe, ks, ke, lq, lk, causal)
            expect_type(args, got, torch.Tensor)
            expect(got.dtype == torch.bool and tuple(got.shape) == tuple(want.shape),
                   f"{args}: got {got.dtype} {tuple(got.shape)}, expected torch.bool {tuple(want.shape)}")
            expect(torch.equal(got, want), f"{args}: got\n{got.int().tolist()}\nexpected\n{want.int().tolist()}")
    expect(fn(0, 2, 0, 2, 2, 2, False) is None, "fn(..., causal=False) should return None (no mask)")


# ----------------------------------------------------------------------------- 05.predict_saved_bytes
def predict_saved_bytes_reference(batch, heads, seq, head_dim):
    """fp32, no mask: naive keeps the probabilities P; flash keeps the output O and the logsumexp."""
    return batch * heads * seq * seq * 4, batch * heads * seq * (head_dim + 1) * 4


@register("05.predict_saved_bytes", reference=lambda: predict_saved_bytes_reference,
          title="predict, then measure, the bytes saved for backward")
def check_predict_saved_bytes(fn):
    for b, h, s, d in ((1, 2, 64, 16), (2, 4, 128, 32), (1, 2, 256, 8)):
        got = fn(b, h, s, d)
        expect(isinstance(got, tuple) and len(got) == 2,
               f"fn({b}, {h}, {s}, {d}): expected a tuple (naive_bytes, flash_bytes), got {str(got)[:60]}")
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
        naive = ref.attention_saved_bytes(ref.naive_attention, q, k, v)
        flash = ref.attention_saved_bytes(ref.flash_attention, q, k, v)
        for name, pred, meas in (("naive_attention", got[0], naive), ("flash_attention", got[1], flash)):
            expect_close(f"batch={b}, heads={h}, seq={s}, head_dim={d}, fp32: predicted bytes {name} saves "
                         f"(measured with saved_tensors_hooks)", pred, float(meas), rtol=0.10)
    expect_equal("the prediction's ratio naive/flash grows with seq: fn(1,1,2048,64) naive > 30x flash",
                 fn(1, 1, 2048, 64)[0] > 30 * fn(1, 1, 2048, 64)[1], True)
