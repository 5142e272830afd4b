"""Plausible wrong answers to chapter 04's exercises; tests/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs.
"""
from __future__ import annotations

import torch

from memlab import offload


# ----------------------------------------------------------------------------- 04.adamw_update
def adam_l2_not_decoupled(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """Adam with L2: weight decay folded into the gradient (torch.optim.Adam), not AdamW's decoupled decay."""
    grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    param.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / bc2**0.5).add_(eps), value=-lr / bc1)


def eps_inside_sqrt(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    param.addcdiv_(exp_avg, (exp_avg_sq / bc2).add_(eps).sqrt(), value=-lr / bc1)


def decay_after_update(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    param.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / bc2**0.5).add_(eps), value=-lr / bc1)
    param.mul_(1 - lr * weight_decay)


def textbook_order(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """Right maths, other roundings: beta1*m + (1-beta1)*g and m_hat / (sqrt(v_hat) + eps)."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).add_(grad * grad * (1 - beta2))
    m_hat = exp_avg / (1 - beta1**step)
    v_hat = exp_avg_sq / (1 - beta2**step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))


def no_bias_correction(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-lr)


# ----------------------------------------------------------------------------- 04.bias_correction
def bc_zero_based(step, beta1, beta2):
    return 1 - beta1 ** (step - 1) if step > 1 else 1.0, 1 - beta2 ** (step - 1) if step > 1 else 1.0


def bc_forgets_one_minus(step, beta1, beta2):
    return beta1**step, beta2**step


def bc_same_beta(step, beta1, beta2):
    return 1 - beta1**step, 1 - beta1**step


def bc_multiplies(step, beta1, beta2):
    return 1 - beta1 * step if beta1 * step < 1 else 1.0, 1 - beta2 * step if beta2 * step < 1 else 1.0


# ----------------------------------------------------------------------------- 04.pack_flat
def pack_copies(tensors):
    """views are copies: writing the flat buffer does not reach them."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    return flat, [t.detach().float().clone() for t in tensors]


def pack_off_by_one(tensors):
    total = sum(t.numel() for t in tensors)
    flat = torch.zeros(total + 1)
    views, o = [], 1  # starts at 1: leaves a hole at the front
    for t in tensors:
        views.append(flat[o:o + t.numel()].view(t.shape))
        views[-1].copy_(t)
        o += t.numel()
    return flat[: total + 1], views


def pack_keeps_dtype(tensors):
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    views, o = [], 0
    for t in tensors:
        views.append(flat[o:o + t.numel()].view(t.shape))
        views[-1].copy_(t)
        o += t.numel()
    return flat, views


def pack_reversed(tensors):
    flat = torch.zeros(sum(t.numel() for t in tensors))
    views, o = [], 0
    for t in reversed(tensors):
        v = flat[o:o + t.numel()].view(t.shape)
        v.copy_(t)
        views.insert(0, v)
        o += t.numel()
    return flat, views


# ----------------------------------------------------------------------------- 04.chunked_step
def chunk_no_slicing(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    offload.adamw_step_(param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


def chunk_drops_tail(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    n = param.numel()
    for lo in range(0, n - chunk + 1, chunk):  # whole chunks only
        s = slice(lo, lo + chunk)
        offload.adamw_step_(param[s], grad[s], exp_avg[s], exp_avg_sq[s], step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay)


def chunk_overlaps(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    n = param.numel()
    for lo in range(0, n, chunk):
        s = slice(lo, min(n, lo + chunk + 1))  # one element too many: the boundary is updated twice
        offload.adamw_step_(param[s], grad[s], exp_avg[s], exp_avg_sq[s], step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay)


def chunk_counts_steps(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    for k, lo in enumerate(range(0, param.numel(), chunk)):
        s = slice(lo, lo + chunk)
        offload.adamw_step_(param[s], grad[s], exp_avg[s], exp_avg_sq[s], step + k, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay)


# ----------------------------------------------------------------------------- 04.grad_hook
def _hooks(params, slots, body):
    handles = []
    for p, slot in zip(params, slots):
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda q, slot=slot: body(q, slot)))
    return handles


def hook_never_frees(params, slots):
    def body(p, slot):
        slot.add_(p.grad)
    return _hooks(params, slots, body)


def hook_overwrites(params, slots):
    def body(p, slot):
        slot.copy_(p.grad)
        p.grad = None
    return _hooks(params, slots, body)


def hook_pre_accumulate(params, slots):
    """Tensor.register_hook sees the incoming grad before autograd stores it: p.grad is set afterwards anyway."""
    handles = []
    for p, slot in zip(params, slots):
        if p.requires_grad:
            def on_grad(g, slot=slot):
                slot.add_(g)

            handles.append(p.register_hook(on_grad))
    return handles


def hook_rebinds_slot(params, slots):
    """slot = slot + grad makes a new tensor: the caller's slot never changes."""
    def body(p, slot):
        slot = slot + p.grad  # noqa: F841
        p.grad = None
    return _hooks(params, slots, body)


# ----------------------------------------------------------------------------- 04.predict_device_bytes
def _params(model):
    return list({id(p): p for p in model.parameters()}.values())


def predict_counts_tied_twice(model, recipe):
    ps = [p for _, p in model.named_parameters(remove_duplicate=False)]
    w = sum(p.numel() * p.element_size() for p in ps) + sum(b.nbytes for b in model.buffers())
    trained = sum(p.numel() * p.element_size() for p in ps if p.requires_grad)
    return w + {"adamw": 3, "offload": 1, "offload grads": 0}[recipe] * trained


def predict_assumes_fp32(model, recipe):
    n = sum(p.numel() for p in _params(model))
    return 4 * n * {"adamw": 4, "offload": 2, "offload grads": 1}[recipe]


def predict_forgets_grads(model, recipe):
    w = sum(p.numel() * p.element_size() for p in _params(model)) + sum(b.nbytes for b in model.buffers())
    return w + (2 * w if recipe == "adamw" else 0)


def predict_ignores_frozen(model, recipe):
    ps = _params(model)
    w = sum(p.numel() * p.element_size() for p in ps) + sum(b.nbytes for b in model.buffers())
    return w + {"adamw": 3, "offload": 1, "offload grads": 0}[recipe] * sum(p.numel() * p.element_size() for p in ps)


MUTANTS = {
    "04.adamw_update": [("Adam with L2 (not decoupled)", adam_l2_not_decoupled), ("eps inside the sqrt", eps_inside_sqrt),
                        ("decay after the update", decay_after_update), ("textbook op order", textbook_order),
                        ("no bias correction", no_bias_correction)],
    "04.bias_correction": [("zero-based step", bc_zero_based), ("forgets 1 -", bc_forgets_one_minus),
                           ("beta1 for both", bc_same_beta), ("beta*step", bc_multiplies)],
    "04.pack_flat": [("views are copies", pack_copies), ("off by one", pack_off_by_one), ("keeps bf16", pack_keeps_dtype),
                     ("reversed order", pack_reversed)],
    "04.chunked_step": [("no slicing", chunk_no_slicing), ("drops the tail", chunk_drops_tail),
                        ("overlapping slices", chunk_overlaps), ("step per chunk", chunk_counts_steps)],
    "04.grad_hook": [("never frees", hook_never_frees), ("overwrites", hook_overwrites),
                     ("pre-accumulate tensor hook", hook_pre_accumulate), ("rebinds the slot", hook_rebinds_slot)],
    "04.predict_device_bytes": [("tied weights twice", predict_counts_tied_twice), ("assumes fp32", predict_assumes_fp32),
                                ("forgets grads", predict_forgets_grads), ("frozen params get states", predict_ignores_frozen)],
}
