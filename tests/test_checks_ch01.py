"""Chapter 01 checks: pass on memlab's own answers, fail on plausible wrong ones."""
from __future__ import annotations

import weakref

import pytest
import torch

import memlab.profiler as prof
from memlab.grading import check, load_chapter
from memlab.models import lm_loss

load_chapter("01")

REFERENCES = {
    "01.live_bytes": prof.LiveBytes,
    "01.categorize": prof.categorize,
    "01.phase_peaks": prof.phase_peaks,
    "01.fake_activations": prof.fake_activation_bytes,
    "01.fix_the_leak": prof.train_losses,
}


@pytest.mark.parametrize("exercise_id", list(REFERENCES))
def test_reference_passes(exercise_id):
    r = check(exercise_id, REFERENCES[exercise_id], quiet=True)
    assert r.status == "pass", r.message


def assert_rejected(exercise_id, obj):
    r = check(exercise_id, obj, quiet=True)
    assert r.status in ("fail", "error"), (r.status, r.message)
    return r


# ----------------------------------------------------------------------------- 01.live_bytes
class PerTensorBytes:
    """Wrong: counts every tracked tensor (views double-counted), never subtracts."""

    def __init__(self):
        self.current = self.peak = 0

    def track(self, t):
        self.current += t.numel() * t.element_size()
        self.peak = max(self.peak, self.current)


class NoFinalizer:
    """Wrong: storages counted once, but nothing is given back when they die."""

    def __init__(self):
        self.current = self.peak = 0
        self.seen = set()

    def track(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.seen:
            self.seen.add(st.data_ptr())
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)


class WeakrefOnTensor:
    """Wrong: the finalizer watches the tensor, not the storage (a surviving view is missed)."""

    def __init__(self):
        self.current = self.peak = 0
        self.seen = {}

    def track(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.seen:
            return
        n = st.nbytes()

        def free(_, key=key, n=n):
            self.seen.pop(key, None)
            self.current -= n

        self.seen[key] = weakref.finalize(t, free, None)
        self.current += n
        self.peak = max(self.peak, self.current)


@pytest.mark.parametrize("wrong", [PerTensorBytes, NoFinalizer, WeakrefOnTensor])
def test_live_bytes_rejects(wrong):
    assert_rejected("01.live_bytes", wrong)


# ----------------------------------------------------------------------------- 01.categorize
def categorize_by_identity(t, model, optimizer):
    """Wrong: `t is p` misses views and detached aliases of a parameter."""
    params = list(model.parameters()) + list(model.buffers()) if model is not None else []
    if any(t is p for p in params):
        return "parameters"
    if any(t is p.grad for p in params):
        return "gradients"
    if optimizer is not None and any(t is v for s in optimizer.state.values() for v in s.values()):
        return "optimizer"
    return "activations" if t.grad_fn is not None else "other"


def categorize_by_requires_grad(t, model, optimizer):
    """Wrong: 'needs a gradient' is not 'is an activation'; buffers forgotten."""
    key = t.untyped_storage().data_ptr()
    if model is not None and any(p.untyped_storage().data_ptr() == key for p in model.parameters()):
        return "parameters"
    if model is not None and any(p.grad is not None and p.grad.untyped_storage().data_ptr() == key for p in model.parameters()):
        return "gradients"
    if optimizer is not None and any(
        isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == key for s in optimizer.state.values() for v in s.values()
    ):
        return "optimizer"
    return "activations" if t.requires_grad else "other"


@pytest.mark.parametrize("wrong", [categorize_by_identity, categorize_by_requires_grad])
def test_categorize_rejects(wrong):
    assert_rejected("01.categorize", wrong)


# ----------------------------------------------------------------------------- 01.phase_peaks
def sum_of_category_peaks(timeline):
    """Wrong: adds each category's own maximum (they do not peak at the same time)."""
    out = {}
    for _, phase, b in timeline:
        cur = out.setdefault(phase, {})
        for k, v in b.items():
            cur[k] = max(cur.get(k, 0), v)
    return {p: sum(c.values()) for p, c in out.items()}


def last_value_per_phase(timeline):
    """Wrong: the total at the end of each phase, not its peak."""
    out = {}
    for _, phase, b in timeline:
        out[phase] = sum(b.values())
    return out


@pytest.mark.parametrize("wrong", [sum_of_category_peaks, last_value_per_phase])
def test_phase_peaks_rejects(wrong):
    assert_rejected("01.phase_peaks", wrong)


# ----------------------------------------------------------------------------- 01.fake_activations
def fake_keyed_by_data_ptr(config, batch_size, seq_len):
    """Wrong: data_ptr() is meaningless on fake tensors, so every storage collides."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab.models import TinyGPT

    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in skip:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x)
    return sum(seen.values())


def fake_counting_parameters(config, batch_size, seq_len):
    """Wrong: the weights saved by each Linear are counted as activations."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab.models import TinyGPT

    with FakeTensorMode():
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            seen[id(st)] = st
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x)
        return sum(st.nbytes() for st in seen.values())


@pytest.mark.parametrize("wrong", [fake_keyed_by_data_ptr, fake_counting_parameters])
def test_fake_activations_rejects(wrong):
    assert_rejected("01.fake_activations", wrong)


# ----------------------------------------------------------------------------- 01.fix_the_leak
def train_leaky(model, opt, batches, steps):
    """Wrong: the buggy loop of the lab (the history keeps every loss and, retained, its graph)."""
    history = []
    it = iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        history.append(loss)
        loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
    return history


def train_leaky_floats(model, opt, batches, steps):
    """Wrong: returns floats, but keeps the tensors (and graphs) in a second list."""
    history, kept = [], []
    it = iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
        kept.append(loss)
        history.append(loss.item())
    train_leaky_floats.kept = kept  # still reachable after return: a leak
    return history


def train_detached(model, opt, batches, steps):
    """Wrong: detach() drops the graph but still keeps a tensor per step."""
    history = []
    it = iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss.detach())
    return history


def train_no_zero_grad(model, opt, batches, steps):
    """Wrong: gradients accumulate across steps (no zero_grad): the losses differ."""
    history = []
    it = iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        history.append(loss.item())
    return history


@pytest.mark.parametrize("wrong", [train_leaky, train_leaky_floats, train_detached, train_no_zero_grad])
def test_fix_the_leak_rejects(wrong):
    r = assert_rejected("01.fix_the_leak", wrong)
    if wrong is train_leaky_floats:
        assert "flat" in r.message
