"""Gradient checkpointing from scratch: trade compute for activation memory.

Autograd keeps, for every layer, the tensors its backward needs (the layer's *activations*).
Checkpointing keeps only a few of them and recomputes the rest during backward.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (arXiv:1604.06174): split a
chain of ``n`` layers into ``k`` segments and keep only each segment's input (a *boundary*).
In backward, one segment at a time is recomputed with autograd on. The activation peak is

    k * boundary  +  ceil(n / k) * layer        (= n/k + k layer units when boundary = layer)

which is smallest near ``k = sqrt(n)`` (``2 * sqrt(n)`` units instead of ``n``), for the price of
about one extra forward pass.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198): *selective* recomputation keeps the outputs of the expensive operations and
recomputes only the cheap ones; :func:`selective_checkpoint` does that with a policy over ATen ops
(default: keep matmul outputs, recompute elementwise ops, softmax and dropout).

What is here:

* :func:`checkpoint` -- non-reentrant checkpoint built on ``saved_tensors_hooks``: the forward
  stores a small handle instead of each saved tensor; the first handle unpacked in backward
  recomputes ``fn`` (with the CPU / CUDA RNG state and autocast state of the forward replayed) and
  hands out the recomputed tensors one by one, freeing each as it goes.
* :func:`checkpoint_reentrant` -- the older design, a custom ``autograd.Function`` whose backward
  re-runs ``fn`` and calls ``torch.autograd.backward`` inside it (and its LoRA pitfall: when no
  input requires grad, the parameters inside ``fn`` get no gradient).
* :func:`checkpoint_sequential`, :func:`sqrt_segments`, :func:`activation_memory_model`,
  :func:`segments_for_budget` -- segments and the memory model above.
* :func:`selective_checkpoint` and :data:`MATMUL_OPS` -- selective recomputation.
* :func:`offload_activations` -- saved tensors moved to (pinned) host memory in forward and back
  in backward, compare ``torch.autograd.graph.save_on_cpu``.
* :func:`saved_activation_bytes` (from :mod:`memlab.accounting`) and :func:`count_saved_tensors`.
"""
from __future__ import annotations

import math
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memlab.accounting import saved_activation_bytes, saved_storages

__all__ = [
    "checkpoint",
    "checkpoint_reentrant",
    "checkpoint_sequential",
    "selective_checkpoint",
    "MATMUL_OPS",
    "RNGState",
    "sqrt_segments",
    "activation_memory_model",
    "segments_for_budget",
    "split_segments",
    "offload_activations",
    "OffloadStats",
    "saved_activation_bytes",
    "count_saved_tensors",
]

aten = torch.ops.aten

#: ATen ops whose outputs :func:`selective_checkpoint` keeps by default (the FLOP-heavy ones).
MATMUL_OPS: frozenset = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})


# ----------------------------------------------------------------------------- small helpers
def _tensors(args: Iterable[Any], kwargs: dict[str, Any] | None = None) -> list[torch.Tensor]:
    leaves, _ = tree_flatten((tuple(args), kwargs or {}))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _check_callable(where: str, fn: Any) -> None:
    if not callable(fn):
        raise ValueError(f"{where}: fn={fn!r} must be callable (a module or a function)")


def _cuda_devices(fn: Any, tensors: Sequence[torch.Tensor]) -> list[int]:
    """CUDA device indices of the inputs (and of fn's parameters when fn is a module)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    devs = {t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in tensors if t.device.type == "cuda"}
    if isinstance(fn, nn.Module):
        for p in fn.parameters():
            if p.device.type == "cuda":
                devs.add(p.device.index)
                break
    return sorted(devs)


class RNGState:
    """A snapshot of the CPU RNG state and of the given CUDA devices' RNG states.

    ``with snapshot.replay(): ...`` runs the body with the RNG exactly as it was when the snapshot
    was taken, then puts back the state it found, so code after the block draws the same numbers
    as if the block had never run. This is what makes dropout recompute the same mask.
    """

    def __init__(self, cuda_devices: Iterable[int] = ()) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = {int(d): torch.cuda.get_rng_state(int(d)) for d in cuda_devices}

    @contextmanager
    def replay(self) -> Iterator[None]:
        cpu_now = torch.get_rng_state()
        cuda_now = {d: torch.cuda.get_rng_state(d) for d in self.cuda}
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda.items():
            torch.cuda.set_rng_state(state, d)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            for d, state in cuda_now.items():
                torch.cuda.set_rng_state(state, d)


def _autocast_state(device_types: Iterable[str]) -> dict[str, tuple[bool, torch.dtype]]:
    kinds = {"cpu"} | ({"cuda"} & set(device_types))
    return {dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in kinds}


@contextmanager
def _replay_autocast(state: dict[str, tuple[bool, torch.dtype]]) -> Iterator[None]:
    ctxs = [torch.autocast(dt, dtype=dtype, enabled=on) for dt, (on, dtype) in state.items()]
    for c in ctxs:
        c.__enter__()
    try:
        yield
    finally:
        for c in reversed(ctxs):
            c.__exit__(None, None, None)


# ----------------------------------------------------------------------------- selective policy
class _KeepOutputs(TorchDispatchMode):
    """Forward: remember the output of every op in ``ops`` (in call order)."""

    def __init__(self, ops: frozenset, store: list) -> None:
        super().__init__()
        self.ops, self.store = ops, store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.ops and isinstance(out, torch.Tensor):
            kept = out.detach()  # no autograd metadata: holding it does not hold the graph
            self.store.append((kept, kept._version))
        return out


class _ReuseOutputs(TorchDispatchMode):
    """Recompute: hand back the remembered output instead of running the op again."""

    def __init__(self, ops: frozenset, store: list) -> None:
        super().__init__()
        self.ops, self.store, self.i = ops, store, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.ops:
            i, self.i = self.i, self.i + 1
            entry = self.store[i] if i < len(self.store) else None
            if entry is not None:
                self.store[i] = None  # used once: let it go as soon as backward is done with it
                kept, version = entry
                if kept._version == version:  # not modified in place since: safe to reuse
                    return kept
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- checkpoint
class _Handle:
    """What autograd stores instead of a saved tensor: an index and the tensor's metadata.

    Handles are weakly referenced by their frame: when autograd releases a saved tensor it never
    unpacked (e.g. the input of a frozen Linear), the handle dies and so does its recomputed copy.
    """

    __slots__ = ("index", "shape", "dtype", "device", "__weakref__")

    def __init__(self, index: int, t: torch.Tensor) -> None:
        self.index, self.shape, self.dtype, self.device = index, tuple(t.shape), t.dtype, t.device


@dataclass
class _Frame:
    """Everything one checkpointed call needs to recompute itself in backward."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    rng: RNGState | None
    autocast: dict
    keep_ops: frozenset | None = None
    kept: list = field(default_factory=list)
    handles: list = field(default_factory=list)  # weakrefs to the handles, in save order
    recomputed: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def pack(self, t: torch.Tensor) -> _Handle:
        h = _Handle(len(self.handles), t)
        self.handles.append(weakref.ref(h))
        return h

    def unpack(self, h: _Handle) -> torch.Tensor:
        if h not in self.recomputed:  # first unpack of this backward: recompute fn
            self.recompute()
        t = self.recomputed.pop(h)  # pop: each recomputed tensor lives only until used
        if (tuple(t.shape), t.dtype, t.device) != (h.shape, h.dtype, h.device):
            raise RuntimeError(
                f"checkpoint: saved tensor #{h.index} was {h.shape} {h.dtype} on {h.device} in forward "
                f"but {tuple(t.shape)} {t.dtype} on {t.device} when recomputed; fn must compute the "
                f"same thing twice (no data-dependent control flow on state that changed in between)"
            )
        return t

    def recompute(self) -> None:
        n_saved = 0

        def pack(t: torch.Tensor) -> None:
            nonlocal n_saved
            i, n_saved = n_saved, n_saved + 1
            h = self.handles[i]() if i < len(self.handles) else None
            if h is not None:  # still wanted by the graph: keep the recomputed tensor for it
                self.recomputed[h] = t.detach()

        def unpack(_: None) -> torch.Tensor:  # the recomputed graph is never backpropagated
            raise RuntimeError("checkpoint: the recomputed graph cannot be differentiated")

        rng = self.rng.replay() if self.rng is not None else nullcontext()
        reuse = _ReuseOutputs(self.keep_ops, self.kept) if self.keep_ops else nullcontext()
        with rng, torch.enable_grad(), _replay_autocast(self.autocast), \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack), reuse:
            self.fn(*self.args, **self.kwargs)
        if n_saved != len(self.handles):
            raise RuntimeError(
                f"checkpoint: recomputing fn saved {n_saved} tensors for backward but the forward "
                f"saved {len(self.handles)}; fn must run the same operations both times"
            )


def _checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict, preserve_rng_state: bool,
                keep_ops: frozenset | None, where: str) -> Any:
    _check_callable(where, fn)
    if not torch.is_grad_enabled():  # nothing will be saved: just run it
        return fn(*args, **kwargs)
    tensors = _tensors(args, kwargs)
    rng = RNGState(_cuda_devices(fn, tensors)) if preserve_rng_state else None
    frame = _Frame(fn, args, kwargs, rng, _autocast_state(t.device.type for t in tensors), keep_ops)
    keep = _KeepOutputs(keep_ops, frame.kept) if keep_ops else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), keep:
        return fn(*args, **kwargs)


def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping none of its activations; they are recomputed in backward.

    Non-reentrant (the design of ``torch.utils.checkpoint(..., use_reentrant=False)``, written
    here from scratch with ``torch.autograd.graph.saved_tensors_hooks``): the forward runs with
    autograd on, but each tensor autograd wants to save is replaced by a small handle. The first
    handle unpacked in backward re-runs ``fn`` with the RNG state of the forward
    (``preserve_rng_state=True``: CPU, plus the CUDA devices of the inputs and of ``fn``'s
    parameters) and the same autocast state, collects the tensors the re-run saves, in the same
    order, and returns them one by one (each is released once used).

    Because the graph is the ordinary autograd graph, it works when no input requires grad but
    parameters inside ``fn`` do (a frozen base model under LoRA), with keyword arguments,
    non-tensor arguments, nested containers and tuple outputs. Under ``torch.no_grad()`` it
    simply runs ``fn``. What stays in memory is ``args`` (the segment's boundary) and ``fn``.
    """
    return _checkpoint(fn, args, kwargs, preserve_rng_state, None, "checkpoint")


def selective_checkpoint(fn: Callable[..., Any], *args: Any, keep_ops: Iterable[Any] = MATMUL_OPS,
                         preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Selective recomputation: like :func:`checkpoint`, but the outputs of ``keep_ops`` are kept.

    In forward a ``TorchDispatchMode`` remembers the output of every ATen op in ``keep_ops``
    (default :data:`MATMUL_OPS`: mm, addmm, bmm, baddbmm -- where the FLOPs are); in the
    recomputation the same mode hands them back instead of running the op, so only the cheap
    ops (elementwise, softmax, dropout, layer norm) run twice. Memory: the kept outputs, on top
    of the boundary. An output modified in place after it was kept is recomputed instead.
    """
    ops = frozenset(getattr(op, "overloadpacket", op) for op in keep_ops)
    if not ops:
        raise ValueError("selective_checkpoint: keep_ops is empty; pass ATen ops such as torch.ops.aten.mm, "
                         "or use checkpoint() to keep nothing")
    return _checkpoint(fn, args, kwargs, preserve_rng_state, ops, "selective_checkpoint")


# ----------------------------------------------------------------------------- reentrant design
class _ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, preserve_rng_state, *args):  # type: ignore[override]
        ctx.fn = fn
        ctx.rng = RNGState(_cuda_devices(fn, _tensors(args))) if preserve_rng_state else None
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        with torch.no_grad():  # nothing inside fn is recorded: no activations kept
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        saved = iter(ctx.saved_tensors)
        args = []
        for i, (other, is_tensor) in enumerate(zip(ctx.others, ctx.is_tensor)):
            if is_tensor:  # a fresh leaf; it needs grad only if the input did (+2: fn, rng flag)
                args.append(next(saved).detach().requires_grad_(bool(ctx.needs_input_grad[i + 2])))
            else:
                args.append(other)
        rng = ctx.rng.replay() if ctx.rng is not None else nullcontext()
        with rng, torch.enable_grad():
            out = ctx.fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if t and a.requires_grad else None for a, t in zip(args, ctx.is_tensor))


def checkpoint_reentrant(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """The reentrant design (``use_reentrant=True``): a custom ``torch.autograd.Function``.

    ``forward`` runs ``fn`` under ``no_grad`` and saves only the inputs; ``backward`` re-runs ``fn``
    with grad on and calls ``torch.autograd.backward`` on its outputs -- a backward inside the
    backward, which is why it is called reentrant. Parameters inside ``fn`` receive their ``.grad``
    from that inner backward.

    The pitfall: the output of an ``autograd.Function`` requires grad only if one of its *tensor
    inputs* does. With a frozen base (LoRA) the hidden states entering a block do not, so the
    output does not either: backward never reaches the block and its trainable parameters get no
    gradient (or ``loss.backward()`` fails with "element 0 of tensors does not require grad").
    Positional arguments only; no keyword arguments.
    """
    _check_callable("checkpoint_reentrant", fn)
    if not torch.is_grad_enabled():
        return fn(*args)
    return _ReentrantCheckpoint.apply(fn, preserve_rng_state, *args)


# ----------------------------------------------------------------------------- segments
def _check_layers(where: str, n_layers: Any) -> None:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"{where}: n_layers={n_layers!r} must be a positive int")


def _check_segments(where: str, segments: Any, n_layers: int) -> None:
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n_layers:
        raise ValueError(f"{where}: segments={segments!r} is invalid; allowed: an int from 1 to n_layers={n_layers}")


def split_segments(n_layers: int, segments: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``n_layers`` cut into ``segments`` contiguous runs whose sizes
    differ by at most one (the longer runs first)."""
    _check_layers("split_segments", n_layers)
    _check_segments("split_segments", segments, n_layers)
    base, extra = divmod(n_layers, segments)
    out, start = [], 0
    for i in range(segments):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def activation_memory_model(n_layers: int, segments: int, layer_bytes: float = 1.0,
                            boundary_bytes: float | None = None) -> float:
    """Activation peak of ``n_layers`` checkpointed in ``segments`` segments (Chen et al. 2016):

        segments * boundary_bytes + ceil(n_layers / segments) * layer_bytes

    The first term is the segment inputs kept through the whole step; the second is one segment's
    activations, recomputed in backward (the last segment's in forward, where it is not
    recomputed). In layer units (``boundary_bytes = layer_bytes = 1``, the default) this is
    ``n/k + k``, smallest at ``k = sqrt(n)``. In a transformer a boundary (the hidden state,
    ``e*s*b*h`` bytes) is much smaller than a layer's activations: pass both measured sizes.
    ``segments = 1`` is no checkpointing: the input plus every layer's activations.
    """
    _check_layers("activation_memory_model", n_layers)
    _check_segments("activation_memory_model", segments, n_layers)
    if layer_bytes < 0:
        raise ValueError(f"activation_memory_model: layer_bytes={layer_bytes!r} must be >= 0")
    boundary = layer_bytes if boundary_bytes is None else boundary_bytes
    if boundary < 0:
        raise ValueError(f"activation_memory_model: boundary_bytes={boundary_bytes!r} must be >= 0")
    return segments * boundary + math.ceil(n_layers / segments) * layer_bytes


def sqrt_segments(n_layers: int) -> int:
    """The segment count that minimises ``k + ceil(n/k)`` (Chen et al.'s sqrt(n) rule).

    For a perfect square this is exactly ``sqrt(n)``; among ties the one closest to ``sqrt(n)``.
    """
    _check_layers("sqrt_segments", n_layers)
    root = math.sqrt(n_layers)
    return min(range(1, n_layers + 1), key=lambda k: (k + math.ceil(n_layers / k), abs(k - root), k))


def segments_for_budget(n_layers: int, budget_bytes: float, layer_bytes: float,
                        boundary_bytes: float) -> int:
    """The fewest segments whose modelled activation peak fits ``budget_bytes``.

    Fewer segments means less recomputation (``n - ceil(n/k)``-ish layers rerun, growing with k),
    so the first ``k`` that fits is the cheapest. Raises ValueError when no ``k`` fits.
    """
    _check_layers("segments_for_budget", n_layers)
    if budget_bytes < 0 or layer_bytes < 0 or boundary_bytes < 0:
        raise ValueError(f"segments_for_budget: budget_bytes={budget_bytes!r}, layer_bytes={layer_bytes!r}, "
                         f"boundary_bytes={boundary_bytes!r} must all be >= 0")
    for k in range(1, n_layers + 1):
        if activation_memory_model(n_layers, k, layer_bytes, boundary_bytes) <= budget_bytes:
            return k
    best = min(activation_memory_model(n_layers, k, layer_bytes, boundary_bytes) for k in range(1, n_layers + 1))
    raise ValueError(f"segments_for_budget: budget_bytes={budget_bytes:,.0f} is below the smallest modelled peak "
                     f"{best:,.0f} bytes for n_layers={n_layers}; allowed: a budget >= {best:,.0f}")


def checkpoint_sequential(modules: Sequence[Callable[..., Any]] | nn.Sequential, segments: int, x: Any, *,
                          preserve_rng_state: bool = True,
                          checkpoint_fn: Callable[..., Any] | None = None) -> Any:
    """Run ``modules`` one after the other on ``x``, checkpointing ``segments`` contiguous segments.

    Segments come from :func:`split_segments`. As in ``torch.utils.checkpoint.checkpoint_sequential``
    the last segment runs without a checkpoint: backward needs its activations straight away, so
    recomputing it would cost time and save nothing. ``segments=1`` is therefore no checkpointing.
    ``checkpoint_fn(fn, x)`` defaults to :func:`checkpoint` (pass e.g. :func:`selective_checkpoint`).
    """
    mods = list(modules)
    if not mods:
        raise ValueError("checkpoint_sequential: modules is empty; allowed: a non-empty sequence of callables")
    for i, m in enumerate(mods):
        if not callable(m):
            raise ValueError(f"checkpoint_sequential: modules[{i}]={m!r} is not callable")
    _check_segments("checkpoint_sequential", segments, len(mods))
    if checkpoint_fn is None:
        def checkpoint_fn(f, inp):
            return checkpoint(f, inp, preserve_rng_state=preserve_rng_state)

    def run(chunk):
        def seg(inp):
            for m in chunk:
                inp = m(inp)
            return inp
        return seg

    bounds = split_segments(len(mods), segments)
    for j, (a, b) in enumerate(bounds):
        seg = run(mods[a:b])
        x = seg(x) if j == len(bounds) - 1 else checkpoint_fn(seg, x)
    return x


# ----------------------------------------------------------------------------- offloading
@dataclass
class OffloadStats:
    """What :func:`offload_activations` moved: tensors and bytes sent to host, kept in place."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    kept_tensors: int = 0


@contextmanager
def offload_activations(pin_memory: bool = True, min_bytes: int = 0, include_cpu: bool = False,
                        skip_parameters: bool = True) -> Iterator[OffloadStats]:
    """Saved tensors go to host memory in forward and come back in backward (pack / unpack hooks).

    Every tensor autograd saves inside the block is copied to a CPU tensor (page-locked when
    ``pin_memory`` and CUDA is available, so the copy can run asynchronously) and the device copy
    is dropped; backward copies it back to its device. Compared with
    ``torch.autograd.graph.save_on_cpu`` this version skips the model's state
    (``skip_parameters``: it lives on the device anyway, copying it is pure waste), tensors smaller
    than ``min_bytes``, and CPU tensors (nothing to gain) unless ``include_cpu`` (for teaching on a
    CPU-only machine: they are copied to a fresh host buffer). Yields an :class:`OffloadStats`.

    "The model's state" is decided by *storage*, not by type: a saved weight is often a view of a
    parameter (``addmm`` saves ``weight.t()``), and a buffer is a plain tensor. A saved tensor is
    kept in place when it is an ``nn.Parameter`` or a view of one, or when its storage is the
    storage of a parameter or buffer of a module called inside the block (a global module
    forward-pre-hook records those while the block runs).
    """
    if min_bytes < 0:
        raise ValueError(f"offload_activations: min_bytes={min_bytes!r} must be >= 0")
    stats = OffloadStats()
    pin = pin_memory and torch.cuda.is_available()
    state_storages: set[int] = set()                     # storages of the called modules' params and buffers

    def record_state(module: nn.Module, args: Any) -> None:
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            ptr = t.untyped_storage().data_ptr()
            if ptr:
                state_storages.add(ptr)

    def is_state(t: torch.Tensor) -> bool:
        return (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
                or t.untyped_storage().data_ptr() in state_storages)

    def pack(t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if ((skip_parameters and is_state(t)) or nbytes < min_bytes
                or (t.device.type == "cpu" and not include_cpu)):
            stats.kept_tensors += 1
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        stats.offloaded_tensors += 1
        stats.offloaded_bytes += nbytes
        return (t.device, host)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=pin)

    handle = nn.modules.module.register_module_forward_pre_hook(record_state) if skip_parameters else None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield stats
    finally:
        if handle is not None:
            handle.remove()


# ----------------------------------------------------------------------------- counting
def count_saved_tensors(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, int]:
    """``(storages, bytes)`` that one call ``fn(*args, **kwargs)`` saves for backward.

    Every tensor autograd saves passes through a ``saved_tensors_hooks`` pack hook. Views of one
    storage count once (``storages`` is the number of distinct storages); parameters and buffers of
    ``fn`` (when it is a module) are not activations and are left out. ``bytes`` equals
    :func:`saved_activation_bytes`.
    """
    _check_callable("count_saved_tensors", fn)
    with torch.enable_grad():
        seen = saved_storages(fn, *args, **kwargs)
    return len(seen), sum(seen.values())


# ----------------------------------------------------------------------------- predict, then measure
def _check_run_args(where: str, config: Any, batch_size: Any, seq_len: Any, segments: Any) -> None:
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {name}={v!r} must be a positive int")
    n_layer = getattr(config, "n_layer", None)
    if not isinstance(n_layer, int) or not hasattr(config, "n_embd"):
        raise ValueError(f"{where}: config={config!r} must be a memlab.models.TinyGPTConfig")
    if seq_len > config.block_size:
        raise ValueError(f"{where}: seq_len={seq_len} exceeds config.block_size={config.block_size}; "
                         f"allowed: 1 to {config.block_size}")
    _check_segments(where, segments, n_layer)


def sequential_activation_peak(config: Any, batch_size: int, seq_len: int, segments: int) -> int:
    """Predicted activation peak (bytes) of :func:`checkpoint_sequential` over TinyGPT's blocks.

    The run is the one :func:`measure_sequential_activation_peak` measures: ``config.n_layer``
    training-mode blocks (fp32 on the CPU, dropout on: masks are 4-byte floats there), an input
    ``x`` of shape ``(batch_size, seq_len, n_embd)`` made before the step (so not counted), cut into
    ``segments`` segments and run forward and backward. With ``n`` layers, ``k`` segments,
    ``B = 4*b*s*h`` (one hidden state), ``L`` the bytes one block saves (the per-layer formula of
    chapter 00 with 4-byte activations, 4-byte masks and fp32 LayerNorm statistics) and ``r`` the
    MLP ratio::

        (k - 1) * B                 the segment boundaries kept through the step (Chen et al. 2016)
      + ceil(n / k) * L             the longest segment's activations, alive again when recomputed
      + r*h*b*s*4 + r*h*h*4         the working set of that segment's top block in backward: the
                                    gradient of the MLP hidden and a fresh MLP weight gradient
                                    (an allocation of backward until autograd stores it in .grad)

    Within 2% of the measurement on the configurations chapter 02's lab checks.
    """
    from memlab.accounting import activation_bytes_per_layer

    _check_run_args("sequential_activation_peak", config, batch_size, seq_len, segments)
    n, k = config.n_layer, segments
    s, b, h, a, r = seq_len, batch_size, config.n_embd, config.n_head, config.mlp_ratio
    masks = 4 if config.dropout > 0 else 0
    layer = activation_bytes_per_layer(s, b, h, a, act_bytes=4, mask_bytes=masks, layernorm_stats_bytes=4)
    boundary = 4 * b * s * h
    working = r * h * b * s * 4 + r * h * h * 4
    return (k - 1) * boundary + math.ceil(n / k) * layer + working


class _Segments(nn.Module):
    """The blocks of a TinyGPT run by :func:`checkpoint_sequential` (a root module for the tracker)."""

    def __init__(self, blocks: nn.ModuleList, segments: int, checkpoint_fn: Callable[..., Any] | None) -> None:
        super().__init__()
        self.blocks, self.segments, self.checkpoint_fn = blocks, segments, checkpoint_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(list(self.blocks), self.segments, x, checkpoint_fn=self.checkpoint_fn)


def measure_sequential_activation_peak(config: Any, batch_size: int, seq_len: int, segments: int, *,
                                       checkpoint_fn: Callable[..., Any] | None = None, seed: int = 0) -> int:
    """Measured activation peak (bytes) of :func:`checkpoint_sequential` over TinyGPT's blocks.

    Builds ``TinyGPT(config)`` on the CPU (seed ``seed``), takes its blocks in training mode, makes
    ``x`` (``(batch_size, seq_len, n_embd)``, requires grad) and an output gradient, then runs
    ``checkpoint_sequential(blocks, segments, x)`` forward and backward inside a
    :class:`memlab.profiler.MemoryTracker`. Returns the largest number of bytes the tracker's
    ``activations`` category held (saved and recomputed activations, the gradients flowing back,
    boundaries); parameters and their accumulated ``.grad`` are not in it.
    """
    from memlab.models import TinyGPT
    from memlab.profiler import MemoryTracker

    _check_run_args("measure_sequential_activation_peak", config, batch_size, seq_len, segments)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        run = _Segments(TinyGPT(config).blocks, segments, checkpoint_fn).train()
        x = torch.randn(batch_size, seq_len, config.n_embd, requires_grad=True)
        grad = torch.randn(batch_size, seq_len, config.n_embd)
    with MemoryTracker(run) as tracker:
        run(x).backward(grad)
    return max(e.bytes["activations"] for e in tracker.timeline)


__all__ += ["sequential_activation_peak", "measure_sequential_activation_peak"]


# ----------------------------------------------------------------------------- a model's decoder layers
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")
_ENABLED = "_memlab_checkpoint_forward"  # the instance attribute enable() sets on each wrapped layer


def _cache_length(cache: Any) -> int:
    """Tokens a KV cache holds (0 for an empty one; a tuple-style cache counts its first tensor)."""
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        try:
            return int(get())
        except Exception:  # noqa: BLE001 -- an exotic cache: assume it holds something
            return 1
    if isinstance(cache, (tuple, list)):
        return sum(t.numel() for t in _tensors(cache))
    return 1


def _checkpointed_forward(layer: nn.Module, index: int, preserve_rng_state: bool, warned: list[bool]):
    forward = type(layer).forward.__get__(layer)  # transformers' own wrapper passes through when its flag is off

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # generation, evaluation: nothing to save, the cache works as usual
            return forward(*args, **kwargs)
        for name in _CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is None:
                continue
            if _cache_length(cache) > 0:
                raise ValueError(
                    f"memlab.checkpoint.enable: decoder layer {index} got {name}= a KV cache that already holds "
                    f"tokens; a checkpointed layer is run twice (forward, then again in backward) and would "
                    f"write it twice; allowed with gradients on: use_cache=False and no past_key_values"
                )
            kwargs[name] = None  # an empty cache would keep every layer's keys and values alive until the step ends
            if not warned[0]:
                warned[0] = True
                warnings.warn(
                    "memlab.checkpoint.enable: the model was called with use_cache=True while training; the KV "
                    "cache would keep every layer's keys and values alive (activations checkpointing cannot "
                    "free) and be written twice, so the checkpointed layers ignore it; call the model with "
                    "use_cache=False (or leave model.config.use_cache=False, as enable() set it)",
                    UserWarning, stacklevel=4)
        return checkpoint(forward, *args, preserve_rng_state=preserve_rng_state, **kwargs)

    return run


def enable(model: nn.Module, *, every: int = 1, preserve_rng_state: bool = True) -> list[int]:
    """Checkpoint ``model``'s decoder layers with memlab's :func:`checkpoint`, in place: the one call
    that puts this chapter's checkpointing on a transformers model (or a peft-wrapped one, or
    TinyGPT) in your own project.

    The layers are :func:`memlab.models.decoder_layers` (``model.model.layers`` for Llama, Mistral,
    Qwen; ``transformer.h`` for GPT-2; ...). Layers ``0, every, 2*every, ...`` get a ``forward`` that
    runs the layer's own forward under :func:`checkpoint` whenever gradients are on (under
    ``torch.no_grad()``, e.g. in ``generate``, the layer runs as before). With ``every=1`` each
    layer keeps only its input; with ``every=k`` one layer in k is checkpointed.

    What would keep activations alive anyway is handled:

    * ``model.config.use_cache`` is set to ``False``: in training, a KV cache holds every layer's
      keys and values until the step ends. A call with ``use_cache=True`` while gradients are on
      warns once and the checkpointed layers drop the (empty) cache; a cache that already holds
      tokens is an error (the layer runs twice and would write it twice).
    * transformers' own gradient checkpointing, when on, is turned off with a warning (each layer
      would otherwise be recomputed twice in backward).
    * ``config.output_attentions=True`` warns: the attention probabilities of every layer
      (batch x heads x seq x seq) are returned, so they stay alive.

    Calling it again replaces the previous wrapping (``every`` may change); :func:`disable` undoes
    it. Returns the indices of the checkpointed layers.
    """
    from memlab.models import decoder_layers

    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r} is invalid; allowed: an int >= 1 (1 checkpoints every decoder layer)")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state={preserve_rng_state!r} is invalid; allowed: True or False")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model, a peft model or TinyGPT), "
                        f"got {type(model).__name__}")
    layers = decoder_layers(model)
    # transformers >= 5.2x names it activation checkpointing; the gradient_* names are deprecated aliases
    hf_on = getattr(model, "is_activation_checkpointing", None)
    if hf_on is None:
        hf_on = getattr(model, "is_gradient_checkpointing", False)
    if hf_on is True or any(getattr(layer, "gradient_checkpointing", False) is True for layer in layers):
        disable_hf = getattr(model, "activation_checkpointing_disable", None) or getattr(
            model, "gradient_checkpointing_disable", None)
        if callable(disable_hf):
            disable_hf()
        for layer in layers:
            if getattr(layer, "gradient_checkpointing", False) is True:
                layer.gradient_checkpointing = False
        warnings.warn("memlab.checkpoint.enable: transformers' gradient checkpointing was on; turned it off "
                      "(each layer would have been recomputed twice in backward)", UserWarning, stacklevel=2)
    config = getattr(model, "config", None)
    if config is not None:
        if getattr(config, "use_cache", False):
            config.use_cache = False
        if getattr(config, "output_attentions", False):
            warnings.warn("memlab.checkpoint.enable: config.output_attentions=True returns every layer's "
                          "attention probabilities (batch x heads x seq x seq), which stay alive until the step "
                          "ends; set it to False while training", UserWarning, stacklevel=2)
    disable(model)
    warned = [False]
    chosen = []
    for i, layer in enumerate(layers):
        if i % every == 0:
            layer.forward = _checkpointed_forward(layer, i, preserve_rng_state, warned)
            setattr(layer, _ENABLED, True)
            chosen.append(i)
    return chosen


def disable(model: nn.Module) -> int:
    """Undo :func:`enable`: the decoder layers run their own forward again. Returns how many were
    unwrapped (``model.config.use_cache`` stays as :func:`enable` left it)."""
    from memlab.models import decoder_layers

    n = 0
    for layer in decoder_layers(model):
        if layer.__dict__.pop(_ENABLED, False):
            layer.__dict__.pop("forward", None)
            n += 1
    return n


__all__ += ["enable", "disable"]
