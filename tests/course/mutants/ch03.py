"""Plausible wrong answers to chapter 03's exercises; tests/course/test_mutants.py asserts each FAILS."""
from __future__ import annotations

import torch
from torch import nn
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # mutant_helpers, beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_helpers import counted_on_the_class as _counted_on_the_class  # noqa: E402
from mutant_helpers import memoised as _memoised  # noqa: E402


# ----------------------------------------------------------------------------- 03.underflow_fraction
def uf_counts_zeros(t, dtype=torch.float16):
    """Divides by every element, zeros included."""
    finite = torch.isfinite(t)
    return int(((t != 0) & finite & (t.to(dtype) == 0)).sum()) / max(int(finite.sum()), 1)


def uf_threshold_normal(t, dtype=torch.float16):
    """Calls everything below the smallest *normal* number lost (subnormals survive a cast)."""
    nz = (t != 0) & torch.isfinite(t)
    n = int(nz.sum())
    return 0.0 if n == 0 else int((nz & (t.abs() < torch.finfo(dtype).tiny)).sum()) / n


def uf_nonfinite_included(t, dtype=torch.float16):
    """Counts inf and nan among the non-zero values."""
    nz = t != 0
    n = int(nz.sum())
    return 0.0 if n == 0 else int((nz & (t.to(dtype) == 0)).sum()) / n


def uf_ignores_dtype(t, dtype=torch.float16):
    """Always casts to fp16."""
    nz = (t != 0) & torch.isfinite(t)
    n = int(nz.sum())
    return 0.0 if n == 0 else int((nz & (t.half() == 0)).sum()) / n


# ----------------------------------------------------------------------------- 03.update_scale
def us_no_reset_on_inf(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    if found_inf.item() > 0:
        scale.fill_(scale.item() * backoff_factor)
        return
    n = tracker.item() + 1
    if n == growth_interval:
        scale.fill_(scale.item() * growth_factor)
        n = 0
    tracker.fill_(n)


def us_off_by_one(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Grows one step late (tracker compared before incrementing)."""
    if found_inf.item() > 0:
        scale.fill_(scale.item() * backoff_factor)
        tracker.fill_(0)
        return
    if tracker.item() == growth_interval:
        scale.fill_(scale.item() * growth_factor)
        tracker.fill_(0)
    else:
        tracker.fill_(tracker.item() + 1)


def us_grows_to_inf(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """No guard when scale * growth_factor overflows float32."""
    if found_inf.item() > 0:
        scale.fill_(scale.item() * backoff_factor)
        tracker.fill_(0)
        return
    n = tracker.item() + 1
    if n == growth_interval:
        scale.fill_(scale.item() * growth_factor)
        n = 0
    tracker.fill_(n)


def us_new_tensors(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Rebinds local names instead of updating in place: the caller's tensors never change."""
    if found_inf.item() > 0:
        scale = scale * backoff_factor
        tracker = torch.zeros_like(tracker)
        return
    tracker = tracker + 1


# ----------------------------------------------------------------------------- 03.unscale_grads
def ug_resets_found_inf(grads, found_inf, inv_scale):
    found_inf.fill_(0.0)
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        g.copy_(g.float() * inv_scale)


def ug_16bit_product(grads, found_inf, inv_scale):
    """Multiplies in the gradient's own dtype (one more rounding for bf16)."""
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        g.mul_(inv_scale.to(g.dtype))


def ug_divides(grads, found_inf, inv_scale):
    """Divides by the scale: 1 / inv_scale, rounded, is not the scale."""
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        g.copy_(g.float() / (1.0 / inv_scale))


def ug_inf_only(grads, found_inf, inv_scale):
    """Detects inf but not nan."""
    for g in grads:
        if torch.isinf(g).any():
            found_inf.fill_(1.0)
        g.copy_(g.float() * inv_scale)


def ug_not_in_place(grads, found_inf, inv_scale):
    for i, g in enumerate(grads):
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        grads[i] = (g.float() * inv_scale).to(g.dtype)


# ----------------------------------------------------------------------------- 03.loss_scaler
def _scaler(step_rule):
    class Scaler:
        def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
            self.s, self.t, self.f = float(init_scale), 0, False
            self.gf, self.bf, self.gi = growth_factor, backoff_factor, growth_interval

        def scale(self, loss):
            return loss * self.s

        def step(self, opt):
            return step_rule(self, opt)

        def update(self):
            if self.f:
                self.s *= self.bf
                self.t = 0
            else:
                self.t += 1
                if self.t == self.gi:
                    self.s *= self.gf
                    self.t = 0

        def get_scale(self):
            return self.s
    return Scaler


def _grads(opt):
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _steps_anyway(self, opt):
    """Unscales and always steps: inf/NaN gradients reach the weights."""
    self.f = any(not torch.isfinite(g).all() for g in _grads(opt))
    for g in _grads(opt):
        g.mul_(1.0 / self.s)
    opt.step()
    return True


def _never_unscales(self, opt):
    """Skips on inf/NaN but steps with the scaled gradients."""
    self.f = any(not torch.isfinite(g).all() for g in _grads(opt))
    if self.f:
        return False
    opt.step()
    return True


def _python_float_inverse(self, opt):
    """Unscales with a Python double 1/scale instead of GradScaler's float32 reciprocal."""
    self.f = any(not torch.isfinite(g).all() for g in _grads(opt))
    if self.f:
        return False
    for g in _grads(opt):
        g.mul_(1.0 / self.s)
    opt.step()
    return True


class ScalerStepsAnyway(_scaler(_steps_anyway)):
    pass


class ScalerNeverUnscales(_scaler(_never_unscales)):
    pass


class ScalerPythonInverse(_scaler(_python_float_inverse)):
    pass


# ----------------------------------------------------------------------------- 03.master_step
def ms_16bit_grads(model_params, master_params, optimizer):
    """Gives the masters the 16-bit gradient tensors as they are."""
    for p, m in zip(model_params, master_params):
        m.grad = p.grad
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            p.copy_(m)


def ms_no_copy_back(model_params, master_params, optimizer):
    for p, m in zip(model_params, master_params):
        m.grad = None if p.grad is None else p.grad.float()
    optimizer.step()


def ms_zero_for_missing(model_params, master_params, optimizer):
    """A missing gradient becomes zeros: AdamW still moves that parameter (decay and momentum)."""
    for p, m in zip(model_params, master_params):
        m.grad = torch.zeros_like(m) if p.grad is None else p.grad.float()
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            p.copy_(m)


def ms_rebinds(model_params, master_params, optimizer):
    """Replaces list entries with new 16-bit parameters instead of copying into them."""
    for p, m in zip(model_params, master_params):
        m.grad = None if p.grad is None else p.grad.float()
    optimizer.step()
    for i, m in enumerate(master_params):
        model_params[i] = nn.Parameter(m.detach().to(model_params[i].dtype))



# ----------------------------------------------------------------------------- wrong answers once in tests/ch03/test_checks_ch03.py
def uf_below_min_subnormal(t, dtype=torch.float16):
    """Compares with the smallest subnormal: forgets that the cast rounds to nearest near the bottom."""
    nz = (t != 0) & torch.isfinite(t)
    sub = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    return ((t.abs() < sub) & nz).sum().item() / max(nz.sum().item(), 1)


def uf_over_numel(t, dtype=torch.float16):
    """Divides by every element (zeros, inf and nan too)."""
    return ((t != 0) & (t.to(dtype) == 0)).sum().item() / t.numel()


def ug_divides_rounded_scale(grads, found_inf, inv_scale):
    """Divides by 1/inv_scale computed in Python, with the inf/NaN detection right."""
    from memlab import amp

    f = torch.zeros(())
    amp.unscale_grads_([g.clone() for g in grads], f, torch.ones(()))
    found_inf.copy_(torch.maximum(found_inf, f))
    scale = 1.0 / inv_scale.item()
    for g in grads:
        g.div_(scale)


class _Base:
    """Right scale(), get_scale() and update() (memlab's rule); subclasses get step() wrong."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s = torch.tensor(float(init_scale))
        self.t = torch.zeros((), dtype=torch.int32)
        self.kw = (growth_factor, backoff_factor, growth_interval)
        self.found = torch.zeros(())

    def scale(self, loss):
        return loss * self.s

    def get_scale(self):
        return self.s.item()

    def update(self):
        from memlab import amp

        amp.update_scale_(self.s, self.t, self.found, *self.kw)


class ScalerNeverSkips(_Base):
    """Unscales with GradScaler's reciprocal and detects inf/NaN, but steps anyway."""

    def step(self, opt):
        from memlab import amp

        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, self.s.double().reciprocal().float())
        opt.step()
        return True


class ScalerDividesByScale(_Base):
    """Right in every respect but dividing by the scale instead of multiplying by its fp32 reciprocal."""

    def step(self, opt):
        from memlab import amp

        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, torch.ones(()))
        if self.found.item():
            return False
        for g in grads:
            g.div_(self.s)
        opt.step()
        return True


class ScalerNoBackoff(_Base):
    """Skips the bad step, then forgets it in update(): the scale never backs off."""

    def step(self, opt):
        from memlab import amp

        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, self.s.double().reciprocal().float())
        if self.found.item():
            return False
        opt.step()
        return True

    def update(self):
        self.found = torch.zeros(())
        super().update()


def ms_keeps_stale_master_grad(model_params, master_params, optimizer):
    """A parameter without a gradient this step keeps last step's master gradient."""
    for p, m in zip(model_params, master_params):
        if p.grad is not None:
            m.grad = p.grad.float()
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            p.copy_(m)


def ms_steps_in_16_bit(model_params, master_params, optimizer):
    """Steps the 16-bit parameters with a 16-bit AdamW and copies them into the masters."""
    opt16 = torch.optim.AdamW(model_params, lr=1e-3)
    opt16.step()
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            m.copy_(p)


# ----------------------------------------------------------------------------- 03.predict_update_peak
def _update(model, recipe, *, per_mixed=18, per_fp32=16, temporaries=2, tied_twice=False, buffers=True, steps=True):
    params = list(model.parameters()) if not tied_twice else [p for _, p in model.named_parameters(remove_duplicate=False)]
    n = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)
    out = (per_fp32 if recipe == "fp32" else per_mixed) * n + temporaries * 4 * largest
    if steps:
        out += 4 * len(params)
    if buffers:
        out += sum(b.numel() * b.element_size() for b in model.buffers())
    return out


def up_masters_no_grads(model, recipe):
    """2 + 2 + 4 + 8 = 16 bytes per parameter, as often quoted: no fp32 gradients of the masters."""
    return _update(model, recipe, per_mixed=16)


def up_keeps_16bit_grads(model, recipe):
    """Keeps the 16-bit gradients next to the fp32 ones: 20 bytes per parameter."""
    return _update(model, recipe, per_mixed=20)


def up_half_of_fp32(model, recipe):
    """Half precision, half the bytes: 8 per parameter."""
    return _update(model, recipe, per_mixed=8)


def up_16bit_masters(model, recipe):
    """Master weights and their gradients in 16 bits: 2 + 2 + 2 + 8."""
    return _update(model, recipe, per_mixed=14)


def up_16bit_moments(model, recipe):
    """Adam's moments in the model's 16-bit dtype: 2 + 4 + 4 + 4."""
    return _update(model, recipe, per_mixed=14 if recipe != "fp32" else 16)


def up_no_temporaries(model, recipe):
    """Only the states: nothing for the for-loop AdamW's temporaries."""
    return _update(model, recipe, temporaries=0)


def up_tied_twice(model, recipe):
    """Counts a tied weight once per module that uses it."""
    return _update(model, recipe, tied_twice=True)


def up_fp32_without_grads(model, recipe):
    """fp32 at 12 bytes per parameter (weights + m + v), forgetting the gradients."""
    return _update(model, recipe, per_fp32=12)


MUTANTS = {
    "03.underflow_fraction": [
        ("zeros in the denominator", uf_counts_zeros),
        ("smallest normal as the threshold", uf_threshold_normal),
        ("inf and nan counted", uf_nonfinite_included),
        ("always fp16", uf_ignores_dtype),
        ("smallest subnormal as the threshold", uf_below_min_subnormal),
        ("divides by every element", uf_over_numel),
    ],
    "03.update_scale": [
        ("tracker not reset on inf", us_no_reset_on_inf),
        ("grows one step late", us_off_by_one),
        ("grows to inf", us_grows_to_inf),
        ("not in place", us_new_tensors),
    ],
    "03.unscale_grads": [
        ("resets found_inf", ug_resets_found_inf),
        ("16-bit multiply", ug_16bit_product),
        ("divides by 1/inv_scale", ug_divides),
        ("inf but not nan", ug_inf_only),
        ("not in place", ug_not_in_place),
        ("divides by a Python 1/inv_scale", ug_divides_rounded_scale),
    ],
    "03.loss_scaler": [
        ("steps even on inf/NaN", ScalerStepsAnyway),
        ("never unscales", ScalerNeverUnscales),
        ("Python double reciprocal", ScalerPythonInverse),
        ("never skips", ScalerNeverSkips),
        ("divides by the scale", ScalerDividesByScale),
        ("no backoff after a skipped step", ScalerNoBackoff),
    ],
    "03.master_step": [
        ("16-bit gradients to the fp32 optimizer", ms_16bit_grads),
        ("no copy back into the model", ms_no_copy_back),
        ("zeros for a missing gradient", ms_zero_for_missing),
        ("rebinds instead of copying", ms_rebinds),
        ("stale master gradient reused", ms_keeps_stale_master_grad),
        ("steps in 16 bits", ms_steps_in_16_bit),
    ],
    "03.predict_update_peak": [
        ("masters without fp32 gradients (16 bytes/param)", up_masters_no_grads),
        ("16-bit gradients kept too (20 bytes/param)", up_keeps_16bit_grads),
        ("half of fp32 (8 bytes/param)", up_half_of_fp32),
        ("16-bit masters", up_16bit_masters),
        ("16-bit Adam moments", up_16bit_moments),
        ("no optimizer temporaries", up_no_temporaries),
        ("tied weight counted twice", up_tied_twice),
        ("fp32 without gradients", up_fp32_without_grads),
    ],
}


# ----------------------------------------------------------------------------- issue 24: new wrong answers
def uf_tensor(t, dtype=torch.float16):
    """Right fraction, returned as a 0-d tensor."""
    from memlab import amp

    return torch.tensor(amp.underflow_fraction(t, dtype))


def uf_numpy(t, dtype=torch.float16):
    """Right fraction, as a numpy float."""
    import numpy as np

    from memlab import amp

    return np.float64(amp.underflow_fraction(t, dtype))


def uf_subnormal_counted(t, dtype=torch.float16):
    """Counts values that become zero or subnormal (precision lost is not a flush to zero)."""
    nz = (t != 0) & torch.isfinite(t)
    n = int(nz.sum())
    c = t.to(dtype)
    return 0.0 if n == 0 else int((nz & (c.abs() < torch.finfo(dtype).tiny)).sum()) / n


def us_tracker_not_reset_after_growth(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    from memlab import amp

    before = int(tracker.item())
    amp.update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    if found_inf.item() == 0 and before + 1 == growth_interval:
        tracker.fill_(growth_interval)


def us_backoff_divides(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Divides by backoff_factor on inf (the scale grows instead of backing off)."""
    if found_inf.item() > 0:
        scale.div_(backoff_factor)
        tracker.fill_(0)
        return
    n = tracker.item() + 1
    if n == growth_interval:
        new = scale * growth_factor
        if torch.isfinite(new):
            scale.copy_(new)
        n = 0
    tracker.fill_(n)


def us_grows_every_step(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Ignores growth_interval: grows after every finite step."""
    from memlab import amp

    amp.update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, 1)


def ug_counts_bad_tensors(grads, found_inf, inv_scale):
    """found_inf += 1 per bad tensor: a count, not a flag."""
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.add_(1.0)
        g.copy_(g.float() * inv_scale)


def ug_isfinite_of_sum(grads, found_inf, inv_scale):
    """Tests the sum, in the gradient's dtype: large finite fp16 values overflow it to inf."""
    for g in grads:
        if not torch.isfinite(g.sum()):
            found_inf.fill_(1.0)
        g.copy_(g.float() * inv_scale)


def ug_stops_at_first_bad(grads, found_inf, inv_scale):
    """Stops at the first bad tensor: the rest are never unscaled."""
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
            return
        g.copy_(g.float() * inv_scale)


def _step_with(grads_of):
    def step(self, opt):
        from memlab import amp

        self.found = torch.zeros(())
        amp.unscale_grads_(grads_of(opt), self.found, self.s.double().reciprocal().float())
        if self.found.item():
            return False
        opt.step()
        return True
    return step


class ScalerFirstGroupOnly(_Base):
    """Unscales and checks the first parameter group only."""
    step = _step_with(lambda opt: [p.grad for p in opt.param_groups[0]["params"] if p.grad is not None])


class ScalerLastGroupOnly(_Base):
    """Unscales and checks the last parameter group only."""
    step = _step_with(lambda opt: [p.grad for p in opt.param_groups[-1]["params"] if p.grad is not None])


class ScalerTensorBool(_Base):
    """Returns the verdict as a tensor, not a bool."""
    def step(self, opt):
        ok = _step_with(lambda o: [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None])(self, opt)
        return torch.tensor(ok)


def ms_accumulates_master_grads(model_params, master_params, optimizer):
    """Adds each step's gradient to the master's .grad instead of replacing it."""
    for p, m in zip(model_params, master_params):
        if p.grad is None:
            m.grad = None
        elif m.grad is None:
            m.grad = p.grad.float()
        else:
            m.grad += p.grad.float()
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            p.copy_(m)


def ms_copies_back_via_half(model_params, master_params, optimizer):
    """Copies back through fp16 whatever the model's dtype: bf16 gets two roundings."""
    for p, m in zip(model_params, master_params):
        m.grad = None if p.grad is None else p.grad.float()
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            p.copy_(m.half())


def ms_zero_grad_before_step(model_params, master_params, optimizer):
    """Copies the gradients, then zero_grad() 'to be clean' before stepping: nothing moves."""
    for p, m in zip(model_params, master_params):
        m.grad = None if p.grad is None else p.grad.float()
    optimizer.zero_grad()
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            p.copy_(m)


def up_no_step_counters(model, recipe):
    """Forgets AdamW's 4-byte step tensor per parameter."""
    return _update(model, recipe, steps=False)


def up_no_buffers(model, recipe):
    """Forgets the model's buffers."""
    return _update(model, recipe, buffers=False)


def up_fp32_buffers_in_16bit(model, recipe):
    """Counts the buffers in fp32 for the 16-bit recipes (the model, buffers too, is cast)."""
    return _update(model, recipe)


MUTANTS["03.underflow_fraction"] += [
    ("a tensor", uf_tensor),
    ("a numpy float", uf_numpy),
    ("subnormals counted as lost", uf_subnormal_counted),
]
MUTANTS["03.update_scale"] += [
    ("tracker not reset after growth", us_tracker_not_reset_after_growth),
    ("backoff divides", us_backoff_divides),
    ("grows every step", us_grows_every_step),
]
MUTANTS["03.unscale_grads"] += [
    ("counts bad tensors", ug_counts_bad_tensors),
    ("isfinite of the fp16 sum", ug_isfinite_of_sum),
    ("stops at the first bad tensor", ug_stops_at_first_bad),
]
MUTANTS["03.loss_scaler"] += [
    ("first parameter group only", ScalerFirstGroupOnly),
    ("last parameter group only", ScalerLastGroupOnly),
    ("a tensor instead of a bool", ScalerTensorBool),
]
MUTANTS["03.master_step"] += [
    ("master gradients accumulated", ms_accumulates_master_grads),
    ("copied back through fp16", ms_copies_back_via_half),
    ("zero_grad before the step", ms_zero_grad_before_step),
]
MUTANTS["03.predict_update_peak"] += [
    ("no step counters", up_no_step_counters),
    ("no buffers", up_no_buffers),
    ("fp32 buffers in the 16-bit recipes", up_fp32_buffers_in_16bit),
]


class ScalerTensorScale(_Base):
    """get_scale() returns the 0-d scale tensor, not a Python float."""
    step = _step_with(lambda opt: [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None])

    def get_scale(self):
        return self.s.clone() if self.kw else self.s


MUTANTS["03.loss_scaler"].append(("get_scale() returns a tensor", ScalerTensorScale))


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
def uf_view_flat(t, dtype=torch.float16):
    """Flattens with t.view(-1) (every graded tensor is contiguous): a strided or transposed tensor raises."""
    from memlab import amp

    return amp.underflow_fraction(t.view(-1), dtype)


def uf_half_subnormal_threshold(t, dtype=torch.float16):
    """Lost when |x| < smallest subnormal / 2, without casting: wrong exactly at the tie (round half to even gives 0)."""
    tie = torch.finfo(dtype).tiny * torch.finfo(dtype).eps / 2
    nz = (t != 0) & torch.isfinite(t)
    n = int(nz.sum())
    return 0.0 if n == 0 else int((nz & (t.double().abs() < tie)).sum()) / n


def us_resets_found_inf(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Right update, then clears the caller's found_inf "for the next step" (it belongs to the caller)."""
    from memlab import amp

    amp.update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    found_inf.zero_()


def us_capped_at_2_24(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Never grows the scale past 2**24 (the graded scales stay far below)."""
    from memlab import amp

    amp.update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    scale.clamp_(max=2.0**24)


def ug_via_float32(grads, found_inf, inv_scale):
    """Multiplies in float32 and copies back (every graded gradient is 16-bit or fp32): fp64 gradients lose bits."""
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        g.copy_(g.float() * inv_scale)


def ug_flat_views(grads, found_inf, inv_scale):
    """Works on g.view(-1) (every graded gradient is contiguous): a transposed or strided gradient raises."""
    from memlab import amp

    amp.unscale_grads_([g.view(-1) for g in grads], found_inf, inv_scale)


class ScalerClassScale(_Base):
    """The scale lives on the class ("one scaler per run"): a second scaler starts from the first one's scale."""

    s = None

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval)
        if ScalerClassScale.s is None:
            ScalerClassScale.s = self.s
        self.s = ScalerClassScale.s

    def step(self, opt):
        from memlab import amp

        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, self.s.double().reciprocal().float())
        if self.found.item():
            return False
        opt.step()
        return True


class ScalerTwoGroups(_Base):
    """Unscales the first two parameter groups only (the graded optimizer has two)."""

    def step(self, opt):
        from memlab import amp

        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups[:2] for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, self.s.double().reciprocal().float())
        if self.found.item():
            return False
        opt.step()
        return True


def ms_half_copies(model_params, master_params, optimizer):
    """Makes the 16-bit copies with .half() (fp16 assumed): a bf16 model becomes fp16."""
    for p, m in zip(model_params, master_params):
        m.grad = None if p.grad is None else p.grad.float()
    optimizer.step()
    with torch.no_grad():
        for i, (p, m) in enumerate(zip(model_params, master_params)):
            p.data = m.detach().half()


_LAST_GRADS: list = []


def ms_keeps_grads(model_params, master_params, optimizer):
    """Right step, and the 16-bit gradients kept in a module-level list "for logging": they stay alive."""
    from memlab import amp

    _LAST_GRADS.append([p.grad for p in model_params])
    amp.master_step(model_params, master_params, optimizer)


MUTANTS["03.underflow_fraction"] += [
    ("flattened with view(-1)", uf_view_flat),
    ("the smallest subnormal / 2 as a threshold (no cast)", uf_half_subnormal_threshold),
]
MUTANTS["03.update_scale"] += [
    ("clears the caller's found_inf", us_resets_found_inf),
    ("scale capped at 2**24", us_capped_at_2_24),
]
MUTANTS["03.unscale_grads"] += [
    ("multiplies in float32 and copies back", ug_via_float32),
    ("works on view(-1)", ug_flat_views),
]
MUTANTS["03.loss_scaler"] += [
    ("the scale on the class", ScalerClassScale),
    ("unscales two parameter groups only", ScalerTwoGroups),
]
MUTANTS["03.master_step"] += [
    ("16-bit copies made with .half()", ms_half_copies),
    ("16-bit gradients kept in a module-level list", ms_keeps_grads),
]


# ----------------------------------------------------------------------------- issue 35: one mutant of each kind
# (tests/course/test_mutants.py: a hygiene mutant is caught by a hygiene probe, a constants or space mutant by the
# drawn cases with the hand-picked edges off)


def underflow_abs_in_place(t, dtype=torch.float16):
    """Takes |t| in place on the caller's tensor before counting."""
    from memlab.amp import underflow_fraction

    t.abs_()
    return underflow_fraction(t, dtype)


def unscale_inv_scale_as_scratch(grads, found_inf, inv_scale):
    """Right, but turns the caller's inv_scale into the scale in place and back: a float round trip changes it."""
    from memlab.amp import unscale_grads_

    inv_scale.reciprocal_()
    unscale_grads_(grads, found_inf, 1.0 / inv_scale)
    inv_scale.reciprocal_()


def _scaler_interval_2000():
    from memlab.amp import DynamicLossScaler

    class Interval2000(DynamicLossScaler):
        """growth_interval taken as torch's default, 2000, whatever the caller passes."""

        def __init__(self, *args, **kwargs):
            kwargs["growth_interval"] = 2000
            if len(args) > 3:
                args = args[:3]
            super().__init__(*args, **kwargs)

    return Interval2000


def _scaler_counted():
    from memlab.amp import DynamicLossScaler

    return _counted_on_the_class(DynamicLossScaler)


def _update_peak_memo():
    from memlab.amp import update_peak_bytes

    return _memoised(update_peak_bytes, key=lambda model, recipe: (sum(p.numel() for p in model.parameters()), recipe))


MUTANTS["03.underflow_fraction"] += [("|t| taken in place", underflow_abs_in_place)]
MUTANTS["03.unscale_grads"] += [("inv_scale used as scratch", unscale_inv_scale_as_scratch)]
MUTANTS["03.loss_scaler"] += [("growth_interval always 2000", _scaler_interval_2000()),
                              ("instances counted on the class", _scaler_counted())]
MUTANTS["03.predict_update_peak"] += [("memoised by parameter count in a dict kept between calls", _update_peak_memo())]

KINDS = {
    "03.underflow_fraction": {"hygiene": ["|t| taken in place"], "constants": ["always fp16"],
                              "space": ["flattened with view(-1)", "inf and nan counted"]},
    "03.update_scale": {"hygiene": ["clears the caller's found_inf"], "constants": ["scale capped at 2**24"],
                        "space": ["grows to inf"]},
    "03.unscale_grads": {"hygiene": ["inv_scale used as scratch"], "constants": ["16-bit multiply"],
                         "space": ["works on view(-1)", "stops at the first bad tensor"]},
    "03.loss_scaler": {"hygiene": ["instances counted on the class"], "constants": ["growth_interval always 2000"],
                       "space": ["first parameter group only"]},
    "03.master_step": {"hygiene": ["16-bit gradients kept in a module-level list"],
                       "constants": ["16-bit copies made with .half()"], "space": ["zeros for a missing gradient"]},
    "03.predict_update_peak": {"hygiene": ["memoised by parameter count in a dict kept between calls"],
                               "constants": ["fp32 buffers in the 16-bit recipes"], "space": ["tied weight counted twice"]},
}


# right answers written another way (the over-specific kind): each must PASS
def unscale_with_torchs_kernel(grads, found_inf, inv_scale):
    """torch's own fused unscale (what GradScaler calls): in place, found_inf set to 1.0 on any inf/NaN."""
    torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)


RIGHT_ANSWERS = {"03.unscale_grads": [("torch's _amp_foreach_non_finite_check_and_unscale_", unscale_with_torchs_kernel)]}
