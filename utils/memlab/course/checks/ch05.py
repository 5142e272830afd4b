"""Checks for chapter 05, "chunked and flash attention"."""
from __future__ import annotations

import math
import os
import sys

import numpy
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # 05.triton_forward runs the kernel on CPU tensors in Triton's interpreter, which is chosen when triton is
    # first imported (torch.utils.flop_counter and memlab.profiler import it): choose it before they do
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.utils._python_dispatch

from memlab import attention as ref
from memlab.course.checks import (
    Space, differential, expect, expect_close, expect_equal, expect_tensor_close, expect_type, flags, ints, layouts,
    one_of, raise_if_triton_stub, register,
)


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
    """Grade exercise ``05.merge_partials``: merge two partial softmax results."""
    def run(case) -> None:
        q = _randn(*case.batch, case.lq, case.d, seed=case.seed)
        k, v = _randn(*case.batch, case.lk, case.d, seed=case.seed + 1), _randn(*case.batch, case.lk, case.dv, seed=case.seed + 2)
        qq, cut = q * case.mult, min(case.cut, case.lk - 1)
        o, lse = _attn_lse(qq, k, v)
        o1, l1 = _attn_lse(qq, k[..., :cut, :], v[..., :cut, :])
        o2, l2 = _attn_lse(qq, k[..., cut:, :], v[..., cut:, :])
        if case.empty != "none":  # a part that saw no key (output 0, logsumexp -inf): one of the two, or both
            o2, l2 = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
            o1, l1 = (o, lse) if case.empty == "one" else (o2.clone(), l2.clone())
            o, lse = (o, lse) if case.empty == "one" else (o2, l2)
        if case.order == "second first":
            o1, l1, o2, l2 = o2, l2, o1, l1
        if case.layout == "transposed":  # partials as a kernel may leave them: (..., L, d) seen through a transpose
            o1, o2 = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (o1, o2))
        got = _pair(f"fn(o1, lse1, o2, lse2) with keys split at {cut} ({case})", fn(o1, l1, o2, l2))
        what = f"keys split at {cut} of {case.lk}, scores up to {float((qq @ k.mT).abs().max()):.0f} ({case})"
        expect_tensor_close(f"merged output ({what})", got[0], o, rtol=1e-10, atol=1e-10)
        expect_tensor_close(f"merged logsumexp ({what})", got[1], lse, rtol=1e-10, atol=1e-10)

    edges = [dict(batch=(2,), lq=5, lk=9, d=8, dv=4, cut=c, mult=m, order="first first", layout="contiguous", seed=1,
                  empty="none") for c, m in ((4, 1.0), (1, 1.0), (8, 1.0), (3, 1000.0))]
    # any leading dims, lengths, head dims, cut and score scale (exp overflows without a max), either order, a part
    # that saw no key (one or both)
    space = Space(batch=one_of((2,), (1,), (2, 3), ()), lq=ints(1, 9), lk=ints(2, 17), d=ints(1, 16), dv=ints(1, 9),
                  cut=ints(1, 16), mult=one_of(1.0, 1000.0, 1e-3, 30.0), order=one_of("first first", "second first"),
                  layout=layouts("contiguous", "transposed"), empty=one_of("none", "one", "both"))
    differential(space, run, edges=edges, examples=25)
    q, k, v = _randn(2, 5, 8, seed=1), _randn(2, 9, 8, seed=2), _randn(2, 9, 4, seed=3)
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


# ----------------------------------------------------------------------------- shared by the exercises below
# The lab's causal is bottom-right aligned: query i of Lq sees key j of Lk when j <= i + Lk - Lq (FlashAttention
# >= 2.1, torch.nn.attention.bias.causal_lower_right). SDPA's is_causal=True is top-left aligned (j <= i); the two
# agree only when Lq == Lk. Every check tries Lq > Lk with causal: the first Lq - Lk query rows see no key, and their
# output is 0, their logsumexp -inf and their gradient 0 (as memlab.attention and SDPA with a boolean mask give). The
# checks of exercises 2-5 also compose the learner's function into SDPA's top-left is_causal (_top_left_*), as a
# caller would.
def _lab_causal(causal):
    return "bottom_right" if causal else False


def _exact(q, k, v, causal=False):
    """fp64 attention (output, logsumexp); any leading dims. ``causal``: True or "bottom_right" is the lab's mask,
    "top_left" SDPA's is_causal. A row that sees no key has output 0 (gradient 0, no NaN) and logsumexp -inf."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if not causal:
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
    lq, lk = q.shape[-2], k.shape[-2]
    seen = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(0 if causal == "top_left" else lk - lq)
    s = s.masked_fill(~seen, float("-inf"))
    empty = ~seen.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return p @ v, torch.logsumexp(s, -1)


def _empty_rows(lq, lk, causal):
    """How many query rows see no key: Lq - Lk under the lab's causal with Lq > Lk, else 0."""
    return max(0, lq - lk) if causal and causal != "top_left" else 0


def _no_nan(what, t, lq, lk):
    expect(not bool(torch.isnan(t.detach()).any()),
           f"{what}: NaN; with causal and Lq={lq} > Lk={lk} the first {lq - lk} query rows see no key: their output "
           f"is 0, their logsumexp -inf and their gradients 0 (while a row's running max is -inf subtract 0, not "
           f"-inf - -inf; divide by a sum of 0 as by 1; in backward a logsumexp of -inf gives P = 0)")


def _top_left_forward(fn, q, k, v, chunk):
    """SDPA's top-left is_causal (query i sees keys j <= i) from the lab's bottom-right fn(q, k, v, chunk, causal):
    with Lq <= Lk, bottom-right causal on the first Lq keys; with Lq > Lk, the first Lk queries bottom-right causal
    and the rest see every key."""
    lq, lk = q.shape[-2], k.shape[-2]
    if lq <= lk:
        return _pair(f"fn(q, k[..., :{lq}, :], v[..., :{lq}, :], {chunk}, causal=True)",
                     fn(q, k[..., :lq, :], v[..., :lq, :], chunk, causal=True))
    o1, l1 = _pair(f"fn(q[..., :{lk}, :], k, v, {chunk}, causal=True)", fn(q[..., :lk, :], k, v, chunk, causal=True))
    o2, l2 = _pair(f"fn(q[..., {lk}:, :], k, v, {chunk}, causal=False)", fn(q[..., lk:, :], k, v, chunk, causal=False))
    return torch.cat([o1, o2], -2), torch.cat([l1, l2], -1)


def _layouts(b, h, lq, lk, d, dv, seed, dtype=torch.float64):
    """q in a (B, L, H, D) buffer seen as (B, H, L, D) (non-contiguous, as a model's projections give it);
    k with head_dim not the last axis in memory (stride(-1) != 1, a channels_last-like layout); v contiguous."""
    q = _randn(b, lq, h, d, seed=seed).to(dtype).transpose(1, 2)
    k = _randn(b, h, d, lk, seed=seed + 1).to(dtype).transpose(-1, -2)
    v = _randn(b, h, lk, dv, seed=seed + 2).to(dtype)
    return q, k, v


def _ulp_close(name, got, want, dtype, rel=0.0):
    """|got - want| <= one unit in the last place of ``dtype`` at want's magnitude (+ rel * max|want|):
    what rounding an fp32-accumulated result once to ``dtype`` costs; a 16-bit running sum costs more."""
    expect_type(name, got, torch.Tensor)
    expect(tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    expect(got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype} (compute in fp32, return the input's dtype)")
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(torch.finfo(dtype).tiny))))
    err = (g - w).abs()
    bound = ulp + rel * w.abs().max()
    worst = (err / bound).nan_to_num(float("inf")).max().item()
    expect(worst <= 1.0, f"{name}: {dtype} result off by up to {worst:.1f}x the rounding of one fp32-accumulated "
                         f"result to {dtype} (max abs diff {err.max().item():.3g}): accumulate in fp32 and round once")


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor (elements) any op produces: an Lq x Lk score matrix shows up here."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), f"{func.__name__} -> {tuple(t.shape)}"
        return out


# ----------------------------------------------------------------------------- 05.chunked_forward
def chunked_forward_reference(q, k, v, kv_chunk, causal=False):
    """memlab's answer: all queries at once, keys ``kv_chunk`` at a time.

    ``q`` ``(..., Lq, d)``, ``k`` ``(..., Lk, d)``, ``v`` ``(..., Lk, dv)``; ``causal``: query i sees
    only keys j <= i + Lk - Lq (a row that sees none: output 0, logsumexp -inf). Returns ``(output, logsumexp)``,
    shaped ``(..., Lq, dv)`` and ``(..., Lq)``, the logsumexp in fp32 or fp64.
    """
    q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
    o, lse = ref.chunked_attention(q4, k4, v4, kv_chunk=kv_chunk, q_chunk=q.shape[-2], causal=_lab_causal(causal),
                                   return_lse=True)
    return o.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])


def _forward_extra_peak(fn, lq, lk, d, chunk):
    """Peak bytes of fn(q, k, v, chunk) under no_grad above its fp32 inputs, the inputs made inside the tracker."""
    from memlab.profiler import MemoryTracker

    with torch.no_grad(), MemoryTracker(timeline=False) as tr:
        q, k, v = (torch.randn(1, 2, n, d, generator=torch.Generator().manual_seed(i)) for i, n in enumerate((lq, lk, lk)))
        base = tr.current_bytes
        out = fn(q, k, v, chunk)
    del out
    return tr.peak_bytes - base


@register("05.chunked_forward", reference=lambda: chunked_forward_reference, title="online-softmax forward over key chunks",
          timeout=120)
def check_chunked_forward(fn):
    """Grade exercise ``05.chunked_forward``: online-softmax forward over key chunks."""
    q, k, v = _randn(2, 3, 7, 8, seed=4), _randn(2, 3, 13, 8, seed=5), _randn(2, 3, 13, 6, seed=6)
    for chunk, mult in ((4, 1.0), (5, 1.0), (1, 1.0), (13, 1.0), (100, 1.0), (3, 1000.0)):
        qq = q * mult
        want_o, want_l = _attn_lse(qq, k, v)
        got = _pair(f"fn(q, k, v, kv_chunk={chunk})", fn(qq, k, v, chunk))
        what = f"kv_chunk={chunk} (13 keys{', scores in the thousands' if mult > 1 else ''})"
        expect_tensor_close(f"output, {what}", got[0], want_o, rtol=1e-9, atol=1e-9)
        expect_tensor_close(f"logsumexp, {what}", got[1], want_l, rtol=1e-9, atol=1e-9)
    for lq, lk, chunk in ((7, 13, 4), (13, 13, 5), (1, 13, 4), (12, 29, 8)):
        q, k, v = _layouts(2, 3, lq, lk, 8, 6, seed=lq + lk)
        want_o, want_l = _exact(q, k, v, causal=True)
        got = _pair(f"fn(q, k, v, kv_chunk={chunk}, causal=True)", fn(q, k, v, chunk, causal=True))
        what = (f"causal, Lq={lq}, Lk={lk}, kv_chunk={chunk} (bottom-right: query i sees keys j <= i + Lk - Lq; "
                f"q and k non-contiguous)")
        expect_tensor_close(f"output, {what}", got[0], want_o, rtol=1e-9, atol=1e-9)
        expect_tensor_close(f"logsumexp, {what}", got[1], want_l, rtol=1e-9, atol=1e-9)
    def run(case) -> None:
        q, k, v = _layouts(case.b, case.h, case.lq, case.lk, case.d, case.dv, seed=case.seed)
        if case.contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if case.dims != 4:  # (B*H, L, d) or (B, H, 1, L, d): any leading dims
            shape = (lambda t: (-1, *t.shape[-2:])) if case.dims == 3 else (lambda t: (t.shape[0], t.shape[1], 1, *t.shape[-2:]))
            q, k, v = (t.reshape(shape(t)) for t in (q, k, v))
        causal = case.align != "none"
        want_o, want_l = _exact(q, k, v, causal=case.align if causal else False)
        what = (f"Lq={case.lq}, Lk={case.lk}, kv_chunk={case.chunk}, causal={case.align if causal else False}"
                f"{' (composed: SDPA is_causal)' if case.align == 'top_left' else ''} ({case})")
        if case.align == "top_left":
            got = _top_left_forward(fn, q, k, v, case.chunk)
        else:
            got = _pair(f"fn(q, k, v, kv_chunk={case.chunk}, causal={causal})", fn(q, k, v, case.chunk, causal=causal))
        if _empty_rows(case.lq, case.lk, case.align if causal else False):
            _no_nan(f"output, {what}", got[0], case.lq, case.lk)
        expect_tensor_close(f"output, {what}", got[0], want_o, rtol=1e-9, atol=1e-9)
        expect_tensor_close(f"logsumexp, {what} (-inf for a row that sees no key)", got[1], want_l, rtol=1e-9, atol=1e-9)

    # Lq > Lk with causal: rows that see no key (edges: none but the last; one key; one empty row; chunk past Lk)
    edges = [dict(b=1, h=2, lk=lk, rel="Lq > Lk", lq=lq, d=8, dv=6, chunk=c, align=a, contiguous=False, dims=4, seed=lq)
             for lq, lk, c, a in ((13, 7, 4, "bottom_right"), (17, 1, 1, "bottom_right"), (24, 23, 5, "bottom_right"),
                                  (40, 12, 64, "bottom_right"), (20, 9, 4, "none"), (29, 12, 8, "top_left"))]
    # any lengths (Lq > Lk, Lq <= Lk), chunk (1, uneven, past the end), head dims, batch and heads, no mask, the lab's
    # causal or SDPA's is_causal composed from it, q and k non-contiguous or not, 3-5 dims
    space = Space(b=ints(1, 2), h=ints(1, 3), lk=ints(1, 30), rel=one_of("Lq > Lk", "Lq <= Lk"),
                  lq=lambda c: ints(c.lk + 1, c.lk + 24) if c.rel == "Lq > Lk" else ints(1, c.lk),
                  d=ints(1, 12), dv=ints(1, 9), chunk=ints(1, 45), align=one_of("bottom_right", "none", "top_left"),
                  contiguous=flags(), dims=one_of(4, 3, 5))
    differential(space, run, edges=edges, examples=12)
    # bf16 inputs: accumulate in fp32, return the output in bf16 and the logsumexp in fp32
    q, k, v = _layouts(1, 2, 16, 512, 16, 16, seed=40, dtype=torch.bfloat16)
    want_o, want_l = _exact(q, k, v, causal=True)
    got = _pair("fn(q, k, v, 16, causal=True) on bf16 inputs", fn(q, k, v, 16, causal=True))
    _ulp_close("output for bf16 inputs, 512 keys in chunks of 16", got[0], want_o, torch.bfloat16, rel=1e-5)
    expect(got[1].dtype == torch.float32, f"logsumexp for bf16 inputs: dtype {got[1].dtype}, expected torch.float32 "
                                          f"(keep the running max and sum in fp32)")
    expect_tensor_close("logsumexp for bf16 inputs (fp32)", got[1], want_l.float(), rtol=0, atol=1e-5)
    # the device: buffers made without device= land on the CPU; the meta device (no data) shows it on any machine
    qm, km, vm = (torch.empty(2, 2, n, 8, device="meta") for n in (5, 9, 9))
    try:
        got = _pair("fn(q, k, v, 4, causal=True) on meta tensors", fn(qm, km, vm, 4, causal=True))
    except (RuntimeError, NotImplementedError) as e:
        raise AssertionError(f"fn(q, k, v, 4) on tensors of device 'meta' raised {type(e).__name__}: {str(e)[:160]}; "
                             f"make every buffer on q's device (torch.full(..., device=q.device)) so that it runs on "
                             f"CUDA too") from None
    for name, t, shape in (("output", got[0], (2, 2, 5, 8)), ("logsumexp", got[1], (2, 2, 5))):
        expect(t.device.type == "meta" and tuple(t.shape) == shape,
               f"{name} on meta inputs: got {t.device} {tuple(t.shape)}, expected meta {shape}")
    # the memory: peak above the inputs (no_grad) grows with kv_chunk and stays far below one Lq x Lk matrix
    lq, lk, d = 64, 1024, 16
    small, large = _forward_extra_peak(fn, lq, lk, d, 16), _forward_extra_peak(fn, lq, lk, d, lk)
    scores = 2 * lq * lk * 4
    expect(small <= scores // 4, f"no_grad peak above the inputs with kv_chunk=16 (Lq={lq}, Lk={lk}, 2 heads, fp32): "
                                 f"{small} bytes; one Lq x Lk score matrix is {scores}: the forward must hold one "
                                 f"Lq x kv_chunk block at a time, not every key's scores")
    expect(large >= 4 * small, f"no_grad peak above the inputs: {small} bytes with kv_chunk=16, {large} with "
                               f"kv_chunk={lk}: the peak should grow with the chunk (it holds Lq x kv_chunk scores)")
    q32, k32, v32 = (t.float().requires_grad_(True) for t in (q, k, v))
    o = _pair("fn(q, k, v, 4) on fp32 inputs", fn(q32, k32, v32, 4))[0]
    expect(o.dtype == torch.float32, f"fp32 inputs gave a {o.dtype} output, expected torch.float32")
    expect(o.requires_grad, "the output has no grad_fn: the forward must stay differentiable (plain torch ops)")


# ----------------------------------------------------------------------------- 05.flash_backward
def flash_backward_reference(q, k, v, o, lse, do, causal=False, block=16):
    """memlab's answer: FA2's backward (Algorithm 2) in block x block tiles, skipping fully masked tiles,
    from the forward's output ``o`` and logsumexp ``lse`` and the output's gradient ``do``;
    ``(dq, dk, dv)``, shaped like ``q``, ``k`` and ``v``."""
    return ref.flash_attention_backward(do, q, k, v, o, lse, causal=_lab_causal(causal), block_q=block, block_k=block)


def _grads(q, k, v, do, causal):
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    return torch.autograd.grad(_exact(q, k, v, causal)[0], (q, k, v), do.double())


def _backward_inputs(b, h, lq, lk, d, dv, seed, dtype=torch.float64, causal=False):
    q, k, v = _layouts(b, h, lq, lk, d, dv, seed, dtype)
    o, lse = _exact(q, k, v, causal)
    do = _randn(b, h, lq, dv, seed=seed + 3).to(dtype)
    return q, k, v, o.to(dtype), lse.to(torch.promote_types(dtype, torch.float32)), do


def _top_left_backward(fn, q, k, v, o, lse, do, block):
    """SDPA's top-left is_causal gradients from the lab's bottom-right fn (as _top_left_forward): with Lq <= Lk the
    keys past Lq get 0; with Lq > Lk the two query parts' dk and dv add up."""
    lq, lk = q.shape[-2], k.shape[-2]
    if lq <= lk:
        dq, dk, dv = _pair(f"fn(q, k[..., :{lq}, :], v[..., :{lq}, :], o, lse, do, True, {block})",
                           fn(q, k[..., :lq, :], v[..., :lq, :], o, lse, do, True, block), 3)
        pad = (lambda t: torch.cat([t, t.new_zeros(*t.shape[:-2], lk - lq, t.shape[-1])], -2)) if lq < lk else (lambda t: t)
        return dq, pad(dk), pad(dv)
    a = _pair(f"fn(q[..., :{lk}, :], k, v, ..., True, {block})",
              fn(q[..., :lk, :], k, v, o[..., :lk, :], lse[..., :lk], do[..., :lk, :], True, block), 3)
    b = _pair(f"fn(q[..., {lk}:, :], k, v, ..., False, {block})",
              fn(q[..., lk:, :], k, v, o[..., lk:, :], lse[..., lk:], do[..., lk:, :], False, block), 3)
    return torch.cat([a[0], b[0]], -2), a[1] + b[1], a[2] + b[2]


@register("05.flash_backward", reference=lambda: flash_backward_reference, title="tiled backward from the logsumexp (FA2)",
          timeout=120)
def check_flash_backward(fn):
    """Grade exercise ``05.flash_backward``: tiled backward from the logsumexp (FA2)."""
    def run(case) -> None:
        causal = case.align != "none"
        mask = case.align if causal else False
        q, k, v, o, lse, do = _backward_inputs(1, 2, case.lq, case.lk, case.d, case.dv, seed=case.seed, causal=mask)
        want = _grads(q, k, v, do, mask)
        if case.align == "top_left":
            got = _top_left_backward(fn, q, k, v, o, lse, do, case.block)
        else:
            got = _pair(f"fn(q, k, v, o, lse, do, causal={causal}, block={case.block})",
                        fn(q, k, v, o, lse, do, causal, case.block), 3)
        what = (f"Lq={case.lq}, Lk={case.lk}, block={case.block}, causal={mask}"
                f"{' (composed: SDPA is_causal)' if case.align == 'top_left' else ''}; {case}")
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            if _empty_rows(case.lq, case.lk, mask):
                _no_nan(f"{name} ({what})", g, case.lq, case.lk)
            expect_tensor_close(f"{name} ({what})", g, w, rtol=1e-9, atol=1e-9)

    # Lq > Lk with causal: rows that see no key (one key; one empty row; a block past Lk; a block of 1)
    edges = [dict(lk=lk, rel="Lq > Lk", lq=lq, d=8, dv=6, block=bl, align=a, seed=lq)
             for lq, lk, bl, a in ((40, 24, 16, "bottom_right"), (17, 1, 5, "bottom_right"), (33, 32, 8, "bottom_right"),
                                   (20, 7, 64, "bottom_right"), (9, 4, 1, "bottom_right"), (40, 24, 16, "top_left"))]
    # any lengths (Lq > Lk, Lq <= Lk; odd, shorter than a block), block sizes (1, uneven), head dims, no mask, the lab's
    # causal or SDPA's is_causal composed from it
    space = Space(lk=ints(1, 40), rel=one_of("Lq > Lk", "Lq <= Lk"),
                  lq=lambda c: ints(c.lk + 1, c.lk + 24) if c.rel == "Lq > Lk" else ints(1, c.lk),
                  d=ints(1, 12), dv=ints(1, 9), block=one_of(16, 1, 5, 8, 64),
                  align=one_of("bottom_right", "none", "top_left"))
    differential(space, run, edges=edges, examples=10)
    # the hand-picked cases after the drawn ones (those first: the space alone must catch a mistake)
    for lq, lk, dv, causal, block in ((40, 56, 8, False, 16), (40, 56, 8, True, 16), (56, 40, 6, False, 16),
                                      (48, 48, 8, True, 16), (37, 53, 8, True, 8), (24, 24, 8, True, 5),
                                      (40, 56, 8, True, 64), (56, 40, 8, True, 16), (45, 37, 6, True, 8)):
        q, k, v, o, lse, do = _backward_inputs(1, 2, lq, lk, 8, dv, seed=lq + lk, causal=causal)
        want = _grads(q, k, v, do, causal)
        what = f"Lq={lq}, Lk={lk}, v dim={dv}, causal={causal}, block={block}"
        with _Largest() as big:
            got = _pair(f"fn(q, k, v, o, lse, do, causal={causal}, block={block})",
                        fn(q, k, v, o, lse, do, causal, block), 3)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            expect_tensor_close(f"{name} ({what})", g, w, rtol=1e-9, atol=1e-9)
        inputs = max(t.numel() for t in (q, k, v, o, do))
        tile = 2 * min(block, lq) * min(block, lk)
        expect(big.numel <= max(inputs, tile),
               f"{what}: the largest tensor made inside fn has {big.numel} elements ({big.op}); the inputs have at "
               f"most {inputs} and one block x block tile of the 2 heads {tile}: work in tiles of block x block "
               f"(recompute P = exp(S - lse) per tile), never a whole row of blocks or the Lq x Lk matrix")
    # causal: tiles right of the diagonal are skipped, not computed and masked
    from torch.utils.flop_counter import FlopCounterMode

    flops = {}
    for causal in (False, True):
        args = _backward_inputs(1, 2, 64, 64, 8, 8, seed=60, causal=causal)
        with FlopCounterMode(display=False) as fc:
            fn(*args, causal, 16)
        flops[causal] = fc.get_total_flops()
    expect(flops[False] > 0, "no matrix multiplication was counted (FlopCounterMode): use torch matmuls (@, einsum)")
    ratio = flops[True] / flops[False]
    expect(ratio <= 10 / 16 + 0.01, f"causal, Lq = Lk = 64, block 16: {ratio:.2f} of the non-causal FLOPs; only 10 of "
                                    f"the 16 tiles hold a visible score: skip the tiles right of the diagonal "
                                    f"(their P is 0), do not compute and mask them")
    # bf16: fp32 inside, gradients returned in bf16
    q, k, v, o, lse, do = _backward_inputs(1, 2, 40, 120, 16, 16, seed=70, dtype=torch.bfloat16, causal=True)
    want = flash_backward_reference(*(t.double() for t in (q, k, v, o, lse, do)), True, 16)
    got = _pair("fn(q, k, v, o, lse, do, True, 16) on bf16 inputs", fn(q, k, v, o, lse, do, True, 16), 3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _ulp_close(f"{name} for bf16 inputs (Lq=40, Lk=120, block 16, causal)", g, w, torch.bfloat16, rel=1e-4)


# ----------------------------------------------------------------------------- 05.flash_function
class FlashAttentionReference(torch.autograd.Function):
    """memlab's answer: forward saves q, k, v, O and the logsumexp; backward is FA2's tiled backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False):  # type: ignore[override]
        """Tiled forward; saves q, k, v, O and the logsumexp (O(L) beyond the inputs); the output is
        shaped like ``q`` with ``v``'s last dimension."""
        o, lse = ref.flash_attention_forward(q, k, v, causal=_lab_causal(causal), block_q=16, block_k=16)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        """FA2's tiled backward from the saved tensors: ``(dq, dk, dv, None)``, no gradient for ``causal``."""
        q, k, v, o, lse = ctx.saved_tensors
        return (*flash_backward_reference(q, k, v, o, lse, do, ctx.causal, 16), None)


def _ctx_tensors(grad_fn):
    """Tensors hanging off the ctx as attributes (ctx.p = p): kept alive until backward like saved ones."""
    found = []
    for name, val in vars(grad_fn).items():
        vals = val if isinstance(val, (list, tuple)) else list(val.values()) if isinstance(val, dict) else [val]
        found += [(name, t) for t in vals if isinstance(t, torch.Tensor)]
    return found


@register("05.flash_function", reference=lambda: FlashAttentionReference, title="autograd.Function that saves O(L)",
          timeout=120)
def check_flash_function(cls):
    """Grade exercise ``05.flash_function``: autograd.Function that saves O(L)."""
    expect(isinstance(cls, type) and issubclass(cls, torch.autograd.Function),
           f"expected a subclass of torch.autograd.Function (the class itself), got {str(cls)[:80]}")
    def run(case) -> None:
        causal = case.align != "none"
        mask = case.align if causal else False
        q, k, v = (t.requires_grad_(True) for t in _layouts(case.b, case.h, case.lq, case.lk, case.d, case.dv,
                                                            seed=case.seed, dtype=case.dtype))
        what = (f"Lq={case.lq}, Lk={case.lk}, causal={mask}{' (composed: SDPA is_causal)' if case.align == 'top_left' else ''}, "
                f"{case.dtype} ({case})")
        if case.align != "top_left":
            o = cls.apply(q, k, v, causal)
        elif case.lq <= case.lk:  # SDPA's is_causal from the lab's, as _top_left_forward
            o = cls.apply(q, k[..., :case.lq, :], v[..., :case.lq, :], True)
        else:
            o = torch.cat([cls.apply(q[..., :case.lk, :], k, v, True), cls.apply(q[..., case.lk:, :], k, v, False)], -2)
        expect_type(f"cls.apply(q, k, v, {causal}) ({what})", o, torch.Tensor)
        want_o, _ = _exact(q.detach(), k.detach(), v.detach(), mask)
        do = _randn(*o.shape, seed=case.seed + 5).to(case.dtype)
        got = torch.autograd.grad(o, (q, k, v), do)
        want = _grads(q, k, v, do, mask)
        if _empty_rows(case.lq, case.lk, mask):
            for name, t in zip(("output", "dq", "dk", "dv"), (o, *got)):
                _no_nan(f"{name} ({what})", t, case.lq, case.lk)
        # fp64: to fp64 precision; fp32: within 1e-5 (an fp32-accumulated answer is within ~1e-6 here, one that
        # keeps a 16-bit running sum or drops the rescale is off by 1e-3 or more)
        tol = 1e-9 if case.dtype == torch.float64 else 1e-5
        expect_tensor_close(f"output ({what})", o, want_o.to(case.dtype), rtol=tol, atol=tol)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            expect_tensor_close(f"{name} ({what})", g, w.to(case.dtype), rtol=tol, atol=tol)

    # Lq > Lk with causal (rows that see no key), Lq != Lk both ways, fp32 and fp64, no mask, the lab's causal or
    # SDPA's is_causal composed from it, head dims, batch and heads
    edges = [dict(b=1, h=2, lk=lk, rel="Lq > Lk", lq=lq, d=8, dv=6, align=a, dtype=t, seed=lq)
             for lq, lk, a, t in ((40, 24, "bottom_right", torch.float32), (17, 1, "bottom_right", torch.float64),
                                  (33, 32, "bottom_right", torch.float32), (40, 24, "top_left", torch.float64))]
    space = Space(b=ints(1, 2), h=ints(1, 2), lk=ints(1, 40), rel=one_of("Lq > Lk", "Lq <= Lk"),
                  lq=lambda c: ints(c.lk + 1, c.lk + 24) if c.rel == "Lq > Lk" else ints(1, c.lk),
                  d=ints(1, 12), dv=ints(1, 9), align=one_of("bottom_right", "none", "top_left"),
                  dtype=one_of(torch.float64, torch.float32))
    differential(space, run, edges=edges, examples=10)
    # the hand-picked cases after the drawn ones (those first: the space alone must catch a mistake)
    for (lq, lk, causal, dtype) in ((24, 40, True, torch.float64), (40, 24, False, torch.float64),
                                    (33, 33, True, torch.float64), (24, 72, True, torch.bfloat16),
                                    (40, 24, True, torch.float64), (48, 17, True, torch.bfloat16)):
        q, k, v = (t.requires_grad_(True) for t in _layouts(2, 2, lq, lk, 8, 8, seed=lq * lk, dtype=dtype))
        what = f"Lq={lq}, Lk={lk}, causal={causal}, {dtype}"
        o = cls.apply(q, k, v, causal)
        expect_type(f"cls.apply(q, k, v, {causal}) ({what})", o, torch.Tensor)
        if _empty_rows(lq, lk, causal):
            _no_nan(f"output ({what})", o, lq, lk)
        expect(o.grad_fn is not None and getattr(o.grad_fn, "_forward_cls", None) is cls,
               f"{what}: the output's grad_fn is {type(o.grad_fn).__name__}, expected {cls.__name__}Backward: return "
               f"the output of forward itself (not a tensor computed from it outside the Function)")
        saved = list(o.grad_fn.saved_tensors)
        acc = torch.promote_types(dtype, torch.float32)
        for name, t in (("q", q), ("k", k), ("v", v)):
            expect(any(s.data_ptr() == t.data_ptr() and s.shape == t.shape and s.stride() == t.stride() and s.dtype == dtype
                       for s in saved),
                   f"{what}: {name} is not among grad_fn.saved_tensors as the input itself: save q, k, v as given "
                   f"(a copy, a .contiguous() or an fp32 version is a new tensor of the same size kept until backward)")
        rest = [s for s in saved if not any(s.data_ptr() == t.data_ptr() and s.shape == t.shape for t in (q, k, v))]
        shapes = [f"{tuple(s.shape)} {s.dtype}" for s in saved]
        expect(len(rest) == 2, f"{what}: grad_fn.saved_tensors holds {len(saved)} tensors ({', '.join(shapes)}); "
                               f"expected exactly five: q, k, v, the output O and the logsumexp")
        outs = [s for s in rest if s.shape == o.shape]
        lses = [s for s in rest if tuple(s.shape) == tuple(o.shape[:-1])]
        expect(len(outs) == 1 and len(lses) == 1,
               f"{what}: besides q, k, v the saved tensors are {', '.join(f'{tuple(s.shape)} {s.dtype}' for s in rest)}; "
               f"expected the output {tuple(o.shape)} and the logsumexp {tuple(o.shape[:-1])}")
        expect(outs[0].dtype == dtype and torch.equal(outs[0].detach(), o.detach()),
               f"{what}: the saved output differs from the returned output (dtype {outs[0].dtype})")
        expect(lses[0].dtype == acc, f"{what}: the saved logsumexp has dtype {lses[0].dtype}, expected {acc}: a 16-bit "
                                     f"logsumexp of ~{float(lses[0].float().abs().max()):.1f} is off by more than "
                                     f"the scores' own precision, and every recomputed P with it")
        extra = _ctx_tensors(o.grad_fn)
        expect(not extra, f"{what}: ctx holds tensors as attributes ({', '.join(f'ctx.{n}: {tuple(t.shape)}' for n, t in extra)}): "
                          f"keep tensors for backward only through ctx.save_for_backward (q, k, v, O, logsumexp)")
        want_o, want_l = _exact(q.detach(), k.detach(), v.detach(), causal)
        do = _randn(*o.shape, seed=lq + 5).to(dtype)
        got = torch.autograd.grad(o, (q, k, v), do)
        want = _grads(q, k, v, do, causal)
        if _empty_rows(lq, lk, causal):
            for name, t in (("dq", got[0]), ("dk", got[1]), ("dv", got[2])):
                _no_nan(f"{name} ({what})", t, lq, lk)
        if dtype == torch.float64:
            expect_tensor_close(f"output ({what})", o, want_o, rtol=1e-9, atol=1e-9)
            expect_tensor_close(f"saved logsumexp ({what})", lses[0], want_l, rtol=1e-9, atol=1e-9)
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                expect_tensor_close(f"{name} ({what})", g, w, rtol=1e-9, atol=1e-9)
        else:  # 16-bit: against exact arithmetic on the very tensors it saved (its own O and logsumexp)
            _ulp_close(f"output ({what})", o, want_o, dtype, rel=1e-5)
            exact = flash_backward_reference(*(t.detach().double() for t in (q, k, v, outs[0], lses[0], do)),
                                             causal, 16)
            for name, g, w in zip(("dq", "dk", "dv"), got, exact):
                _ulp_close(f"{name} ({what})", g, w, dtype, rel=1e-4)
    # tiles in both passes: no tensor as large as a quarter of the 2 heads' Lq x Lk matrices
    q, k, v = (t.requires_grad_(True) for t in _layouts(1, 2, 128, 128, 8, 8, seed=128))
    quarter = 2 * 128 * 128 // 4
    with _Largest() as big_f:
        o = cls.apply(q, k, v, True)
    with _Largest() as big_b:
        o.backward(torch.ones_like(o))
    for phase, big in (("forward", big_f), ("backward", big_b)):
        expect(big.numel < quarter, f"{phase} at Lq = Lk = 128 (2 heads) made a tensor of {big.numel} elements "
                                    f"({big.op}); a quarter of the score matrices is {quarter}: use blocks of 16 "
                                    f"(your chunked_forward and flash_backward), never the Lq x Lk matrix")


# ----------------------------------------------------------------------------- 05.triton_forward
def triton_forward_reference():
    """memlab's answer: the ``triton.jit`` kernel memlab.attention.triton_kernels.flash_fwd_kernel
    (imported here: it imports triton)."""
    from memlab.attention.triton_kernels import flash_fwd_kernel

    return flash_fwd_kernel


def _triton_device():
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if torch.cuda.is_available():
        return torch.device("cuda"), False
    expect(isinstance(tl.zeros, InterpretedFunction),
           "triton was imported without TRITON_INTERPRET=1 and there is no CUDA device: on a CPU, set "
           "os.environ['TRITON_INTERPRET'] = '1' before the first `import triton` (restart the kernel, run the "
           "lab's first cells in order)")
    return torch.device("cpu"), True


def _exact_masked(q, k, v, align):
    """fp64 attention (output, logsumexp) under ``align`` ("none", "bottom_right" or "top_left"); a query row
    that sees no key (bottom-right with Lq > Lk: rows i < Lq - Lk) has output 0 and logsumexp -inf."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    if align != "none":
        seen = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq if align == "bottom_right" else 0)
        s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))  # empty rows: exp(-inf) = 0
    return p @ v, lse


def _launch_top_left(kernel, q, k, v, block_m, block_n):
    """SDPA's is_causal (top-left: query i sees keys j <= i) from a bottom-right kernel, the way a caller gets it:
    with Lq <= Lk no query sees past key Lq - 1, so it is bottom-right causal on the first Lq keys; with Lq > Lk
    the first Lk queries are bottom-right causal on all keys and the rest see every key (written into views of
    one output)."""
    from memlab.attention.triton_kernels import launch_flash_fwd

    lq, lk = q.shape[2], k.shape[2]
    if lq <= lk:
        return launch_flash_fwd(kernel, q, k[:, :, :lq], v[:, :, :lq], True, block_m, block_n)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    _, l1 = launch_flash_fwd(kernel, q[:, :, :lk], k, v, True, block_m, block_n, out=o[:, :, :lk])
    _, l2 = launch_flash_fwd(kernel, q[:, :, lk:], k, v, False, block_m, block_n, out=o[:, :, lk:])
    return o, torch.cat([l1, l2], dim=2)


@register("05.triton_forward", reference=triton_forward_reference, title="FA2 forward in Triton (interpreter on CPU)",
          timeout=300)
def check_triton_forward(kernel):
    """Grade exercise ``05.triton_forward``: FA2 forward in Triton (interpreter on CPU)."""
    expect(type(kernel).__module__.startswith("triton") and hasattr(kernel, "__getitem__"),
           f"expected a @triton.jit kernel, got {type(kernel).__name__}"
           + ("" if ref.triton_available() else " (triton is not installed here: pip install triton, on Linux x86_64)"))
    from memlab.attention.triton_kernels import launch_flash_fwd

    raise_if_triton_stub(kernel)
    device, interpreted = _triton_device()

    def run(case) -> None:
        q, k, v = (t.to(device) for t in _layouts(case.b, case.h, case.lq, case.lk, case.d, case.d, seed=case.seed,
                                                   dtype=case.dtype))
        before = [t.clone() for t in (q, k, v)]
        causal = case.align != "none"
        what = (f"Lq={case.lq}, Lk={case.lk}, D={case.d}, causal={case.align if causal else False}, {case.dtype}, "
                f"BLOCK_M={case.bm}, BLOCK_N={case.bn}, q and k non-contiguous ({case})")
        try:
            with numpy.errstate(all="ignore"):  # the interpreter's numpy warns on log(0) = -inf, a right answer
                if case.align == "top_left":
                    o, lse = _launch_top_left(kernel, q, k, v, case.bm, case.bn)
                else:
                    o, lse = launch_flash_fwd(kernel, q, k, v, causal, case.bm, case.bn)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile or run is a failure, said plainly
            raise AssertionError(f"launching the kernel ({what}) raised {type(e).__name__}: {str(e)[:300]}") from None
        for name, t, b in zip("qkv", (q, k, v), before):
            expect(torch.equal(t, b), f"{what}: the kernel wrote into {name} (tl.store to {name.upper()}): leave the "
                                      f"inputs as they are")
        want_o, want_l = _exact_masked(q.cpu(), k.cpu(), v.cpu(), case.align)
        if case.align == "top_left":  # the reference of SDPA's is_causal, from torch itself (any empty row is not)
            sdpa = torch.nn.functional.scaled_dot_product_attention(q.cpu().double(), k.cpu().double(),
                                                                    v.cpu().double(), is_causal=True)
            expect(torch.allclose(sdpa, want_o, atol=1e-9), "internal: the top-left reference differs from SDPA")
        empty = torch.isinf(want_l)
        if bool(empty.any()):
            rows = int(empty[0, 0].sum())
            expect(not bool(torch.isnan(o.cpu()).any()),
                   f"{what}: the output has NaN; the first {rows} query rows see no key (bottom-right with Lq > Lk): "
                   f"their output is 0 and their logsumexp -inf (a max of -inf must not be subtracted: "
                   f"-inf - -inf is NaN; divide by a sum of 0 as by 1)")
        if case.dtype == torch.float32:
            tol = 1e-5 if interpreted else 5e-3  # compiled fp32 tl.dot uses TF32 on CUDA
            expect_tensor_close(f"O ({what})", o.cpu(), want_o.float(), rtol=0, atol=tol)
        else:
            expect_tensor_close(f"O ({what})", o.cpu(), want_o.to(case.dtype), rtol=0, atol=2e-3)
        expect_tensor_close(f"LSE ({what}; fp32, natural log; -inf for a row that sees no key)", lse.cpu(),
                            want_l.float(), rtol=0, atol=1e-5 if interpreted else 5e-3)

    f32, f16 = torch.float32, torch.float16
    edges = [dict(b=1, h=2, lq=lq, lk=lk, d=d, align=a, dtype=t, bm=16, bn=16, seed=lq + lk)
             for lq, lk, d, a, t in ((37, 53, 16, "none", f32), (37, 53, 16, "bottom_right", f32),
                                     (53, 37, 16, "none", f32), (32, 32, 32, "bottom_right", f32),
                                     (21, 40, 16, "bottom_right", f16),
                                     # Lq > Lk: bottom-right leaves the first Lq - Lk rows without a key
                                     (53, 37, 16, "bottom_right", f32), (45, 37, 16, "bottom_right", f32),
                                     (64, 8, 16, "bottom_right", f32), (17, 1, 16, "bottom_right", f32),
                                     (40, 24, 16, "bottom_right", f16),
                                     (53, 37, 16, "top_left", f32), (21, 40, 16, "top_left", f32))]
    # any lengths (Lq > Lk too, one key, one query), head dims 16-64, blocks 16 or 32 (not always equal), fp32 and
    # fp16, no mask or causal under either alignment; a batch and heads past one (the interpreter is slow: small)
    space = Space(b=ints(1, 2), h=ints(1, 2), lq=ints(1, 70), lk=ints(1, 70), d=one_of(16, 32, 64),
                  align=one_of("bottom_right", "none", "top_left"), dtype=one_of(f32, f16), bm=one_of(16, 32),
                  bn=one_of(16, 32))
    differential(space, run, edges=edges, examples=12)


# ----------------------------------------------------------------------------- 05.predict_saved_bytes
def predict_saved_bytes_reference(batch, heads, seq, head_dim):
    """``(naive_bytes, flash_bytes)`` saved for backward, fp32, no mask: naive keeps the probabilities P;
    flash keeps the output O and the logsumexp."""
    return batch * heads * seq * seq * 4, batch * heads * seq * (head_dim + 1) * 4


@register("05.predict_saved_bytes", reference=lambda: predict_saved_bytes_reference,
          title="predict, then measure, the bytes saved for backward")
def check_predict_saved_bytes(fn):
    """Grade exercise ``05.predict_saved_bytes``: predict, then measure, the bytes saved for backward."""
    def run(case) -> None:
        b, h, s, d = case.b, case.h, case.s, case.d
        got = fn(b, h, s, d)
        expect(isinstance(got, tuple) and len(got) == 2,
               f"fn({b}, {h}, {s}, {d}): expected a tuple (naive_bytes, flash_bytes), got {str(got)[:60]}")
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
        naive = ref.attention_saved_bytes(ref.naive_attention, q, k, v)
        flash = ref.attention_saved_bytes(ref.flash_attention, q, k, v)
        for name, pred, meas in (("naive_attention", got[0], naive), ("flash_attention", got[1], flash)):
            expect_close(f"batch={b}, heads={h}, seq={s}, head_dim={d}, fp32: predicted bytes {name} saves "
                         f"(measured with saved_tensors_hooks; the count is exact)", pred, float(meas), rtol=0)

    edges = [dict(b=b, h=h, s=s, d=d) for b, h, s, d in ((1, 2, 64, 16), (2, 4, 128, 32), (1, 2, 256, 8))]
    # any batch, heads, length (odd, shorter than a block) and head dim
    differential(Space(b=ints(1, 3), h=ints(1, 4), s=ints(1, 130), d=ints(1, 40)), run, edges=edges, examples=6)
    expect_equal("the prediction's ratio naive/flash grows with seq: fn(1,1,2048,64) naive > 30x flash",
                 fn(1, 1, 2048, 64)[0] > 30 * fn(1, 1, 2048, 64)[1], True)
