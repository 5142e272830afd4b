"""Recomputation: the non-reentrant checkpoint built on ``saved_tensors_hooks``, selective
recomputation with a policy over ATen ops (Korthikanti et al. 2022, arXiv:2205.05198), and the older
reentrant design as a custom ``autograd.Function``.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


__all__ = ["checkpoint", "checkpoint_reentrant", "selective_checkpoint", "MATMUL_OPS", "RNGState"]
# tensor_leaves and check_callable are also used by layers and offload

aten = torch.ops.aten

#: ATen ops whose outputs :func:`selective_checkpoint` keeps by default (the FLOP-heavy ones).
MATMUL_OPS: frozenset = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})


# ----------------------------------------------------------------------------- small helpers
def tensor_leaves(args: Iterable[Any], kwargs: dict[str, Any] | None = None) -> list[torch.Tensor]:
    """The tensors among ``args`` and ``kwargs``, nested containers flattened (torch's pytree)."""
    leaves, _ = tree_flatten((tuple(args), kwargs or {}))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def check_callable(where: str, fn: Any) -> None:
    """Raise ValueError, prefixed with ``where``, when ``fn`` is not callable."""
    if not callable(fn):
        raise ValueError(f"{where}: fn={fn!r} must be callable (a module or a function)")


def _cuda_devices(fn: Any, tensors: Sequence[torch.Tensor]) -> list[int]:
    # CUDA device indices of the inputs (and of fn's parameters when fn is a module)
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
        """Run the ``with`` block under the captured RNG states; the states from before come back after."""
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
    # forward: remember the output of every op in ``ops`` (in call order)

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
    # recompute: hand back the remembered output instead of running the op again

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
    check_callable(where, fn)
    if not torch.is_grad_enabled():  # nothing will be saved: just run it
        return fn(*args, **kwargs)
    tensors = tensor_leaves(args, kwargs)
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

    Raises:
        ValueError: ``fn`` is not callable.
        RuntimeError: the recomputation did not run the same operations.
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

    Args:
        keep_ops: the ATen ops (overload packets) whose outputs are kept.

    Raises:
        ValueError: ``fn`` is not callable, or ``keep_ops`` is empty.
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
        ctx.rng = RNGState(_cuda_devices(fn, tensor_leaves(args))) if preserve_rng_state else None
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

    Raises:
        ValueError: ``fn`` is not callable.
    """
    check_callable("checkpoint_reentrant", fn)
    if not torch.is_grad_enabled():
        return fn(*args)
    return _ReentrantCheckpoint.apply(fn, preserve_rng_state, *args)

