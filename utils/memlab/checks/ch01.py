"""Checks for chapter 01, "a memory profiler from scratch"."""
from __future__ import annotations

import gc
import itertools
import math

import torch
from torch import nn

from memlab import profiler as ref
from memlab.checks import expect, expect_equal, expect_type, register


# ---------------------------------------------------------------------------- 01.live_bytes
@register("01.live_bytes", reference=lambda: ref.LiveBytes, title="a live-bytes counter with weakref finalizers")
def check_live_bytes(cls):
    lb = cls()
    expect_equal("a new counter: (current, peak)", (lb.current, lb.peak), (0, 0))
    x = torch.zeros(256)  # 1024 bytes
    lb.track(x)
    expect_equal("after track(torch.zeros(256)): current bytes", lb.current, 1024)
    lb.track(x)
    lb.track(x[:10])
    lb.track(x.view(16, 16).t())
    expect_equal("after tracking the same tensor again and two views of it (one storage): current", lb.current, 1024)
    b = torch.ones(64)
    lb.track(b[:8])  # only a temporary view is tracked: the storage lives on in b
    gc.collect()
    expect_equal("after track(b[:8]) (the view died at once, b is alive): current", lb.current, 1024 + 256)
    keep = b.untyped_storage()
    del b
    gc.collect()
    expect_equal("b deleted, but its storage object is still referenced: current", lb.current, 1024 + 256)
    del keep
    gc.collect()
    expect_equal("after the storage itself died: current", lb.current, 1024)
    y = torch.zeros(100, dtype=torch.float64)
    lb.track(y)
    expect_equal("after also tracking 100 float64: current", lb.current, 1824)
    v = x[:4]
    del x
    gc.collect()
    expect_equal("x deleted but its view x[:4] still alive (the whole storage stays): current", lb.current, 1824)
    del v
    gc.collect()
    expect_equal("after the last view of x died (a weakref callback on the storage should fire): current",
                 lb.current, 800)
    del y
    gc.collect()
    expect_equal("after every tracked tensor died: (current, peak)", (lb.current, lb.peak), (0, 1824))
    z = torch.empty(10, dtype=torch.bfloat16)
    lb.track(z)
    expect_equal("a bfloat16 tensor of 10 elements: current", lb.current, 20)
    expect_equal("peak stays the highest value seen", lb.peak, 1824)
    del z


# ---------------------------------------------------------------------------- 01.categorize
def _trained_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).square().mean().backward()
    opt.step()
    return model, opt


@register("01.categorize", reference=lambda: ref.categorize, title="which category a tensor belongs to")
def check_categorize(fn):
    model, opt = _trained_mlp()
    x = torch.randn(5, 8)
    h = model[0](x)  # an activation: produced by an op autograd recorded
    loss = model(x).square().mean()
    loss.backward()
    w = model[0].weight
    cases = [
        ("model[0].weight", w, "parameters"),
        ("model[0].weight.detach() (another tensor, the same storage)", w.detach(), "parameters"),
        ("model[0].weight[:3] (a view)", w[:3], "parameters"),
        ("model[1].running_mean (a buffer)", model[1].running_mean, "parameters"),
        ("model[0].weight.grad", w.grad, "gradients"),
        ("model[3].bias.grad", model[3].bias.grad, "gradients"),
        ("opt.state[weight]['exp_avg']", opt.state[w]["exp_avg"], "optimizer"),
        ("opt.state[weight]['exp_avg_sq']", opt.state[w]["exp_avg_sq"], "optimizer"),
        ("opt.state[weight]['step']", opt.state[w]["step"], "optimizer"),
        ("model[0](x) (the output of a layer, with a grad_fn)", h, "activations"),
        ("loss", loss, "activations"),
        ("torch.zeros(3) (nobody's tensor)", torch.zeros(3), "other"),
        ("x (an input batch)", x, "other"),
    ]
    for name, t, want in cases:
        got = fn(t, model, opt)
        expect(got in ref.CATEGORIES, f"categorize({name}): got {got!r}, expected one of {ref.CATEGORIES}")
        expect_equal(f"categorize({name})", got, want)
    expect_equal("categorize(h, model=None, optimizer=None)", fn(h, None, None), "activations")


# ---------------------------------------------------------------------------- 01.phase_peaks
def _ev(i, phase, **b):
    return ref.Event(i, phase, {c: b.get(c, 0) for c in ref.CATEGORIES})


@register("01.phase_peaks", reference=lambda: ref.phase_peaks, title="per-phase peaks from a timeline")
def check_phase_peaks(fn):
    # the categories peak at different events: the answer is the peak of the totals
    tl = [
        _ev(0, "other", parameters=100),
        _ev(3, "forward", parameters=100, activations=50),
        _ev(7, "forward", parameters=100, activations=80, other=5),
        _ev(9, "backward", parameters=100, activations=70, gradients=10),
        _ev(12, "backward", parameters=100, activations=20, gradients=100),
        _ev(15, "optimizer", parameters=100, gradients=100, optimizer=200, other=100),
        _ev(16, "optimizer", parameters=100, gradients=100, optimizer=200),
        _ev(20, "forward", parameters=100, optimizer=200, activations=30),
    ]
    got = fn(tl)
    expect_type("phase_peaks(timeline)", got, dict)
    want = ref.phase_peaks(tl)
    expect_equal("the phases in the answer", sorted(got), sorted(want))
    for phase in want:
        expect_equal(f"peak total bytes of phase {phase!r}", got[phase], want[phase])
    # a real timeline
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)
    with ref.MemoryTracker(model, opt) as tr:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    got = fn(tr.timeline)
    want = tr.phase_peaks()
    expect_equal("phase peaks of a real MLP training step's timeline", got, want)
    expect_equal("the largest phase peak is the step's peak", max(got.values()), tr.peak_bytes)
    expect_equal("an empty timeline", fn([]), {})


# ---------------------------------------------------------------------------- 01.fake_activations
@register("01.fake_activations", timeout=90, reference=lambda: ref.fake_activation_bytes,
          title="activation bytes of a too-large model, on fake tensors")
def check_fake_activations(fn):
    from memlab.accounting import saved_activation_bytes
    from memlab.models import TinyGPT, TinyGPTConfig

    # 1. small enough to run for real: the fake count must equal the real one
    cfg = TinyGPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (3, 32))
    y = torch.randint(0, cfg.vocab_size, (3, 32))
    real = saved_activation_bytes(lambda: model(x, y)[1], exclude=list(model.parameters()) + list(model.buffers()))
    got = fn(cfg, 3, 32)
    expect(isinstance(got, int) and not isinstance(got, bool),
           f"fake_activation_bytes: expected an int number of bytes, got {type(got).__name__}")
    expect_equal("a 2-layer TinyGPT, batch 3 x 32 tokens: fake count vs the same forward run for real", got, real)
    # 2. far too large for this machine: 32 layers of width 4096 (about 6.5e9 parameters, 26 GB in fp32)
    big = TinyGPTConfig(vocab_size=32000, block_size=2048, n_layer=32, n_head=32, n_embd=4096)
    got = fn(big, 1, 2048)
    want = ref.fake_activation_bytes(big, 1, 2048)
    expect_equal("32 layers x 4096 wide, batch 1 x 2048 tokens (saved bytes)", got, want)
    got2 = fn(big, 2, 1024)
    want2 = ref.fake_activation_bytes(big, 2, 1024)
    expect_equal("the same model, batch 2 x 1024 tokens", got2, want2)


# ---------------------------------------------------------------------------- 01.fix_the_leak
def _setup(seed=0):
    from memlab.models import TinyGPT, TinyGPTConfig

    cfg = TinyGPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    y = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    return model, opt, x, y


@register("01.fix_the_leak", timeout=90, reference=lambda: ref.train_losses, title="find and fix the leak")
def check_fix_the_leak(train):
    currents, result = {}, {}
    for steps in (1, 3):
        model, opt, x, y = _setup()
        batches = itertools.repeat((x, y))  # one batch again and again: its storage counts once
        tracker = ref.MemoryTracker(model, opt)
        with tracker:
            history = train(model, opt, batches, steps)
        gc.collect()
        currents[steps] = tracker.current_bytes  # the history is still alive here
        result[steps] = history
    history = result[3]
    expect_type("train(...) return value", history, list)
    expect_equal("len(history) after 3 steps", len(history), 3)
    for i, h in enumerate(history):
        expect(type(h) is float,
               f"history[{i}]: expected a Python float (loss.item()), got {type(h).__name__}; a tensor keeps its graph alive")
    model, opt, x, y = _setup()
    want = ref.train_losses(model, opt, itertools.repeat((x, y)), 3)
    for i, (g, w) in enumerate(zip(history, want)):
        expect(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6),
               f"loss at step {i}: got {g:.6f}, expected {w:.6f} (forward, backward, optimizer.step, zero_grad each step)")
    growth = currents[3] - currents[1]
    expect(growth == 0,
           f"live bytes after 3 steps minus after 1 step: {growth:,} bytes; memory must stay flat "
           f"(something from each step is still alive: a loss tensor, its graph, a retained graph?)")
