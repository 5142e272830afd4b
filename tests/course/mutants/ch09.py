"""Plausible wrong answers to chapter 09's exercises; tests/course/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs. The Triton kernels run in Triton's
interpreter on a CPU: TRITON_INTERPRET=1 is set below before triton is imported (when no GPU is present).
"""
from __future__ import annotations

import os
import sys
import types

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


# ----------------------------------------------------------------------------- 09.predict_loss_bytes
def predict_counts_the_logits_dtype(tokens, vocab, dtype):
    """the log-softmax kept in the logits' dtype (2 bytes in bf16), not fp32."""
    size = torch.finfo(dtype).bits // 8
    return size * tokens * vocab + 8 * tokens, 12 * tokens * vocab


def predict_forgets_the_labels(tokens, vocab, dtype):
    """the int64 shifted labels that nll_loss keeps left out."""
    return 4 * tokens * vocab, 12 * tokens * vocab


def predict_forward_peak(tokens, vocab, dtype):
    """the peak taken in forward: logits, upcast and log-softmax (10 bytes a logit in bf16)."""
    size = torch.finfo(dtype).bits // 8
    return 4 * tokens * vocab + 8 * tokens, (size + 8) * tokens * vocab


def predict_two_fp32_copies(tokens, vocab, dtype):
    """the backward's peak counted as the kept log-softmax and one gradient (8 bytes a logit)."""
    return 4 * tokens * vocab + 8 * tokens, 8 * tokens * vocab


# ----------------------------------------------------------------------------- 09.fused_linear_cross_entropy
def _fused(*, save_logits=False, hard_ignore=None, mean_over_all=False, bf16_softmax=False, bf16_accumulate=False,
           grads_in_forward=False, whole_logits=False, fp32_grads=False):
    """A correct fused linear + cross-entropy, unless a flag says otherwise (one flag = one mistake)."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets, chunk_size, ignore_index):
            ii = ignore_index if hard_ignore is None else hard_ignore
            acc = torch.promote_types(hidden.dtype, torch.float32)
            comp = hidden.dtype if bf16_softmax else acc
            n = hidden.shape[0]
            valid = targets != ii
            safe = torch.where(valid, targets, 0)
            lse = torch.empty(n, dtype=acc)
            total = torch.zeros((), dtype=acc)
            kept = []
            step = n if whole_logits else chunk_size
            for s in range(0, n, step):
                z = (hidden[s:s + step] @ weight.T).to(comp)
                lse[s:s + step] = torch.logsumexp(z, -1).to(acc)
                total += torch.where(valid[s:s + step], lse[s:s + step] - z.gather(1, safe[s:s + step, None])[:, 0].to(acc),
                                     0.0).sum()
                if save_logits:
                    kept.append(z)
            count = valid.sum() if not mean_over_all else torch.tensor(n)
            ctx.save_for_backward(hidden, weight, safe, valid, lse, *kept)
            ctx.chunk_size, ctx.count = chunk_size, count
            if grads_in_forward:  # Liger's order: the gradients made in forward, kept until backward
                ctx.grads = Fn._grads(hidden, weight, safe, valid, lse, chunk_size, torch.ones((), dtype=acc) / count)
            return total / count

        @staticmethod
        def _grads(hidden, weight, safe, valid, lse, chunk_size, scale):
            acc = lse.dtype
            d_hidden = torch.empty_like(hidden)
            d_weight = torch.zeros(weight.shape, dtype=weight.dtype if bf16_accumulate else acc)
            for s in range(0, hidden.shape[0], chunk_size):
                h = hidden[s:s + chunk_size]
                z = (h @ weight.T).to(hidden.dtype if bf16_softmax else acc)
                dz = torch.exp(z - lse[s:s + chunk_size, None].to(z.dtype))
                dz[torch.arange(h.shape[0]), safe[s:s + chunk_size]] -= 1.0
                dz = dz * (valid[s:s + chunk_size] * scale)[:, None].to(dz.dtype)
                d_hidden[s:s + chunk_size] = dz.to(hidden.dtype) @ weight
                if bf16_accumulate:
                    d_weight += dz.to(weight.dtype).T @ h
                else:
                    d_weight += dz.to(acc).T @ h.to(acc)
            out_dtype = acc if fp32_grads else weight.dtype
            return d_hidden.to(acc if fp32_grads else hidden.dtype), d_weight.to(out_dtype)

        @staticmethod
        def backward(ctx, grad_loss):
            hidden, weight, safe, valid, lse = ctx.saved_tensors[:5]
            if grads_in_forward:
                dh, dw = ctx.grads
                return dh * grad_loss.to(dh.dtype), dw * grad_loss.to(dw.dtype), None, None, None
            dh, dw = Fn._grads(hidden, weight, safe, valid, lse, ctx.chunk_size, grad_loss.to(lse.dtype) / ctx.count)
            return dh, dw, None, None, None

    return lambda hidden, weight, targets, chunk_size, ignore_index=-100: Fn.apply(hidden, weight, targets, chunk_size,
                                                                                   ignore_index)


def fused_through_autograd(hidden, weight, targets, chunk_size, ignore_index=-100):
    """the chunked loss without a Function: every chunk's log-softmax kept by autograd."""
    total = 0.0
    for s in range(0, hidden.shape[0], chunk_size):
        z = (hidden[s:s + chunk_size] @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
        total = total + torch.nn.functional.cross_entropy(z, targets[s:s + chunk_size], ignore_index=ignore_index,
                                                          reduction="sum")
    return total / (targets != ignore_index).sum()


# ----------------------------------------------------------------------------- 09.triton_lce_forward
@triton.jit
def lce_fwd_no_tail_mask(H, W, B, T, LSE, TGT, N, V, D, shn, swv, softcap,
                         HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                         BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """the classes past V (loaded as 0) are not set to -inf: each adds e^0 to the sum."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    t = tl.load(T + rows, mask=rows < N, other=-1)
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    zt = tl.zeros([BM], tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        z = tl.zeros([BM, BV], tl.float32)
        for d0 in range(0, D, BD):
            dims = d0 + tl.arange(0, BD)
            h = tl.load(H + rows[:, None] * shn + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D), other=0.0)
            wt = tl.load(W + cols[None, :] * swv + dims[:, None], mask=(cols[None, :] < V) & (dims[:, None] < D), other=0.0)
            z += tl.dot(h, wt, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(z / softcap))
            z = softcap * tl.where(z < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(s), mask=rows < N)
    tl.store(TGT + rows, zt, mask=rows < N)


@triton.jit
def lce_fwd_no_rescale(H, W, B, T, LSE, TGT, N, V, D, shn, swv, softcap,
                       HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                       BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """the running sum is not rescaled when the max grows (e^(m - m_new) left out)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    t = tl.load(T + rows, mask=rows < N, other=-1)
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    zt = tl.zeros([BM], tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        z = tl.zeros([BM, BV], tl.float32)
        for d0 in range(0, D, BD):
            dims = d0 + tl.arange(0, BD)
            h = tl.load(H + rows[:, None] * shn + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D), other=0.0)
            wt = tl.load(W + cols[None, :] * swv + dims[:, None], mask=(cols[None, :] < V) & (dims[:, None] < D), other=0.0)
            z += tl.dot(h, wt, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(z / softcap))
            z = softcap * tl.where(z < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        z = tl.where(cols[None, :] < V, z, float("-inf"))
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(s), mask=rows < N)
    tl.store(TGT + rows, zt, mask=rows < N)


@triton.jit
def lce_fwd_first_hidden_block(H, W, B, T, LSE, TGT, N, V, D, shn, swv, softcap,
                               HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                               BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """the logits from the first BD hidden units only (no loop over the hidden size)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    t = tl.load(T + rows, mask=rows < N, other=-1)
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    zt = tl.zeros([BM], tl.float32)
    dims = tl.arange(0, BD)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        h = tl.load(H + rows[:, None] * shn + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D), other=0.0)
        wt = tl.load(W + cols[None, :] * swv + dims[:, None], mask=(cols[None, :] < V) & (dims[:, None] < D), other=0.0)
        z = tl.dot(h, wt, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(z / softcap))
            z = softcap * tl.where(z < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        z = tl.where(cols[None, :] < V, z, float("-inf"))
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(s), mask=rows < N)
    tl.store(TGT + rows, zt, mask=rows < N)


@triton.jit
def lce_fwd_softcap_after_target(H, W, B, T, LSE, TGT, N, V, D, shn, swv, softcap,
                                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                                 BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """the target's logit read before the soft-cap (the logsumexp after it)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    t = tl.load(T + rows, mask=rows < N, other=-1)
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    zt = tl.zeros([BM], tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        z = tl.zeros([BM, BV], tl.float32)
        for d0 in range(0, D, BD):
            dims = d0 + tl.arange(0, BD)
            h = tl.load(H + rows[:, None] * shn + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D), other=0.0)
            wt = tl.load(W + cols[None, :] * swv + dims[:, None], mask=(cols[None, :] < V) & (dims[:, None] < D), other=0.0)
            z += tl.dot(h, wt, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), 1)
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(z / softcap))
            z = softcap * tl.where(z < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        z = tl.where(cols[None, :] < V, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(s), mask=rows < N)
    tl.store(TGT + rows, zt, mask=rows < N)


# ----------------------------------------------------------------------------- 09.optimizer_in_backward
def _handle(handles):
    return types.SimpleNamespace(remove=lambda: [h.remove() for h in handles])


def in_backward_tensor_hook(model_or_params, make_optimizer):
    """Tensor.register_hook: runs before accumulation, once per use (a tied weight steps twice, on halves)."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    handles, seen = [], set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        opt = make_optimizer([p])

        def hook(grad, p=p, opt=opt):
            p.grad = grad.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return torch.zeros_like(grad)

        handles.append(p.register_hook(hook))
    return _handle(handles)


def in_backward_keeps_gradients(model_or_params, make_optimizer):
    """steps but never frees the gradient: the next backward adds to it."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    handles, seen = [], set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        opt = make_optimizer([p])
        handles.append(p.register_post_accumulate_grad_hook(lambda p, opt=opt: opt.step()))
    return _handle(handles)


def in_backward_one_optimizer(model_or_params, make_optimizer):
    """one optimizer over every parameter, stepped (all of them) in every hook."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    params = [p for p in dict.fromkeys(params) if p.requires_grad]
    opt = make_optimizer(params)

    def hook(p):
        opt.step()
        p.grad = None

    return _handle([p.register_post_accumulate_grad_hook(hook) for p in params])


def in_backward_no_dedup(model_or_params, make_optimizer):
    """a tied weight met twice (through each module's parameters) gets two optimizers and steps twice."""
    if isinstance(model_or_params, torch.nn.Module):
        params = [p for m in model_or_params.modules() for p in m.parameters(recurse=False)]
    else:
        params = list(model_or_params)
    handles = []
    for p in params:
        if not p.requires_grad:
            continue
        opt = make_optimizer([p])

        def hook(p, opt=opt):
            opt.step()
            if all(h is not None for h in [p.grad]):
                pass

        handles.append(p.register_post_accumulate_grad_hook(hook))
    return _handle(handles)


def in_backward_remove_forgets(model_or_params, make_optimizer):
    """right hooks, but remove() removes nothing."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    seen = set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        opt = make_optimizer([p])

        def hook(p, opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

        p.register_post_accumulate_grad_hook(hook)
    return _handle([])


MUTANTS = {
    "09.predict_loss_bytes": [
        ("log-softmax in the logits' dtype", predict_counts_the_logits_dtype),
        ("labels forgotten", predict_forgets_the_labels),
        ("peak taken in forward", predict_forward_peak),
        ("two fp32 copies at the peak", predict_two_fp32_copies),
    ],
    "09.fused_linear_cross_entropy": [
        ("every chunk's logits saved", _fused(save_logits=True)),
        ("-100 hard-coded", _fused(hard_ignore=-100)),
        ("mean over all tokens", _fused(mean_over_all=True)),
        ("softmax in bf16", _fused(bf16_softmax=True)),
        ("head gradient summed in bf16", _fused(bf16_accumulate=True)),
        ("gradients made in forward", _fused(grads_in_forward=True)),
        ("all logits at once", _fused(whole_logits=True)),
        ("chunks through autograd", fused_through_autograd),
    ],
    "09.triton_lce_forward": [
        ("vocabulary tail not masked", lce_fwd_no_tail_mask),
        ("running sum not rescaled", lce_fwd_no_rescale),
        ("first hidden block only", lce_fwd_first_hidden_block),
        ("target logit before the soft-cap", lce_fwd_softcap_after_target),
    ],
    "09.optimizer_in_backward": [
        ("Tensor.register_hook", in_backward_tensor_hook),
        ("gradients kept", in_backward_keeps_gradients),
        ("one optimizer for all", in_backward_one_optimizer),
        ("tied weight not deduplicated", in_backward_no_dedup),
        ("remove() forgets", in_backward_remove_forgets),
    ],
}


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
def predict_fp64_kept_in_fp64(tokens, vocab, dtype):
    """The log-softmax in the wider of fp32 and the logits' dtype: fp64 logits kept at 8 bytes (transformers
    upcasts with .float(): fp32 whatever the dtype)."""
    b = max(4, torch.finfo(dtype).bits // 8)
    return b * tokens * vocab + 8 * tokens, 3 * b * tokens * vocab


_PREDICTED: dict = {}


def predict_memoised(tokens, vocab, dtype):
    """Right numbers, memoised in a module-level dict (a global the answer changes on every new size)."""
    key = (tokens, vocab)
    if key not in _PREDICTED:
        _PREDICTED[key] = (4 * tokens * vocab + 8 * tokens, 12 * tokens * vocab)
    return _PREDICTED[key]


def fused_masks_targets_in_place(hidden, weight, targets, chunk_size, ignore_index=-100):
    """Writes class 0 over the caller's ignored targets (to gather safely), then computes the loss from a mask
    taken before: right numbers, the caller's targets changed."""
    valid = targets != ignore_index
    targets[~valid] = 0
    kept = targets.clone()
    kept[~valid] = ignore_index
    return _fused()(hidden, weight, kept, chunk_size, ignore_index)


def fused_drops_the_tail(hidden, weight, targets, chunk_size, ignore_index=-100):
    """Only whole chunks: the tokens past the last multiple of chunk_size are left out (ignored)."""
    n = hidden.shape[0]
    whole = (n // chunk_size) * chunk_size if n > chunk_size else n
    kept = targets.clone()
    kept[whole:] = ignore_index
    if not bool((kept != ignore_index).any()):
        kept = targets
    return _fused()(hidden, weight, kept, chunk_size, ignore_index)


def fused_views_hidden(hidden, weight, targets, chunk_size, ignore_index=-100):
    """Cuts the chunks out of hidden.view(-1) (every graded hidden was contiguous): a transposed or strided one
    raises."""
    n, d = hidden.shape
    flat = hidden.view(-1)
    rows = torch.cat([flat[s * d:min(s + chunk_size, n) * d].view(-1, d) for s in range(0, n, chunk_size)])
    return _fused()(rows, weight, targets, chunk_size, ignore_index)


@triton.jit
def lce_fwd_row_stride_d(H, W, B, T, LSE, TGT, N, V, D, shn, swv, softcap,
                         HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                         BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """rows D elements apart (every graded hidden and weight was contiguous): shn and swv never read."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    t = tl.load(T + rows, mask=rows < N, other=-1)
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    zt = tl.zeros([BM], tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        z = tl.zeros([BM, BV], tl.float32)
        for d0 in range(0, D, BD):
            dims = d0 + tl.arange(0, BD)
            h = tl.load(H + rows[:, None] * D + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D), other=0.0)
            wt = tl.load(W + cols[None, :] * D + dims[:, None], mask=(cols[None, :] < V) & (dims[:, None] < D), other=0.0)
            z += tl.dot(h, wt, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(z / softcap))
            z = softcap * tl.where(z < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        z = tl.where(cols[None, :] < V, z, float("-inf"))
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(s), mask=rows < N)
    tl.store(TGT + rows, zt, mask=rows < N)


def in_backward_skips_head_by_name(model_or_params, make_optimizer):
    """Deduplicates the tied weight by skipping the parameter named head.weight (every graded model tied it):
    an untied head never steps."""
    if isinstance(model_or_params, torch.nn.Module):
        named = [(n, p) for n, p in model_or_params.named_parameters(remove_duplicate=False)]
    else:
        named = [(str(i), p) for i, p in enumerate(model_or_params)]
    handles = []
    for name, p in named:
        if not p.requires_grad or name == "head.weight":
            continue
        opt = make_optimizer([p])

        def hook(p, opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

        handles.append(p.register_post_accumulate_grad_hook(hook))
    return _handle(handles)


_HOOKS: list = []


def in_backward_global_registry(model_or_params, make_optimizer):
    """Keeps every hook handle in a module-level list; remove() removes them all (every model's)."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    seen = set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        opt = make_optimizer([p])

        def hook(p, opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

        _HOOKS.append(p.register_post_accumulate_grad_hook(hook))
    return types.SimpleNamespace(remove=lambda: [h.remove() for h in _HOOKS])


def in_backward_module_only(model_or_params, make_optimizer):
    """Takes model.parameters() when it has them, else assumes a generator and consumes it with next() (every
    graded iterable was a generator): a list raises."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    handles, seen = [], set()
    while True:
        try:
            p = next(params)
        except StopIteration:
            break
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        opt = make_optimizer([p])

        def hook(p, opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

        handles.append(p.register_post_accumulate_grad_hook(hook))
    return _handle(handles)


MUTANTS["09.predict_loss_bytes"] += [
    ("fp64 logits kept in fp64", predict_fp64_kept_in_fp64),
    ("memoised in a module-level dict", predict_memoised),
]
MUTANTS["09.fused_linear_cross_entropy"] += [
    ("ignored targets overwritten in place", fused_masks_targets_in_place),
    ("the tail chunk left out", fused_drops_the_tail),
    ("hidden.view(-1, d)", fused_views_hidden),
]
MUTANTS["09.triton_lce_forward"] += [("rows D elements apart (strides unread)", lce_fwd_row_stride_d)]
MUTANTS["09.optimizer_in_backward"] += [
    ("head.weight skipped by name (tied assumed)", in_backward_skips_head_by_name),
    ("hook handles in a module-level list", in_backward_global_registry),
    ("parameters consumed with next() (generator assumed)", in_backward_module_only),
]


# ----------------------------------------------------------------------------- issue 35: the kinds, labelled
def predict_vocab_padded_to_64(tokens, vocab, dtype):
    """The vocabulary rounded up to a multiple of 64 (as a padded embedding table would be): the loss's logits
    have exactly vocab columns."""
    padded = -(-vocab // 64) * 64
    return 4 * tokens * padded + 8 * tokens, 12 * tokens * padded


@triton.jit
def lce_fwd_softcap_30(H, W, B, T, LSE, TGT, N, V, D, shn, swv, softcap,
                       HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                       BM: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    """The soft-cap written in as 30.0 (Gemma 2's final-logit cap) instead of the softcap argument."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    t = tl.load(T + rows, mask=rows < N, other=-1)
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    zt = tl.zeros([BM], tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        z = tl.zeros([BM, BV], tl.float32)
        for d0 in range(0, D, BD):
            dims = d0 + tl.arange(0, BD)
            h = tl.load(H + rows[:, None] * shn + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D),
                        other=0.0)
            wt = tl.load(W + cols[None, :] * swv + dims[:, None], mask=(cols[None, :] < V) & (dims[:, None] < D),
                         other=0.0)
            z += tl.dot(h, wt, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(z / 30.0))
            z = 30.0 * tl.where(z < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        z = tl.where(cols[None, :] < V, z, float("-inf"))
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(s), mask=rows < N)
    tl.store(TGT + rows, zt, mask=rows < N)


MUTANTS["09.predict_loss_bytes"] += [("vocabulary padded to a multiple of 64", predict_vocab_padded_to_64)]
MUTANTS["09.triton_lce_forward"] += [("soft-cap 30 written in", lce_fwd_softcap_30)]

KINDS = {
    "09.predict_loss_bytes": {"hygiene": ["memoised in a module-level dict"],
                              "constants": ["vocabulary padded to a multiple of 64"],
                              "space": ["fp64 logits kept in fp64"]},
    "09.fused_linear_cross_entropy": {"hygiene": ["ignored targets overwritten in place"],
                                      "constants": ["-100 hard-coded"],
                                      "space": ["the tail chunk left out", "hidden.view(-1, d)"]},
    "09.triton_lce_forward": {"constants": ["soft-cap 30 written in"],
                              "space": ["rows D elements apart (strides unread)", "vocabulary tail not masked"]},
    "09.optimizer_in_backward": {"hygiene": ["hook handles in a module-level list"],
                                 "constants": ["head.weight skipped by name (tied assumed)"],
                                 "space": ["parameters consumed with next() (generator assumed)"]},
}
NOT_APPLICABLE = {
    "09.triton_lce_forward": {"hygiene": "a Triton kernel keeps no Python state between launches and is passed to "
                                         "the check as it is (its pointer arguments are not pictured call by call); "
                                         "a kernel that stores into its inputs is the check's own comparison"},
}
