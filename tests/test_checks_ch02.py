"""Chapter 02 checks: pass on memlab's own answers, fail on plausible wrong ones."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

import memlab.checkpoint as ck
from memlab.grading import check, load_chapter

load_chapter("02")

IDS = ["02.count_saved", "02.checkpoint_function", "02.rng_replay", "02.checkpoint_sequential", "02.choose_segments"]
REFERENCES = {
    "02.count_saved": ck.count_saved_tensors,
    "02.checkpoint_function": ck.checkpoint_reentrant,
    "02.rng_replay": ck.RNGState,
    "02.checkpoint_sequential": ck.checkpoint_sequential,
    "02.choose_segments": ck.segments_for_budget,
}


@pytest.mark.parametrize("exercise_id", IDS)
def test_reference_passes(exercise_id):
    r = check(exercise_id, REFERENCES[exercise_id], quiet=True)
    assert r.status == "pass", r.message


# ----------------------------------------------------------------------------- wrong answers
def count_every_saved_tensor(fn, *args):
    """Wrong: counts each saved tensor, not each storage."""
    params = {p.data_ptr() for p in fn.parameters()} if isinstance(fn, nn.Module) else set()
    n, nbytes = 0, 0

    def pack(t):
        nonlocal n, nbytes
        if t.data_ptr() not in params:
            n += 1
            nbytes += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return n, nbytes


def count_including_parameters(fn, *args):
    """Wrong: parameters saved by Linear are counted as activations."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return len(seen), sum(seen.values())


def checkpoint_no_function(fn, *args):
    """Wrong: not an autograd.Function, keeps every activation."""
    return fn(*args)


class _NoGradInForward(torch.autograd.Function):
    """Wrong: forward under no_grad, but backward forgets the parameters (autograd.grad on inputs only)."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.fn(x)
        (gx,) = torch.autograd.grad(out, x, g)
        return None, gx


def checkpoint_params_lost(fn, x):
    return _NoGradInForward.apply(fn, x)


class SnapshotNoRestore:
    """Wrong: replays the state but leaves the RNG there."""

    def __init__(self):
        self.state = torch.get_rng_state()

    @contextmanager
    def replay(self):
        torch.set_rng_state(self.state)
        yield


class SnapshotNoFinally:
    """Wrong: restores the state only when the body does not raise."""

    def __init__(self):
        self.state = torch.get_rng_state()

    @contextmanager
    def replay(self):
        now = torch.get_rng_state()
        torch.set_rng_state(self.state)
        yield
        torch.set_rng_state(now)


def sequential_without_rng(modules, segments, x):
    """Wrong: checkpoints without replaying the RNG, so dropout masks differ in backward."""
    return ck.checkpoint_sequential(modules, segments, x, preserve_rng_state=False)


def sequential_checkpoint_everything(modules, segments, x):
    """Wrong: checkpoints every segment, the last one too (recomputes it for nothing)."""
    bounds = ck.split_segments(len(modules), segments)
    for a, b in bounds:
        def seg(inp, chunk=modules[a:b]):
            for m in chunk:
                inp = m(inp)
            return inp
        x = ck.checkpoint(seg, x)
    return x


def segments_sqrt_always(n, budget, layer, boundary):
    """Wrong: ignores the budget."""
    return ck.sqrt_segments(n)


def segments_most_that_fit(n, budget, layer, boundary):
    """Wrong: the largest k that fits (most recompute)."""
    for k in range(n, 0, -1):
        if ck.activation_memory_model(n, k, layer, boundary) <= budget:
            return k
    raise ValueError("no k fits")


def segments_no_error(n, budget, layer, boundary):
    """Wrong: returns n when nothing fits instead of raising."""
    try:
        return ck.segments_for_budget(n, budget, layer, boundary)
    except ValueError:
        return n


@pytest.mark.parametrize("exercise_id, wrong", [
    ("02.count_saved", count_every_saved_tensor),
    ("02.count_saved", count_including_parameters),
    ("02.checkpoint_function", checkpoint_no_function),
    ("02.checkpoint_function", checkpoint_params_lost),
    ("02.checkpoint_function", ck.checkpoint),  # right gradients, but not an autograd.Function
    ("02.rng_replay", SnapshotNoRestore),
    ("02.rng_replay", SnapshotNoFinally),
    ("02.checkpoint_sequential", sequential_without_rng),
    ("02.checkpoint_sequential", sequential_checkpoint_everything),
    ("02.choose_segments", segments_sqrt_always),
    ("02.choose_segments", segments_most_that_fit),
    ("02.choose_segments", segments_no_error),
])
def test_wrong_answer_fails(exercise_id, wrong):
    r = check(exercise_id, wrong, quiet=True)
    assert r.status in ("fail", "error"), (r.status, r.message)


def test_stub_is_todo():
    def stub(*args):
        raise NotImplementedError("exercise 02.count_saved: replace this line with your code")

    assert check("02.count_saved", stub, quiet=True).status == "todo"
