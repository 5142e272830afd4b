"""Plausible wrong answers to chapter 02's exercises; tests/course/test_mutants.py asserts each FAILS."""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from memlab.checkpoint import checkpoint
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # mutant_helpers, beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_helpers import counted_on_the_class as _counted_on_the_class  # noqa: E402
from mutant_helpers import memoised as _memoised  # noqa: E402


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


# ----------------------------------------------------------------------------- issue 24: new wrong answers
def _count_keyed(fn, args, key, nbytes=lambda t: t.untyped_storage().nbytes(), first=False):
    skip = {key(t) for t in list(fn.parameters()) + list(fn.buffers())} if isinstance(fn, nn.Module) else set()
    seen: dict = {}

    def pack(t):
        k = key(t)
        if k not in skip and not (first and k in seen):
            seen[k] = nbytes(t)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return len(seen), sum(seen.values())


def count_tensor_data_ptr(fn, *args):
    """Keys by the tensor's data_ptr() (offset included): a view at an offset is another storage."""
    return _count_keyed(fn, args, key=lambda t: (t.device, t.data_ptr()))


def count_reusable_address(fn, *args):
    """Keys by the storage's address without holding the storage: a freed address, reused, counts once."""
    return _count_keyed(fn, args, key=lambda t: (t.device, t.untyped_storage().data_ptr()))


def count_offset_to_end(fn, *args):
    """Keys by storage, but the first view seen counts from its offset to the storage's end."""
    return _count_keyed(fn, args, key=lambda t: (t.device, t.untyped_storage().data_ptr()), first=True,
                        nbytes=lambda t: t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())


class _NoOuterRestore(torch.autograd.Function):
    """Replays the forward's RNG state for the recomputation, never puts the outer state back."""
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
        torch.set_rng_state(ctx.rng)
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.autograd.backward(out, g)
        return None, x.grad


class _SavesOutput(torch.autograd.Function):
    """Right recomputation with RNG replay, but also saves fn's output 'for later'."""
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.rng = torch.get_rng_state()
        with torch.no_grad():
            out = fn(x)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, g):
        x, _ = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                out = ctx.fn(x)
        torch.autograd.backward(out, g)
        return None, x.grad


class _ReseedAfter(torch.autograd.Function):
    """Replays, then 'restores' the outer RNG by re-seeding with torch.initial_seed()."""
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
        torch.set_rng_state(ctx.rng)
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.manual_seed(torch.initial_seed())
        torch.autograd.backward(out, g)
        return None, x.grad


def ckpt_no_outer_restore(fn, x):
    return _NoOuterRestore.apply(fn, x)


def ckpt_saves_output(fn, x):
    return _SavesOutput.apply(fn, x)


def ckpt_reseeds_after(fn, x):
    return _ReseedAfter.apply(fn, x)


class SnapshotOneUse:
    """Frees its state after the first replay (a checkpoint replays once, doesn't it?)."""
    def __init__(self):
        self.state = torch.get_rng_state()

    @contextmanager
    def replay(self):
        now = torch.get_rng_state()
        state = self.__dict__.pop("state", None)
        if state is not None:
            torch.set_rng_state(state)
        try:
            yield
        finally:
            torch.set_rng_state(now)


class SnapshotAdvances:
    """Keeps a generator that the replays advance: the second replay continues the first."""
    def __init__(self):
        self.gen = torch.Generator()
        self.gen.set_state(torch.get_rng_state())

    @contextmanager
    def replay(self):
        now = torch.get_rng_state()
        torch.set_rng_state(self.gen.get_state())
        try:
            yield
        finally:
            self.gen.set_state(torch.get_rng_state())
            torch.set_rng_state(now)


class SnapshotRestoresOnce:
    """Puts the outer state back only after the first replay."""
    def __init__(self):
        self.state = torch.get_rng_state()
        self.replays = 0

    @contextmanager
    def replay(self):
        now = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.replays += 1
            if self.replays == 1:
                torch.set_rng_state(now)


def _split_run(modules, segments, x, ckpt):
    from memlab.checkpoint import split_segments

    bounds = split_segments(len(modules), segments)
    for j, (a, b) in enumerate(bounds):
        run = _run(modules[a:b])
        x = run(x) if j == len(bounds) - 1 else ckpt(run, x)
    return x


def seq_reentrant_torch(modules, segments, x):
    """The right split with torch's reentrant checkpoint (use_reentrant=True)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _split_run(modules, segments, x,
                          lambda f, t: torch.utils.checkpoint.checkpoint(f, t, use_reentrant=True))


def seq_memlab_reentrant(modules, segments, x):
    """The right split with memlab's autograd.Function checkpoint (the reentrant design)."""
    from memlab.checkpoint import checkpoint_reentrant

    return _split_run(modules, segments, x, checkpoint_reentrant)


def seq_keeps_all_activations(modules, segments, x):
    """Each segment recomputed in backward as it should, but its forward ran with grad on and kept
    every activation (memory the checkpoint exists to free)."""
    import memlab.checkpoint as mc

    kept = []
    bounds = mc.split_segments(len(modules), segments)
    for j, (a, b) in enumerate(bounds):
        chunk = modules[a:b]
        run = _run(chunk)
        if j == len(bounds) - 1:
            x = run(x)
        else:
            hooks = [m._forward_hooks.copy() for m in chunk]
            for m in chunk:
                m._forward_hooks.clear()
            with torch.random.fork_rng(devices=[]):
                with torch.enable_grad():
                    kept.append(run(x.detach().requires_grad_(True)))
            for m, h in zip(chunk, hooks):
                m._forward_hooks.update(h)
            x = checkpoint(run, x)
    seq_keeps_all_activations.kept = kept  # the kept graphs outlive the call, as a cache would
    return x


def choose_binary_search(n, b, l, bd):
    """Bisects k in [1, n], assuming that if k fits every larger k fits (the model is not monotone)."""
    lo, hi = 1, n
    need = lambda k: k * bd + math.ceil(n / k) * l  # noqa: E731
    if need(n) > b:
        raise ValueError("no k fits")
    while lo < hi:
        mid = (lo + hi) // 2
        if need(mid) <= b:
            hi = mid
        else:
            lo = mid + 1
    return lo


def choose_minimum_only(n, b, l, bd):
    """The k that minimises the modelled peak, if it fits (not the fewest segments that fit)."""
    need = lambda k: k * bd + math.ceil(n / k) * l  # noqa: E731
    k = min(range(1, n + 1), key=need)
    if need(k) > b:
        raise ValueError("no k fits")
    return k


def choose_numpy(n, b, l, bd):
    """Right k, as a numpy int."""
    import numpy as np

    return np.int64(_choose(n, b, l, bd))


MUTANTS["02.count_saved"] += [
    ("keyed by the tensor's data_ptr()", count_tensor_data_ptr),
    ("keyed by a freed storage's reusable address", count_reusable_address),
    ("a view counted from its offset to the end", count_offset_to_end),
]
MUTANTS["02.checkpoint_function"] += [
    ("outer RNG state never restored after backward", ckpt_no_outer_restore),
    ("saves the output too", ckpt_saves_output),
    ("outer RNG re-seeded after backward", ckpt_reseeds_after),
]
MUTANTS["02.rng_replay"] += [
    ("state freed after one replay", SnapshotOneUse),
    ("replays advance the snapshot", SnapshotAdvances),
    ("outer state restored after the first replay only", SnapshotRestoresOnce),
]
MUTANTS["02.checkpoint_sequential"] += [
    ("torch's use_reentrant=True checkpoint", seq_reentrant_torch),
    ("memlab's reentrant checkpoint", seq_memlab_reentrant),
    ("every activation kept while each segment is recomputed", seq_keeps_all_activations),
]
MUTANTS["02.choose_segments"] += [
    ("binary search over k", choose_binary_search),
    ("the k of the smallest peak", choose_minimum_only),
    ("a numpy int", choose_numpy),
]


def peak_k_boundaries(config, b, s, k):
    """k boundaries: the last segment's input counted as a kept checkpoint input too."""
    from memlab.checkpoint import sequential_activation_peak

    return sequential_activation_peak(config, b, s, k) + 4 * b * s * config.n_embd


def peak_k_minus_2_boundaries(config, b, s, k):
    """One boundary short: the first segment's input (made before the step) taken off twice."""
    from memlab.checkpoint import sequential_activation_peak

    return sequential_activation_peak(config, b, s, k) - 4 * b * s * config.n_embd


def peak_no_hidden_grad(config, b, s, k):
    """The working set without the gradient of the MLP hidden (only the fresh weight gradient)."""
    from memlab.checkpoint import sequential_activation_peak

    return sequential_activation_peak(config, b, s, k) - config.mlp_ratio * config.n_embd * b * s * 4


MUTANTS["02.predict_ckpt_peak"] += [
    ("k boundaries instead of k - 1", peak_k_boundaries),
    ("k - 2 boundaries", peak_k_minus_2_boundaries),
    ("no MLP-hidden gradient in the working set", peak_no_hidden_grad),
]


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
# hygiene (inputs changed, references kept, state on the class), constants tuned to the graded inputs, the input
# space not covered (dtypes, layouts, depths)
_KEPT: list = []


def count_keeps_saved_tensors(fn, *args):
    """Right count, but every saved tensor goes into a module-level list "to inspect later": kept alive."""
    def pack(t):
        _KEPT.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    from memlab.checkpoint import count_saved_tensors

    return count_saved_tensors(fn, *args)


def _count_elements(fn, args):
    seen: dict = {}
    skip = {p.untyped_storage().data_ptr() for p in list(fn.parameters()) + list(fn.buffers())} if isinstance(fn, nn.Module) else set()

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = 4 * (st.nbytes() // t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return len(seen), sum(seen.values())


def count_numel_bytes(fn, *args):
    """A storage's bytes as numel() x element_size() of the first tensor seen on it: right for a contiguous
    tensor, half the storage for every other element of a longer one."""
    seen: dict = {}
    skip = {p.untyped_storage().data_ptr() for p in list(fn.parameters()) + list(fn.buffers())} if isinstance(fn, nn.Module) else set()

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip and key not in seen:
            seen[key] = t.numel() * t.element_size() if t.storage_offset() == 0 else t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return len(seen), sum(seen.values())


class _Float32Recompute(torch.autograd.Function):
    """Recomputes on x.float() (every graded block is float32): a float64 block gets float32 gradients."""

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
        outer = torch.get_rng_state()
        torch.set_rng_state(ctx.rng)
        try:
            with torch.enable_grad():
                xd = x.detach().float().requires_grad_(True)
                out = ctx.fn.float()(xd) if isinstance(ctx.fn, nn.Module) else ctx.fn(xd)
                torch.autograd.backward(out, g.float())
        finally:
            torch.set_rng_state(outer)
        return None, xd.grad.to(x.dtype)


def ckpt_float32_recompute(fn, x):
    return _Float32Recompute.apply(fn, x)


_OUTPUTS: list = []


def ckpt_keeps_outputs(fn, x):
    """memlab's checkpoint, and each output kept in a list for a plot later: the graphs live on."""
    from memlab.checkpoint import checkpoint_reentrant

    out = checkpoint_reentrant(fn, x)
    _OUTPUTS.append(out)
    return out


class SnapshotOnTheClass:
    """The state saved on the class (one slot for every snapshot): a second snapshot overwrites the first's."""

    state = None

    def __init__(self):
        type(self).state = torch.get_rng_state()

    @contextmanager
    def replay(self):
        outer = torch.get_rng_state()
        torch.set_rng_state(type(self).state)
        try:
            yield
        finally:
            torch.set_rng_state(outer)


def seq_pops_the_callers_list(modules, segments, x):
    """Takes each segment off the caller's list with pop(0): right numbers, the caller's model emptied."""
    from memlab.checkpoint import split_segments

    bounds = split_segments(len(modules), segments)
    for j, (a, b) in enumerate(bounds):
        chunk = [modules.pop(0) for _ in range(b - a)]
        run = _run(chunk)
        x = run(x) if j == len(bounds) - 1 else checkpoint(run, x)
    return x


def seq_at_most_4_segments(modules, segments, x):
    """Caps k at 4 ("more segments never help": every graded k is at most 4)."""
    from memlab.checkpoint import checkpoint_sequential

    return checkpoint_sequential(modules, min(segments, 4), x)


def seq_float32_boundaries(modules, segments, x):
    """Keeps the segment inputs as float32 to save memory (every graded input is float32)."""
    from memlab.checkpoint import split_segments

    bounds = split_segments(len(modules), segments)
    dtype = x.dtype
    for j, (a, b) in enumerate(bounds):
        run = _run(modules[a:b])
        x = run(x) if j == len(bounds) - 1 else checkpoint(lambda h, run=run: run(h.to(dtype)), x.float())
    return x


def choose_k_up_to_32(n, b, l, bd):
    """Tries k = 1..32 only (the graded depths are at most 32)."""
    return _choose(n, b, l, bd, ks=range(1, min(n, 32) + 1))


def choose_int_budget(n, b, l, bd):
    """Truncates the budget to whole bytes first: a fractional modelled peak exactly at the budget no longer fits."""
    return _choose(n, int(b), l, bd)


MUTANTS["02.count_saved"] += [
    ("saved tensors kept in a module-level list", count_keeps_saved_tensors),
    ("4 bytes per element (float32 assumed)", lambda fn, *args: _count_elements(fn, args)),
    ("numel x element_size of the first view seen", count_numel_bytes),
]
MUTANTS["02.checkpoint_function"] += [
    ("recomputes in float32", ckpt_float32_recompute),
    ("outputs kept in a module-level list", ckpt_keeps_outputs),
]
MUTANTS["02.rng_replay"] += [
    ("the state on the class, shared by every snapshot", SnapshotOnTheClass),
]
MUTANTS["02.checkpoint_sequential"] += [
    ("segments popped off the caller's list", seq_pops_the_callers_list),
    ("at most 4 segments", seq_at_most_4_segments),
    ("float32 segment inputs", seq_float32_boundaries),
]
MUTANTS["02.choose_segments"] += [
    ("k tried up to 32 only", choose_k_up_to_32),
    ("budget truncated to an int", choose_int_budget),
]


# ----------------------------------------------------------------------------- issue 35: one mutant of each kind
# (tests/course/test_mutants.py: a hygiene mutant is caught by a hygiene probe, a constants or space mutant by the
# drawn cases with the hand-picked edges off)


def _ckpt_peak_block_size(config, batch_size, seq_len, segments):
    """The context length (config.block_size) taken for the sequence length."""
    from memlab.checkpoint import sequential_activation_peak

    return sequential_activation_peak(config, batch_size, config.block_size, segments)


def _choose_memo():
    from memlab.checkpoint import segments_for_budget

    return _memoised(segments_for_budget)


def _ckpt_peak_memo():
    from memlab.checkpoint import sequential_activation_peak

    return _memoised(sequential_activation_peak, key=lambda c, b, s, k: (c.n_layer, c.n_embd, b, s, k))


def _rng_counted():
    from memlab.checkpoint import RNGState

    return _counted_on_the_class(RNGState)


MUTANTS["02.rng_replay"] += [("snapshots counted on the class", _rng_counted())]
MUTANTS["02.choose_segments"] += [("memoised in a dict kept between calls", _choose_memo())]
MUTANTS["02.predict_ckpt_peak"] += [("memoised by shape in a dict kept between calls", _ckpt_peak_memo()),
                                    ("block_size taken as the sequence length", _ckpt_peak_block_size)]

KINDS = {
    "02.count_saved": {"hygiene": ["saved tensors kept in a module-level list"],
                       "constants": ["4 bytes per element (float32 assumed)"],
                       "space": ["weights counted as activations", "keyed by a freed storage's reusable address",
                                 "keyed by the tensor's data_ptr()"]},
    "02.checkpoint_function": {"hygiene": ["outputs kept in a module-level list"],
                               "space": ["recomputes in float32", "no RNG replay"]},
    "02.rng_replay": {"hygiene": ["snapshots counted on the class"], "constants": ["a fixed seed instead of the state"],
                      "space": ["state not restored when the body raises", "replays advance the snapshot"]},
    "02.checkpoint_sequential": {"hygiene": ["segments popped off the caller's list"], "constants": ["at most 4 segments"],
                                 "space": ["torch's split: the remainder all in the last segment"]},
    "02.choose_segments": {"hygiene": ["memoised in a dict kept between calls"], "constants": ["k tried up to 32 only"],
                           "space": ["budget truncated to an int", "binary search over k"]},
    "02.predict_ckpt_peak": {"hygiene": ["memoised by shape in a dict kept between calls"],
                             "constants": ["1-byte dropout masks"], "space": ["block_size taken as the sequence length"]},
}
NOT_APPLICABLE = {"02.checkpoint_function": {"constants": "the checkpoint takes a function and its inputs: it has no "
                                                          "size or setting of its own to tune"}}


# right answers written another way (the over-specific kind): each must PASS
def _sequential_torch_early_stop(modules, segments, x):
    """torch.utils.checkpoint (non-reentrant) per segment under early stop: each recomputation ends inside the
    segment's last layer, before that layer's forward hooks run."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    n = len(modules)
    base, extra = divmod(n, segments)
    sizes = [base + (i < extra) for i in range(segments)]
    start = 0
    with set_checkpoint_early_stop(True):
        for j, size in enumerate(sizes):
            def run(h, chunk=list(modules)[start:start + size]):
                for m in chunk:
                    h = m(h)
                return h
            start += size
            x = run(x) if j == segments - 1 else checkpoint(run, x, use_reentrant=False)
    return x


def _count_saved_by_address_holding(fn, *args):
    """Saved storages keyed by address, every one held until the count is done."""
    skip = set()
    if isinstance(fn, nn.Module):
        skip = {t.untyped_storage().data_ptr() for t in list(fn.parameters()) + list(fn.buffers())}
    held, sizes = [], {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            held.append(t)
            sizes[st.data_ptr()] = st.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return len(sizes), sum(sizes.values())


RIGHT_ANSWERS = {
    "02.checkpoint_sequential": [("torch's checkpoint with early stop", _sequential_torch_early_stop)],
    "02.count_saved": [("storages keyed by address, held while counting", _count_saved_by_address_holding)],
}
