"""Plausible wrong answers to chapter 04's exercises; tests/course/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs.
"""
from __future__ import annotations

import torch

from memlab import offload
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # mutant_helpers, beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_helpers import counted_on_the_class as _counted_on_the_class  # noqa: E402
from mutant_helpers import memoised as _memoised  # noqa: E402


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


# ----------------------------------------------------------------------------- new (issue 22): 04.adamw_update
def update_on_contiguous_copy(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """Makes param contiguous first: a transposed or channels_last parameter is updated in a copy, not in place."""
    p = param.contiguous()
    offload.adamw_step_(p, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay)


def update_fp32_bias_corrections(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """Bias corrections as float32 tensors: off by an ulp or so from torch's Python floats (double)."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1 = 1 - torch.tensor(beta1, dtype=torch.float32) ** step
    bc2 = 1 - torch.tensor(beta2, dtype=torch.float32) ** step
    param.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / bc2.sqrt()).add_(eps), value=-(lr / bc1).item())


def update_sqrt_of_ratio(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """sqrt(v / bc2) instead of sqrt(v) / sqrt(bc2): the same maths, other roundings."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    param.addcdiv_(exp_avg, (exp_avg_sq / bc2).sqrt().add_(eps), value=-lr / bc1)


# ----------------------------------------------------------------------------- new: 04.pack_flat
def pack_view_of_input(tensors):
    """flat[o:o+n].copy_(t.view(-1)): fails on a transposed or channels_last tensor."""
    flat = torch.zeros(sum(t.numel() for t in tensors))
    views, o = [], 0
    for t in tensors:
        flat[o:o + t.numel()].copy_(t.detach().view(-1))
        views.append(flat[o:o + t.numel()].view(t.shape))
        o += t.numel()
    return flat, views


def pack_keeps_strides(tensors):
    """Views with the input's strides: the values are right, but flat holds a channels_last/transposed tensor in its
    memory order, so flat buffers of different tensors (grads, masters) no longer line up element for element."""
    flat = torch.zeros(sum(t.numel() for t in tensors))
    views, o = [], 0
    for t in tensors:
        order = sorted(range(t.dim()), key=lambda d: -t.stride()[d])
        dense = [0] * t.dim()
        acc = 1
        for d in reversed(order):
            dense[d] = acc
            acc *= t.shape[d]
        v = flat.as_strided(t.shape, tuple(dense), o)
        v.copy_(t)
        views.append(v)
        o += t.numel()
    return flat, views


def pack_reuses_single_input(tensors):
    """A 'fast path': one fp32 contiguous tensor is its own flat buffer (no copy), so flat aliases the input."""
    if len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous():
        t = tensors[0].detach()
        return t.view(-1), [t]
    buf = offload.pack(tensors)
    return buf.flat, buf.views


# ----------------------------------------------------------------------------- new: 04.chunked_step
def _chunks(param, chunk):
    return [slice(lo, lo + chunk) for lo in range(0, param.numel(), chunk)]


def chunk_fp32_bias_corrections(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    for s in _chunks(param, chunk):
        update_fp32_bias_corrections(param[s], grad[s], exp_avg[s], exp_avg_sq[s], step, lr=lr, beta1=beta1, beta2=beta2,
                                     eps=eps, weight_decay=weight_decay)


def chunk_sqrt_of_ratio(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    for s in _chunks(param, chunk):
        update_sqrt_of_ratio(param[s], grad[s], exp_avg[s], exp_avg_sq[s], step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay)


def chunk_textbook_moments(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    """beta1*m + (1-beta1)*g instead of lerp: a relative difference of ~1e-7 that rtol=1e-6 never saw."""
    for s in _chunks(param, chunk):
        p, g, m, v = param[s], grad[s], exp_avg[s], exp_avg_sq[s]
        p.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        p.addcdiv_(m, (v.sqrt() / bc2**0.5).add_(eps), value=-lr / bc1)


def chunk_bf16_denominator(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
    """The denominator in bf16 to save bandwidth: low-precision rounding in every update."""
    for s in _chunks(param, chunk):
        p, g, m, v = param[s], grad[s], exp_avg[s], exp_avg_sq[s]
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        p.addcdiv_(m, (v.bfloat16().sqrt() / bc2**0.5).add_(eps).float(), value=-lr / bc1)


# ----------------------------------------------------------------------------- new: 04.grad_hook
def hook_trainable_only_zip(params, slots):
    """Zips the trainable parameters with all the slots: after a frozen parameter every slot is shifted."""
    trainable = [p for p in params if p.requires_grad]

    def body(p, slot):
        slot.add_(p.grad)
        p.grad = None
    handles = []
    for p, slot in zip(trainable, slots):
        handles.append(p.register_post_accumulate_grad_hook(lambda q, slot=slot: body(q, slot)))
    return handles


def hook_slot_by_shape(params, slots):
    """Looks the slot up by shape: a frozen layer of the same shape shares (steals) the trainable one's slot."""
    by_shape = {tuple(s.shape): s for s in slots}

    def body(p):
        by_shape[tuple(p.shape)].add_(p.grad)
        p.grad = None
    return [p.register_post_accumulate_grad_hook(body) for p in params if p.requires_grad]


def hook_sums_in_grad_dtype(params, slots):
    """Keeps a running sum in the gradient's dtype (bf16) and writes it to the slot: bf16 accumulation error."""
    acc: dict[int, torch.Tensor] = {}

    def body(p, slot):
        acc[id(p)] = p.grad.clone() if id(p) not in acc else acc[id(p)] + p.grad
        slot.copy_(acc[id(p)])
        p.grad = None
    return _hooks(params, slots, body)


def hook_flat_view(params, slots):
    """slot.view(-1).add_(p.grad.view(-1)): fails on a channels_last gradient."""
    def body(p, slot):
        slot.view(-1).add_(p.grad.view(-1))
        p.grad = None
    return _hooks(params, slots, body)


# ----------------------------------------------------------------------------- 04.offload_optimizer
class _Offload:
    """A right answer built from memlab's pieces; the mutants below each change one thing."""
    master_dtype = torch.float32
    include_frozen = False

    def __init__(self, params, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        params = list(params)
        self.params = params if self.include_frozen else [p for p in params if p.requires_grad]
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.master = offload.pack(self.params, dtype=self.master_dtype)
        shapes = [p.shape for p in self.params]
        self.grad, self.m, self.v = (offload.FlatBuffer(shapes, dtype=self.master_dtype) for _ in range(3))
        slots = self.grad.views
        if self.master_dtype != torch.float32:
            self._slots32 = offload.FlatBuffer(shapes)
            slots = self._slots32.views
        self.handles = offload.install_grad_hooks(self.params, slots)
        self.t = 0

    def _g(self, i):
        return self.grad.views[i] if self.master_dtype == torch.float32 else self._slots32.views[i].to(self.master_dtype)

    @torch.no_grad()
    def step(self):
        self.t += 1
        for i, p in enumerate(self.params):
            offload.adamw_step_(self.master.views[i], self._g(i), self.m.views[i], self.v.views[i], self.t, **self.hp)
            p.copy_(self.master.views[i])

    def zero_grad(self):
        self.grad.flat.zero_()
        if self.master_dtype != torch.float32:
            self._slots32.flat.zero_()


class OffloadStepsFrozen(_Offload):
    """Steps every parameter it was given: the frozen layer decays (and moves) too."""
    include_frozen = True


class OffloadMasterInModelDtype(_Offload):
    """Master weights and moments in the parameters' dtype: no fp32 master for bf16 weights."""

    def __init__(self, params, **kw):
        params = list(params)
        self.master_dtype = params[0].dtype
        super().__init__(params, **kw)


class OffloadKeepsSlots(_Offload):
    """zero_grad() forgets the host slots: the last step's gradients leak into the next."""

    def zero_grad(self):
        pass


class OffloadCopiesBeforeUpdate(_Offload):
    """Copies the master into the parameter before updating it: the model is always one step behind."""

    @torch.no_grad()
    def step(self):
        self.t += 1
        for i, p in enumerate(self.params):
            p.copy_(self.master.views[i])
            offload.adamw_step_(self.master.views[i], self._g(i), self.m.views[i], self.v.views[i], self.t, **self.hp)


# ----------------------------------------------------------------------------- 04.predict_traffic
def _unique_trained(model):
    return [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]


def traffic_every_micro_batch(model, micro_batches, offload_gradients):
    """Gradients cross every micro-batch even when they accumulate on the device."""
    n = sum(p.numel() * p.element_size() for p in _unique_trained(model))
    return micro_batches * n, n


def traffic_in_fp32(model, micro_batches, offload_gradients):
    """Counts 4 bytes a value both ways (the master's dtype), not the 16-bit tensors that cross."""
    n = sum(p.numel() for p in _unique_trained(model))
    return (micro_batches if offload_gradients else 1) * 4 * n, 4 * n


def traffic_counts_frozen(model, micro_batches, offload_gradients):
    n = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return (micro_batches if offload_gradients else 1) * n, n


def traffic_tied_twice(model, micro_batches, offload_gradients):
    ps = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    n = sum(p.numel() * p.element_size() for p in ps)
    return (micro_batches if offload_gradients else 1) * n, n


def traffic_once_even_offloaded(model, micro_batches, offload_gradients):
    """Forgets that offloaded gradients leave the device every micro-batch (they cannot accumulate there)."""
    n = sum(p.numel() * p.element_size() for p in _unique_trained(model))
    return n, n


MUTANTS = {
    "04.adamw_update": [("Adam with L2 (not decoupled)", adam_l2_not_decoupled), ("eps inside the sqrt", eps_inside_sqrt),
                        ("decay after the update", decay_after_update), ("textbook op order", textbook_order),
                        ("no bias correction", no_bias_correction),
                        ("updates a contiguous copy", update_on_contiguous_copy),
                        ("float32 bias corrections", update_fp32_bias_corrections),
                        ("sqrt(v / bc2)", update_sqrt_of_ratio)],
    "04.pack_flat": [("views are copies", pack_copies), ("off by one", pack_off_by_one), ("keeps bf16", pack_keeps_dtype),
                     ("reversed order", pack_reversed), ("t.view(-1) of the input", pack_view_of_input),
                     ("keeps the input's strides", pack_keeps_strides),
                     ("flat aliases a single input", pack_reuses_single_input)],
    "04.chunked_step": [("no slicing", chunk_no_slicing), ("drops the tail", chunk_drops_tail),
                        ("overlapping slices", chunk_overlaps), ("step per chunk", chunk_counts_steps),
                        ("float32 bias corrections", chunk_fp32_bias_corrections),
                        ("sqrt(v / bc2)", chunk_sqrt_of_ratio), ("textbook moments", chunk_textbook_moments),
                        ("bf16 denominator", chunk_bf16_denominator)],
    "04.grad_hook": [("never frees", hook_never_frees), ("overwrites", hook_overwrites),
                     ("pre-accumulate tensor hook", hook_pre_accumulate), ("rebinds the slot", hook_rebinds_slot),
                     ("trainable zipped with all slots", hook_trainable_only_zip), ("slot by shape", hook_slot_by_shape),
                     ("sums in bf16", hook_sums_in_grad_dtype), ("view(-1) of the grad", hook_flat_view)],
    "04.offload_optimizer": [("steps the frozen layer", OffloadStepsFrozen),
                             ("master in the model's dtype", OffloadMasterInModelDtype),
                             ("zero_grad keeps the slots", OffloadKeepsSlots),
                             ("copies before the update", OffloadCopiesBeforeUpdate)],
    "04.predict_traffic": [("every micro-batch", traffic_every_micro_batch), ("fp32 bytes", traffic_in_fp32),
                           ("frozen counted", traffic_counts_frozen), ("tied twice", traffic_tied_twice),
                           ("offloaded grads once", traffic_once_even_offloaded)],
}


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
def adamw_decay_folded_into_grad(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """Right update, but divides the caller's gradient in place to undo a scaling ("grad /= 1"): it reuses the
    gradient as scratch (grad.mul_(2), then div_(2): bitwise equal for fp32, yet a write to the caller's tensor
    and, here, a subtraction that does not round back)."""
    from memlab import offload

    offload.adamw_step_(param, grad.clone(), exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay)
    with torch.no_grad():
        grad.add_(param, alpha=weight_decay).sub_(param, alpha=weight_decay)


def adamw_flat_view(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """Updates param.view(-1) (every graded parameter is contiguous or a transposed matrix): a strided one raises."""
    from memlab import offload

    offload.adamw_step_(param.view(-1), grad.reshape(-1), exp_avg.view(-1), exp_avg_sq.view(-1), step, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=weight_decay)


def pack_casts_inputs(tensors):
    """Casts the caller's 16-bit tensors to float32 in place (t.data = t.data.float()) before packing."""
    from memlab import offload

    for t in tensors:
        if t.dtype != torch.float32:
            t.data = t.data.float()
    buf = offload.pack(tensors)
    return buf.flat, buf.views


def chunked_grad_as_scratch(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk=1024):
    """Uses the gradient as scratch for (1 - beta1) * grad, then restores it by dividing: rounding leaves it changed."""
    from memlab import offload

    offload.adamw_step_eager_chunked_(param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay, chunk=chunk)
    with torch.no_grad():
        grad.mul_(1 - beta1).div_(1 - beta1)


MUTANTS["04.adamw_update"] += [("gradient used as scratch", adamw_decay_folded_into_grad),
                               ("view(-1) of the parameter", adamw_flat_view)]
MUTANTS["04.pack_flat"] += [("casts the caller's tensors in place", pack_casts_inputs)]
MUTANTS["04.chunked_step"] += [("gradient used as scratch", chunked_grad_as_scratch)]


def _offload_with_class_counter():
    """The check's own composed reference, except the step count lives on the class (one for every optimizer)."""
    from memlab.course.checks.ch04 import _ReferenceOffload

    class OffloadStepOnClass(_ReferenceOffload):
        t_all = 0

        @torch.no_grad()
        def step(self):
            from memlab import offload

            OffloadStepOnClass.t_all += 1
            for i, p in enumerate(self.params):
                offload.adamw_step_(self.master.views[i], self.grad.views[i], self.m.views[i], self.v.views[i],
                                    OffloadStepOnClass.t_all, **self.hp)
                p.copy_(self.master.views[i])

    return OffloadStepOnClass


MUTANTS["04.offload_optimizer"] += [("the step count on the class", _offload_with_class_counter())]


# ----------------------------------------------------------------------------- issue 35: one mutant of each kind
# (tests/course/test_mutants.py: a hygiene mutant is caught by a hygiene probe, a constants or space mutant by the
# drawn cases with the hand-picked edges off)


_STAGED: dict = {}


def grad_hooks_slots_remembered(params, slots):
    """Right hooks, and the slots remembered in a module-level dict by parameter id (to print them later)."""
    from memlab.offload import install_grad_hooks

    _STAGED.update({id(p): s for p, s in zip(params, slots)})
    return install_grad_hooks(params, slots)


def _offload_counted():
    from memlab.course.checks.ch04 import _ReferenceOffload

    return _counted_on_the_class(_ReferenceOffload)


def _traffic_memo():
    from memlab.course.checks.ch04 import _predict_traffic_reference

    return _memoised(_predict_traffic_reference,
                     key=lambda model, m, o: (sum(p.numel() for p in model.parameters()), m, o))


MUTANTS["04.grad_hook"] += [("slots remembered in a module-level dict", grad_hooks_slots_remembered)]
MUTANTS["04.offload_optimizer"] += [("instances counted on the class", _offload_counted())]
MUTANTS["04.predict_traffic"] += [("memoised by parameter count in a dict kept between calls", _traffic_memo())]

KINDS = {
    "04.adamw_update": {"hygiene": ["gradient used as scratch"], "constants": ["float32 bias corrections"],
                        "space": ["view(-1) of the parameter", "updates a contiguous copy"]},
    "04.pack_flat": {"hygiene": ["casts the caller's tensors in place"],
                     "space": ["keeps bf16", "t.view(-1) of the input", "flat aliases a single input"]},
    "04.chunked_step": {"hygiene": ["gradient used as scratch"], "constants": ["bf16 denominator"],
                        "space": ["drops the tail", "overlapping slices"]},
    "04.grad_hook": {"hygiene": ["slots remembered in a module-level dict"], "constants": ["sums in bf16"],
                     "space": ["slot by shape", "trainable zipped with all slots"]},
    "04.offload_optimizer": {"hygiene": ["instances counted on the class"], "constants": ["master in the model's dtype"],
                             "space": ["steps the frozen layer"]},
    "04.predict_traffic": {"hygiene": ["memoised by parameter count in a dict kept between calls"],
                           "constants": ["fp32 bytes"], "space": ["frozen counted", "tied twice"]},
}
NOT_APPLICABLE = {"04.pack_flat": {"constants": "packing takes the caller's tensors and has no size or setting of its "
                                                "own to tune"}}
