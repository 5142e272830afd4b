"""Plausible wrong answers to chapter 02's exercises; tests/test_mutants.py asserts each FAILS."""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from memlab.checkpoint import checkpoint


# ----------------------------------------------------------------------------- 02.count_saved
def _count(fn, args, *, dedup=True, skip_params=True, view_bytes=False, key_of=lambda t: t.untyped_storage().data_ptr()):
    skip = {key_of(t) for t in list(fn.parameters()) + list(fn.buffers())} if skip_params and isinstance(fn, nn.Module) else set()
    seen: dict = {}
    n = [0]

    def pack(t):
        if key_of(t) in skip:
            return t
        b = t.numel() * t.element_size() if view_bytes else t.untyped_storage().nbytes()
        if dedup:
            seen[key_of(t)] = b
        else:
            seen[n[0]] = b
            n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return len(seen), sum(seen.values())


def count_no_dedup(fn, *args):
    return _count(fn, args, dedup=False)


def count_with_weights(fn, *args):
    return _count(fn, args, skip_params=False)


def count_view_bytes(fn, *args):
    return _count(fn, args, view_bytes=True)


def count_by_tensor_id(fn, *args):
    """Keys on id(tensor): the same storage packed as two tensor objects counts twice."""
    return _count(fn, args, key_of=id)


# ----------------------------------------------------------------------------- 02.checkpoint_function
class _NoReplay(torch.autograd.Function):
    """Recomputes without restoring the RNG: dropout draws another mask in backward."""
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
        torch.autograd.backward(out, g)
        return None, x.grad


class _KeepsGraph(torch.autograd.Function):
    """Runs fn with grad enabled in forward: keeps every activation, saving nothing."""
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.enable_grad():
            xx = x.detach().requires_grad_(True)
            ctx.out = fn(xx)
            ctx.xx = xx
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, g):
        torch.autograd.backward(ctx.out, g)
        return None, ctx.xx.grad


class _NoInputGrad(torch.autograd.Function):
    """Recomputes from a detached input that does not require grad: x gets no gradient."""
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.rng = torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                out = ctx.fn(x.detach())
        torch.autograd.backward(out, g)
        return None, torch.zeros_like(x)


class _ParamsLost(torch.autograd.Function):
    """Recomputes with RNG replay, but takes torch.autograd.grad on the input only: the parameters
    inside fn never get their gradients."""
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.rng = torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                out = ctx.fn(x)
        (gx,) = torch.autograd.grad(out, x, g)
        return None, gx


def ckpt_params_lost(fn, x):
    return _ParamsLost.apply(fn, x)


def ckpt_no_replay(fn, x):
    return _NoReplay.apply(fn, x)


def ckpt_keeps_graph(fn, x):
    return _KeepsGraph.apply(fn, x)


def ckpt_no_input_grad(fn, x):
    return _NoInputGrad.apply(fn, x)


def ckpt_plain_call(fn, x):
    """No Function at all: right values and gradients, nothing saved."""
    return fn(x)


# ----------------------------------------------------------------------------- 02.rng_replay
class SnapshotNoRestore:
    def __init__(self):
        self.state = torch.get_rng_state()

    @contextmanager
    def replay(self):
        torch.set_rng_state(self.state)
        yield


class SnapshotNoFinally:
    def __init__(self):
        self.state = torch.get_rng_state()

    @contextmanager
    def replay(self):
        now = torch.get_rng_state()
        torch.set_rng_state(self.state)
        yield
        torch.set_rng_state(now)


class SnapshotAtReplay:
    """Takes the state when replay() starts, not when the snapshot was made."""
    @contextmanager
    def replay(self):
        now = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(now)


class SnapshotFixedSeed:
    """Re-seeds with a constant instead of saving the state."""
    def __init__(self):
        torch.manual_seed(0)

    @contextmanager
    def replay(self):
        now = torch.get_rng_state()
        torch.manual_seed(0)
        try:
            yield
        finally:
            torch.set_rng_state(now)


# ----------------------------------------------------------------------------- 02.checkpoint_sequential
def _run(chunk):
    def run(inp):
        for m in chunk:
            inp = m(inp)
        return inp
    return run


def seq_all_but_last(modules, segments, x):
    """Ignores k: one checkpoint around every layer but the last."""
    return _run(modules[-1:])(checkpoint(_run(modules[:-1]), x))


def seq_last_checkpointed_too(modules, segments, x):
    size = len(modules) // segments
    for j in range(segments):
        stop = len(modules) if j == segments - 1 else (j + 1) * size
        x = checkpoint(_run(modules[j * size:stop]), x)
    return x


def seq_ceil_split(modules, segments, x):
    """Segments of ceil(n/k) layers: the same as torch's split only when k divides n."""
    n = len(modules)
    size = math.ceil(n / segments)
    starts = list(range(0, n, size))
    for j, s in enumerate(starts):
        run = _run(modules[s:s + size])
        x = run(x) if j == len(starts) - 1 else checkpoint(run, x)
    return x


def seq_torch_split(modules, segments, x):
    """torch.utils.checkpoint.checkpoint_sequential's split: k - 1 segments of n // k, the rest last.
    Uneven n/k leaves a long last segment (n=10, k=4: 2, 2, 2, 4), above the ceil(n/k) of the model."""
    n, size = len(modules), len(modules) // segments
    for j in range(segments):
        stop = n if j == segments - 1 else (j + 1) * size
        run = _run(modules[j * size:stop])
        x = run(x) if j == segments - 1 else checkpoint(run, x)
    return x


def seq_first_uncheckpointed(modules, segments, x):
    """Off by one: the first segment runs plainly, the others are checkpointed."""
    n, size = len(modules), len(modules) // segments
    for j in range(segments):
        stop = n if j == segments - 1 else (j + 1) * size
        run = _run(modules[j * size:stop])
        x = run(x) if j == 0 else checkpoint(run, x)
    return x


def seq_no_rng(modules, segments, x):
    """Right segments, but a checkpoint that does not preserve the RNG (dropout masks differ)."""
    n, size = len(modules), len(modules) // segments
    for j in range(segments):
        stop = n if j == segments - 1 else (j + 1) * size
        run = _run(modules[j * size:stop])
        x = run(x) if j == segments - 1 else torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False, preserve_rng_state=False)
    return x


# ----------------------------------------------------------------------------- 02.choose_segments
def _choose(n_layers, budget_bytes, layer_bytes, boundary_bytes, *, per=math.ceil, ks=None, strict=False, largest=False):
    ks = list(ks if ks is not None else range(1, n_layers + 1))
    if largest:
        ks = ks[::-1]
    for k in ks:
        need = k * boundary_bytes + per(n_layers / k) * layer_bytes
        if (need < budget_bytes) if strict else (need <= budget_bytes):
            return k
    raise ValueError("no k fits")


def choose_floor(n, b, l, bd):
    return _choose(n, b, l, bd, per=math.floor)


def choose_excludes_n(n, b, l, bd):
    return _choose(n, b, l, bd, ks=range(1, n))


def choose_strict(n, b, l, bd):
    return _choose(n, b, l, bd, strict=True)


def choose_largest(n, b, l, bd):
    return _choose(n, b, l, bd, largest=True)


def choose_sqrt_always(n, b, l, bd):
    """Ignores the budget: sqrt(n) segments, the memory-optimal k of the lecture."""
    return max(1, round(math.sqrt(n)))


def choose_returns_none(n, b, l, bd):
    try:
        return _choose(n, b, l, bd)
    except ValueError:
        return None


MUTANTS = {
    "02.count_saved": [
        ("no storage dedup", count_no_dedup),
        ("weights counted as activations", count_with_weights),
        ("bytes of views, not storages", count_view_bytes),
        ("keyed on the tensor object", count_by_tensor_id),
    ],
    "02.checkpoint_function": [
        ("no RNG replay", ckpt_no_replay),
        ("keeps the graph (saves nothing)", ckpt_keeps_graph),
        ("no gradient for the input", ckpt_no_input_grad),
        ("a plain call, no Function", ckpt_plain_call),
        ("parameters get no gradient", ckpt_params_lost),
    ],
    "02.rng_replay": [
        ("state not restored after replay", SnapshotNoRestore),
        ("state not restored when the body raises", SnapshotNoFinally),
        ("snapshot taken at replay time", SnapshotAtReplay),
        ("a fixed seed instead of the state", SnapshotFixedSeed),
    ],
    "02.checkpoint_sequential": [
        ("one checkpoint around all but the last layer (ignores k)", seq_all_but_last),
        ("the last segment checkpointed too", seq_last_checkpointed_too),
        ("segments of ceil(n/k) layers", seq_ceil_split),
        ("torch's split: the remainder all in the last segment", seq_torch_split),
        ("first segment plain, last checkpointed", seq_first_uncheckpointed),
        ("checkpoint without RNG preservation", seq_no_rng),
    ],
    "02.choose_segments": [
        ("floor(n/k) layers per segment", choose_floor),
        ("k = n never tried", choose_excludes_n),
        ("strict < budget", choose_strict),
        ("the largest k that fits", choose_largest),
        ("None instead of ValueError", choose_returns_none),
        ("sqrt(n), whatever the budget", choose_sqrt_always),
    ],
}


# ----------------------------------------------------------------------------- 02.predict_ckpt_peak
def _peak(config, b, s, k, *, layers=math.ceil, boundaries=True, working=True, masks=4, act=4):
    from memlab.accounting import activation_bytes_per_layer

    h, a, r = config.n_embd, config.n_head, config.mlp_ratio
    layer = activation_bytes_per_layer(s, b, h, a, act_bytes=act, mask_bytes=masks, layernorm_stats_bytes=4)
    out = layers(config.n_layer / k) * layer
    if boundaries:
        out += (k - 1) * 4 * b * s * h
    if working:
        out += r * h * b * s * 4 + r * h * h * 4
    return out


def peak_ignores_k(config, b, s, k):
    """Every layer's activations, as without checkpointing."""
    return _peak(config, b, s, 1)


def peak_floor_layers(config, b, s, k):
    """floor(n/k) layers in the recomputed segment: the longer segments come first."""
    return _peak(config, b, s, k, layers=math.floor)


def peak_fractional_layers(config, b, s, k):
    """n/k layers, a fraction: a segment holds whole layers."""
    return _peak(config, b, s, k, layers=lambda x: x)


def peak_no_boundaries(config, b, s, k):
    """Forgets the checkpoint inputs kept through the whole step."""
    return _peak(config, b, s, k, boundaries=False)


def peak_lecture_model_only(config, b, s, k):
    """k * boundary + ceil(n/k) * layer and nothing else: no backward working set."""
    return _peak(config, b, s, k, working=False) + 4 * b * s * config.n_embd


def peak_bool_masks(config, b, s, k):
    """1-byte dropout masks, as on CUDA: on the CPU they are 4-byte floats."""
    return _peak(config, b, s, k, masks=1)


def peak_no_masks(config, b, s, k):
    """The dropout-0 formula although dropout is on."""
    return _peak(config, b, s, k, masks=0)


def peak_16bit(config, b, s, k):
    """Korthikanti's 16-bit activations for an fp32 run."""
    return _peak(config, b, s, k, masks=1, act=2)


MUTANTS["02.predict_ckpt_peak"] = [
    ("ignores k (no checkpointing)", peak_ignores_k),
    ("floor(n/k) layers recomputed", peak_floor_layers),
    ("n/k layers, a fraction", peak_fractional_layers),
    ("checkpoint inputs forgotten", peak_no_boundaries),
    ("no backward working set", peak_lecture_model_only),
    ("1-byte dropout masks", peak_bool_masks),
    ("no dropout masks", peak_no_masks),
    ("16-bit activations", peak_16bit),
]
