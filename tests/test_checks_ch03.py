"""Chapter 03's checks pass on memlab's own answers and fail on plausible wrong ones."""
from __future__ import annotations

import pytest
import torch

from memlab import amp
from memlab.grading import check, get_exercise

IDS = ["03.underflow_fraction", "03.update_scale", "03.unscale_grads", "03.loss_scaler", "03.master_step"]


@pytest.mark.parametrize("exercise", IDS)
def test_reference_passes(exercise):
    r = check(exercise, get_exercise(exercise).reference(), quiet=True)
    assert r.status == "pass", r.message


def _bad(exercise, obj):
    r = check(exercise, obj, quiet=True)
    assert r.status in ("fail", "error"), f"{exercise}: a wrong answer got {r.status}"
    return r


def test_stub_is_todo():
    def stub(*a, **k):
        raise NotImplementedError("exercise 03.update_scale: replace this line with your code")

    assert check("03.update_scale", stub, quiet=True).status == "todo"


# ----------------------------------------------------------------------------- underflow_fraction
def test_underflow_wrong_answers():
    def counts_zeros_too(t, dtype=torch.float16):  # denominator includes values that were already 0
        return ((t != 0) & (t.to(dtype) == 0)).sum().item() / t.numel()

    def below_min_normal(t, dtype=torch.float16):  # forgets subnormals
        nz = (t != 0) & torch.isfinite(t)
        return ((t.abs() < torch.finfo(dtype).smallest_normal) & nz).sum().item() / max(nz.sum().item(), 1)

    def below_min_subnormal(t, dtype=torch.float16):  # forgets round-to-nearest near the bottom
        nz = (t != 0) & torch.isfinite(t)
        sub = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        return ((t.abs() < sub) & nz).sum().item() / max(nz.sum().item(), 1)

    for wrong in (counts_zeros_too, below_min_normal, below_min_subnormal):
        _bad("03.underflow_fraction", wrong)


# ----------------------------------------------------------------------------- update_scale
def test_update_scale_wrong_answers():
    def no_tracker_reset_on_inf(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf.item():
            scale.fill_(scale.item() * backoff)
            return
        t = tracker.item() + 1
        if t == interval:
            scale.fill_(scale.item() * growth)
            t = 0
        tracker.fill_(t)

    def grows_to_inf(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf.item():
            scale.fill_(scale.item() * backoff)
            tracker.fill_(0)
            return
        t = tracker.item() + 1
        if t == interval:
            scale.fill_(scale.item() * growth)  # no isfinite guard
            t = 0
        tracker.fill_(t)

    def off_by_one(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf.item():
            scale.fill_(scale.item() * backoff)
            tracker.fill_(0)
        elif tracker.item() == interval:  # compares before counting this step
            scale.fill_(scale.item() * growth)
            tracker.fill_(0)
        else:
            tracker.add_(1)

    for wrong in (no_tracker_reset_on_inf, grows_to_inf, off_by_one):
        _bad("03.update_scale", wrong)
    # the right rule written with Python floats (one rounding to float32 by fill_) passes
    def python_floats(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf.item():
            scale.fill_(scale.item() * backoff)
            tracker.fill_(0)
            return
        t = tracker.item() + 1
        if t == interval:
            new = torch.tensor(scale.item() * growth, dtype=torch.float32)
            if torch.isfinite(new):
                scale.copy_(new)
            t = 0
        tracker.fill_(t)

    assert check("03.update_scale", python_floats, quiet=True).status == "pass"


# ----------------------------------------------------------------------------- unscale_grads
def test_unscale_wrong_answers():
    def resets_found_inf(grads, found_inf, inv_scale):
        found_inf.zero_()
        amp.unscale_grads_(grads, found_inf, inv_scale)

    def misses_nan(grads, found_inf, inv_scale):
        for g in grads:
            if torch.isinf(g).any():
                found_inf.fill_(1.0)
            g.mul_(inv_scale)

    def divides(grads, found_inf, inv_scale):
        f = torch.zeros(())
        amp.unscale_grads_([g.clone() for g in grads], f, torch.ones(()))
        found_inf.copy_(torch.maximum(found_inf, f))
        scale = 1.0 / inv_scale.item()
        for g in grads:
            g.div_(scale)

    for wrong in (resets_found_inf, misses_nan, divides):
        _bad("03.unscale_grads", wrong)


# ----------------------------------------------------------------------------- loss_scaler
class _Base:
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
        amp.update_scale_(self.s, self.t, self.found, *self.kw)


class NeverSkips(_Base):
    def step(self, opt):
        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, self.s.double().reciprocal().float())
        opt.step()
        return True


class DividesByScale(_Base):
    def step(self, opt):
        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, torch.ones(()))
        if self.found.item():
            return False
        for g in grads:
            g.div_(self.s)
        opt.step()
        return True


class NoBackoff(_Base):
    def step(self, opt):
        self.found = torch.zeros(())
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        amp.unscale_grads_(grads, self.found, self.s.double().reciprocal().float())
        if self.found.item():
            return False
        opt.step()
        return True

    def update(self):
        self.found = torch.zeros(())  # forgets that the step was skipped
        super().update()


def test_loss_scaler_wrong_answers():
    r = _bad("03.loss_scaler", NeverSkips)
    assert "stepped" in r.message
    _bad("03.loss_scaler", NoBackoff)
    # right in every respect but dividing by the scale instead of multiplying by its fp32
    # reciprocal: with a scale that is not a power of two the parameters drift apart
    r = _bad("03.loss_scaler", DividesByScale)
    assert "differs from GradScaler" in r.message


# ----------------------------------------------------------------------------- master_step
def test_master_step_wrong_answers():
    def forgets_copy_back(model_params, master_params, optimizer):
        for p, m in zip(model_params, master_params):
            m.grad = None if p.grad is None else p.grad.float()
        optimizer.step()

    def keeps_stale_master_grad(model_params, master_params, optimizer):
        for p, m in zip(model_params, master_params):
            if p.grad is not None:
                m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(model_params, master_params):
                p.copy_(m)

    def steps_in_16_bit(model_params, master_params, optimizer):
        opt16 = torch.optim.AdamW(model_params, lr=1e-3)
        opt16.step()
        with torch.no_grad():
            for p, m in zip(model_params, master_params):
                m.copy_(p)

    def shares_dtype(model_params, master_params, optimizer):
        for p, m in zip(model_params, master_params):
            m.grad = p.grad  # a 16-bit grad on an fp32 parameter
        optimizer.step()

    for wrong in (forgets_copy_back, keeps_stale_master_grad, steps_in_16_bit, shares_dtype):
        _bad("03.master_step", wrong)
