"""A training-step memory profiler built from scratch: who holds the bytes, and when.

``MemoryTracker`` answers the course's one question -- how many bytes, where, and when -- on the
CPU you have, on the GPU you rent, and on fake tensors that allocate nothing. It is built from two
PyTorch mechanisms:

* a ``TorchDispatchMode`` (``torch.utils._python_dispatch``) sees every aten op that runs inside
  the ``with`` block, forward, backward (the autograd engine's ops too) and the optimizer step,
  and so every tensor those ops return;
* a weak reference to each tensor's *untyped storage* with a callback: the callback runs the
  moment the last tensor using that storage dies, so the tracker subtracts its bytes exactly when
  the memory is given back. Views and aliases share one storage, so each storage is counted once.

The live total after op ``k`` is ``sum(nbytes(s) for s in storages alive after op k)``; the peak is
the maximum of that total over all ops. Sizes follow a rounding policy (``block_bytes``: raw
``nbytes`` on CPU and meta, rounded up to the CUDA caching allocator's 512-byte block on CUDA).
A storage born before the ``with`` block is counted only if the model or the optimizer owns it:
an op that returns a view of any other old storage (a slice of a batch made before, say) costs
0 bytes, as it costs the allocator nothing. PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` counts the same way except there: it charges
such an old storage whole at the first view, so the two peaks agree to the byte when the step makes
its inputs inside the block, and differ by those old storages otherwise (``tests/test_profiler.py``).
Against the allocator's own events (``torch.profiler`` with ``profile_memory=True``, see
:func:`allocator_peak`) the tracker is exact on the same run, up to scalars no op returns
(``tests/test_ground_truth_steps.py``).

Categories, each storage in exactly one:

* ``parameters``: parameters and buffers of the model (and parameters of the optimizer);
* ``gradients``: ``.grad`` of those parameters (re-labelled when autograd accumulates them);
* ``optimizer``: tensors in ``optimizer.state``; during ``optimizer.step`` every new storage is
  labelled ``optimizer`` (the state appears there, next to the step's temporaries), and after
  the step whatever is still alive outside ``optimizer.state`` is moved to ``other``;
* ``activations``: anything else allocated while the model's forward or the backward runs
  (saved activations, their gradients, recomputed activations under checkpointing);
* ``other``: the rest (ops outside forward, backward and the optimizer step, such as input
  batches moved to the device).

Phases: ``forward`` while the model's ``forward`` runs (a forward pre/post hook on the root
module), ``backward`` while the autograd engine runs (``torch._C._current_graph_task_id() != -1``
when an op is dispatched: robust whether you call ``loss.backward()``, ``torch.autograd.grad`` or
a checkpoint recomputes inside backward), ``optimizer`` while ``Optimizer.step`` runs (the global
optimizer step pre/post hooks), ``other`` otherwise.

Module attribution: forward pre/post hooks push and pop each submodule; in backward, the module
whose output gradient arrived last (``torch.autograd.graph.register_multi_grad_hook(mode="any")``
on each module's outputs) is "running", together with its parents, until the next one starts or
backward ends. Backward attribution is therefore by output-gradient arrival, which is exact for
sequential models and approximate where modules interleave.

Limits: tensors created outside the ``with`` block are counted only if they belong to the model
or the optimizer (a buffer an optimizer keeps outside ``optimizer.state`` is not); ops that bypass
the dispatcher (``no_dispatch``, C++ extensions calling the allocator directly, cuBLAS workspaces,
scratch a kernel allocates inside itself, the 8-byte tensor C++ makes of a Python number) are
invisible; wrapper tensor subclasses are counted through whatever plain tensors their ops return.
And watching changes the run a little: under any Python dispatch mode autograd adds the gradients
of a tensor used several times out of place (a new buffer each time) where an unwatched run adds
in place, so a step that slices one tensor many times (chunked attention) peaks higher tracked
than untracked; the tracker is exact for the run it watches.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.accounting import format_bytes

__all__ = [
    "CATEGORIES",
    "PHASES",
    "MemoryTracker",
    "Event",
    "LiveStorage",
    "CUDA_BLOCK_BYTES",
    "allocator_bytes",
    "allocator_peak",
    "LiveBytes",
    "categorize",
    "phase_peaks",
    "kernel_scratch_at_peak",
    "format_bytes",
    "fake_activation_bytes",
    "train_losses",
]

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations", "other")
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "other")
BREAKDOWN_AT: tuple[str, ...] = ("peak", "end")

_P, _G, _O, _A, _X = range(5)
_FWD, _BWD, _OPT, _OTH = range(4)
#: The CUDA caching allocator rounds every block up to a multiple of this (``kMinBlockSize`` in
#: PyTorch's ``c10/cuda/CUDACachingAllocator.cpp``); the CPU allocator gives what was asked.
CUDA_BLOCK_BYTES = 512
#: The rounding policy a :class:`MemoryTracker` uses unless given another: device type -> block.
DEFAULT_BLOCK_BYTES: Mapping[str, int] = {"cuda": CUDA_BLOCK_BYTES}

_graph_task_id = torch._C._current_graph_task_id


def allocator_bytes(nbytes: int, device: str | torch.device,
                    block_bytes: Mapping[str, int] | None = None) -> int:
    """Bytes the allocator of ``device`` takes for a request of ``nbytes``: rounded up to a
    multiple of ``block_bytes[device type]`` (default :data:`DEFAULT_BLOCK_BYTES`: CUDA's 512-byte
    blocks), as asked on any other device.

    >>> allocator_bytes(100, "cuda"), allocator_bytes(100, "cpu"), allocator_bytes(0, "cuda")
    (512, 100, 0)
    """
    dev = device if isinstance(device, str) else device.type
    block = (DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes).get(dev.split(":")[0], 1)
    return -(-nbytes // block) * block if block > 1 else nbytes


class LiveStorage(NamedTuple):
    """A storage the tracker holds now (see :meth:`MemoryTracker.live_storages`).

    ``key`` is the storage's ``untyped_storage()._cdata`` (shared by every view), ``nbytes`` the
    bytes the tracker charges for it (the allocator's size, minus what the storage already held
    when the tracker first met it as a view of memory allocated before tracking), ``category``
    one of :data:`CATEGORIES`.
    """

    key: int
    storage: torch.UntypedStorage
    nbytes: int
    category: str


class _Entry:
    """One live storage: charged bytes, category index, weak reference, its block, and ``base``,
    the allocator bytes it held before the tracker met it (never charged)."""

    __slots__ = ("nbytes", "cat", "ref", "block", "base")

    def __init__(self, nbytes: int, cat: int, ref: weakref.ref, block: int, base: int) -> None:
        self.nbytes, self.cat, self.ref, self.block, self.base = nbytes, cat, ref, block, base


_MUTATES: dict[Any, bool] = {}
# ops that alias an input born outside the dispatcher an instant before, inside the block:
# ``torch.tensor(...)`` builds its tensor in C++ and hands it to ``lift_fresh``, so the storage
# is new even though the op returns an alias of its input
_FRESH_ALIAS_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in ("lift_fresh", "lift") if hasattr(torch.ops.aten, name))
FRESH_ALIAS_OPS = _FRESH_ALIAS_OPS  # public: memlab.timeline applies the same rule


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer holds: those in ``optimizer.state``, plus what it returns from an
    ``extra_state_tensors()`` method, for buffers it keeps outside ``state`` (memlab.offload's
    OffloadedAdamW: its host gradient slots and pinned staging). Counted as ``optimizer``."""
    out = [t for st in optimizer.state.values() for t in _tensors_in(st)]
    extra = getattr(optimizer, "extra_state_tensors", None)
    if callable(extra):
        out += [t for t in extra() if isinstance(t, torch.Tensor)]
    return out


def _mutates(func: Any) -> bool:
    """Whether an op writes into one of its arguments (in place or ``out=``): such an op can resize
    a storage that the tracker has not met yet, so its size is read before the op runs."""
    m = _MUTATES.get(func)
    if m is None:
        try:
            m = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        except AttributeError:  # not an OpOverload: assume it may
            m = True
        _MUTATES[func] = m
    return m


def _flat_tensors(obj: Any, out: list, depth: int = 0) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for o in obj:
            _flat_tensors(o, out, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            _flat_tensors(o, out, depth + 1)
    return out


class Event(NamedTuple):
    """One point of the timeline: the state after dispatched op number ``index``."""

    index: int
    phase: str
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass(frozen=True)
class _Peak:
    total: int
    counts: tuple[int, ...]
    event: int
    phase: str
    module: str | None


def _tensors_in(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """Tensors in an op's or a module's output (tensor, tuple/list, dict-like, shallow)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3:
        if isinstance(obj, (tuple, list)):
            for o in obj:
                yield from _tensors_in(o, depth + 1)
        elif isinstance(obj, dict):
            for o in obj.values():
                yield from _tensors_in(o, depth + 1)


class MemoryTracker(TorchDispatchMode):
    """Track every tensor storage of one or more training steps, by category, phase and module.

    Usage::

        tracker = MemoryTracker(model, optimizer)
        with tracker:
            loss = model(x, y)[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        tracker.peak_bytes, tracker.breakdown("peak"), tracker.timeline, tracker.report()

    On fake tensors, build the model, optimizer and batch under a ``FakeTensorMode`` and run the
    step with both modes active (either nesting order gives the same bytes). One tracker may be
    entered several times (one step each, or several steps in one block); its counts carry on.

    Memory allocated before the block is charged only when the model or the optimizer owns it
    (parameters, buffers, gradients, optimizer state). A view of any other storage born before
    the block (a slice, ``t()``, ``view``, ``expand``, ``detach``, the tensor an in-place op
    returns) costs 0 bytes, as it costs the allocator nothing; if such a storage grows (an
    ``out=`` or in-place op that resizes it, ``UntypedStorage.resize_`` with ``resizes``), the
    growth is charged.

    Args:
        model: its parameters and buffers (and their ``.grad``) are counted from ``__enter__``;
            its forward defines the ``forward`` phase and its submodules the per-module peaks.
        optimizer: its ``state`` tensors are counted from ``__enter__`` and after every ``step``.
        device: count only storages on this device type (``"cuda"``, ``"cpu"``, ``"meta"``; for
            fake tensors their fake device); ``None`` counts all.
        timeline: record the timeline (cheap; turn off for the lowest overhead).
        block_bytes: the rounding policy, device type -> the allocator's block size (every
            storage is charged its size rounded up to a multiple of it); default
            :data:`DEFAULT_BLOCK_BYTES` (CUDA's 512-byte blocks, other devices as asked).
        resizes: also count storage resizes that no op returns (FSDP2 frees and regrows an
            unsharded parameter with ``UntypedStorage.resize_``): ``resize_`` is watched inside the
            block and every live storage's size re-read after each op (slower).

    Extending it (subclasses use these, never the private state): :meth:`after_op` (a hook run
    after every op, before the peak and the timeline take the new total), :meth:`counted_tensor`
    (which tensor's storage holds a wrapper tensor's bytes), :meth:`sync_sizes` (re-read storage
    sizes now), :meth:`allocated_bytes` (the rounding policy), :meth:`live_storages`,
    :attr:`current_bytes` and :meth:`add_transient`.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: str | torch.device | None = None,
        timeline: bool = True,
        block_bytes: Mapping[str, int] | None = None,
        resizes: bool = False,
    ) -> None:
        super().__init__()
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if block_bytes is None:
            block_bytes = DEFAULT_BLOCK_BYTES
        if not isinstance(block_bytes, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                for k, v in block_bytes.items()):
            raise ValueError(f"block_bytes={block_bytes!r} is invalid; allowed: a mapping of device type "
                             f"(such as 'cuda') to a block size in bytes, an int >= 1")
        self.model = model
        self.optimizer = optimizer
        self.block_bytes: dict[str, int] = dict(block_bytes)
        self.resizes = bool(resizes)
        self._device_type = None if device is None else torch.device(device).type
        self._record = bool(timeline)
        # storage key (StorageImpl address) -> _Entry
        self._live: dict[int, _Entry] = {}
        self._cur = [0, 0, 0, 0, 0]
        self._total = 0
        self._phase = _OTH
        self._ops = 0
        self._events: list[tuple] = []
        self._dirty = True
        self._peak = _Peak(0, (0, 0, 0, 0, 0), 0, "other", None)
        self._end: tuple[int, ...] | None = None
        self._stack: list[list] = []  # [qualified name, max total while active, is_backward_frame]
        self._module_peaks: dict[str, int] = {}
        self._handles: list[Any] = []
        self._depth = 0
        self._in_opt = 0
        self._opt_before: set[int] = set()
        self._orig_resize: Any = None
        cls = type(self)
        self._unwrap = None if cls.counted_tensor is MemoryTracker.counted_tensor else self.counted_tensor
        self._hook = None if cls.after_op is MemoryTracker.after_op else self.after_op

    # ------------------------------------------------------------------ the extension API
    def counted_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor whose storage holds ``t``'s bytes: ``t`` itself. Override for wrapper tensors
        (a DTensor's bytes are its local shard's, see :func:`memlab.distributed.rank_tracker`)."""
        return t

    def after_op(self) -> bool | None:
        """Hook: called after every dispatched op (and at enter, at exit, after each step and for
        each :meth:`add_transient`) once :attr:`current_bytes` is up to date, before the peak and
        the timeline take it. Raise to refuse the op (``memlab.train.BudgetTracker``); return
        ``False`` to leave this moment out of the peak and the timeline. Does nothing here."""
        return None

    def allocated_bytes(self, nbytes: int, device: str | torch.device) -> int:
        """The rounding policy: bytes the allocator takes for ``nbytes`` on ``device`` (see
        :func:`allocator_bytes` and ``block_bytes``)."""
        return allocator_bytes(nbytes, device, self.block_bytes)

    def sync_sizes(self, storage: torch.Tensor | torch.UntypedStorage | None = None) -> int:
        """Re-read the size of one tracked storage (a tensor's, or a storage) or, with ``None``, of
        every live one, and charge what changed now: for resizes that no op returns. Returns the
        change in charged bytes."""
        if storage is None:
            entries = list(self._live.values())  # a list: a weakref callback may fire meanwhile
        else:
            if isinstance(storage, torch.Tensor):
                storage = (self._unwrap(storage) if self._unwrap else storage).untyped_storage()
            e = self._live.get(storage._cdata)
            entries = [e] if e is not None and e.ref() is storage else []
        change = 0
        for e in entries:
            st = e.ref()
            if st is not None:
                change += self._resize_entry(e, st.nbytes())
        return change

    def live_storages(self) -> list[LiveStorage]:
        """The storages the tracker holds now, with the bytes it charges each and its category."""
        out = []
        for key, e in list(self._live.items()):
            st = e.ref()
            if st is not None:
                out.append(LiveStorage(key, st, e.nbytes, CATEGORIES[e.cat]))
        return out

    # ------------------------------------------------------------------ storages
    def _block(self, dev_type: str) -> int:
        return self.block_bytes.get(dev_type, 1)

    def _new_entry(self, st: torch.UntypedStorage, key: int, dev_type: str, cat: int, base: int | None) -> None:
        """Start counting a storage: all its bytes, or (``base``: the bytes it held before the
        tracker met it, already rounded) only what it grew since."""
        block = self._block(dev_type)
        n = st.nbytes()
        if block > 1:
            n = -(-n // block) * block
        b = 0 if base is None else base
        self._live[key] = _Entry(n - b, cat, weakref.ref(st, self._make_free(key)), block, b)
        if n != b:
            self._cur[cat] += n - b
            self._total += n - b
            self._dirty = True

    def _resize_entry(self, e: _Entry, nbytes: int) -> int:
        if e.block > 1:
            nbytes = -(-nbytes // e.block) * e.block
        d = nbytes - e.base - e.nbytes
        if d:
            self._cur[e.cat] += d
            self._total += d
            e.nbytes += d
            self._dirty = True
        return d

    def _track(self, t: torch.Tensor, cat: int, relabel: bool = False) -> None:
        """Count ``t``'s storage (an owner's when ``relabel``: it is charged in full and takes ``cat``)."""
        if self._unwrap is not None:
            t = self._unwrap(t)
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):  # sparse, mkldnn, opaque subclasses
            return
        key = st._cdata
        e = self._live.get(key)
        if e is None:
            dev = t.device.type
            if self._device_type is not None and dev != self._device_type:
                return
            self._new_entry(st, key, dev, cat, None)
            return
        self._resize_entry(e, st.nbytes())
        if relabel:
            if e.base:  # an owner is charged in full, even if the tracker met it as an old storage
                self._cur[e.cat] += e.base
                self._total += e.base
                e.nbytes += e.base
                e.base = 0
                self._dirty = True
            if e.cat != cat:
                self._cur[e.cat] -= e.nbytes
                self._cur[cat] += e.nbytes
                e.cat = cat
                self._dirty = True

    def _track_output(self, o: torch.Tensor, cat: int, inputs: list | None, args: Any, kwargs: Any,
                      before: dict | None) -> list | None:  # inputs=(): no input is old
        """Count an op's output: a storage the tracker has not met is new, unless it is one of the
        op's inputs' storages, born before tracking (a view or an alias: only growth is charged).
        Returns the inputs' storage keys (computed once per op, when first needed)."""
        if self._unwrap is not None:
            o = self._unwrap(o)
        try:
            st = o.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):
            return inputs
        key = st._cdata
        e = self._live.get(key)
        if e is not None:
            self._resize_entry(e, st.nbytes())
            return inputs
        dev = o.device.type
        if self._device_type is not None and dev != self._device_type:
            return inputs
        if inputs is None:
            inputs = []
            for t in _flat_tensors((args, kwargs), []):
                if self._unwrap is not None:
                    t = self._unwrap(t)
                try:
                    inputs.append(t.untyped_storage()._cdata)
                except (NotImplementedError, RuntimeError, TypeError):
                    pass
        if key in inputs:  # an alias of an input the tracker never met: born before tracking
            base = before.get(key) if before else None
            if base is None:
                base = self.allocated_bytes(st.nbytes(), dev)
            self._new_entry(st, key, dev, cat, base)
        else:
            self._new_entry(st, key, dev, cat, None)
        return inputs

    def _untracked_sizes(self, args: Any, kwargs: Any) -> dict[int, tuple]:
        """Before an op that writes into its arguments: the allocator bytes of each argument
        storage the tracker has not met, so that a resize by the op is charged (from this size)."""
        out: dict[int, tuple] = {}
        for t in _flat_tensors((args, kwargs), []):
            if self._unwrap is not None:
                t = self._unwrap(t)
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError, TypeError):
                continue
            key = st._cdata
            if key not in self._live and key not in out:
                out[key] = (self.allocated_bytes(st.nbytes(), t.device), st, t.device.type)
        return out

    def _on_resize(self, st: torch.UntypedStorage, old: int) -> None:
        """``UntypedStorage.resize_`` ran (with ``resizes``): charge the change now."""
        key = st._cdata
        e = self._live.get(key)
        if e is not None and e.ref() is st:
            self._resize_entry(e, st.nbytes())
            return
        dev = st.device.type
        if self._device_type is not None and dev != self._device_type:
            return
        cat = _O if self._in_opt else (_A if self._phase in (_FWD, _BWD) else _X)
        self._new_entry(st, key, dev, cat, self.allocated_bytes(old, dev))

    def _make_free(self, key: int):
        def free(ref: weakref.ref) -> None:
            e = self._live.get(key)
            if e is None or e.ref is not ref:
                return
            del self._live[key]
            self._cur[e.cat] -= e.nbytes
            self._total -= e.nbytes
            self._dirty = True

        return free

    def _track_state(self) -> None:
        """Label what the model and the optimizer hold right now."""
        params: list[torch.Tensor] = []
        if self.model is not None:
            params.extend(self.model.parameters())
            for b in self.model.buffers():
                self._track(b, _P, relabel=True)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                params.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
        for p in params:
            self._track(p, _P, relabel=True)
            if p.grad is not None:
                self._track(p.grad, _G, relabel=True)
        if self.optimizer is not None:
            self._track_optimizer(self.optimizer)

    def _track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for t in optimizer_tensors(optimizer):
            self._track(t, _O, relabel=True)

    # ------------------------------------------------------------------ the dispatch hook
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self._untracked_sizes(args, kwargs) if _mutates(func) else None
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor or isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = out
        else:  # no tensor out (e.g. the profiler's record_function ops): nothing to allocate
            outs = ()
        if outs or before:
            # the phase: optimizer step > autograd engine running > the last phase started
            if self._in_opt:
                phase = _OPT
            elif _graph_task_id() != -1:
                phase = _BWD
            elif self._phase == _BWD:  # the engine has finished
                phase = _OTH
            else:
                phase = self._phase
            if phase != self._phase:
                self._set_phase(phase)
            cat = _A if (phase == _FWD or phase == _BWD) else (_O if phase == _OPT else _X)
            inputs = () if func in _FRESH_ALIAS_OPS else None
            bsizes = {k: v[0] for k, v in before.items()} if before else None
            for o in outs:
                if isinstance(o, torch.Tensor):
                    inputs = self._track_output(o, cat, inputs, args, kwargs, bsizes)
                elif isinstance(o, (tuple, list)):
                    for oo in o:
                        if isinstance(oo, torch.Tensor):
                            inputs = self._track_output(oo, cat, inputs, args, kwargs, bsizes)
            if before:  # an argument the tracker had not met, resized by the op and not returned
                for key, (n, st, dev) in before.items():
                    if key not in self._live and self.allocated_bytes(st.nbytes(), dev) != n:
                        self._new_entry(st, key, dev, cat, n)
        self._ops += 1
        self._after_op()
        return out

    def add_transient(self, nbytes: int, category: str = "activations") -> None:
        """Count ``nbytes`` alive for one moment, now, in ``category``: buffers no tensor shows,
        such as scratch a kernel allocates inside itself (see :func:`kernel_scratch_at_peak`).
        The peak and the timeline see the spike; the current total is unchanged afterwards."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} is invalid; allowed: an int >= 0")
        if category not in CATEGORIES:
            raise ValueError(f"category={category!r} is not known; allowed: {', '.join(CATEGORIES)}")
        if nbytes == 0:
            return
        cat = CATEGORIES.index(category)
        for sign in (1, -1):
            self._cur[cat] += sign * nbytes
            self._total += sign * nbytes
            self._dirty = True
            self._after_op()

    def _after_op(self) -> None:
        if self.resizes:
            self.sync_sizes()
        if self._hook is not None and self._hook() is False:
            return
        total = self._total
        if self._stack and total > self._stack[-1][1]:
            self._stack[-1][1] = total
        if total > self._peak.total:
            self._peak = _Peak(
                total, tuple(self._cur), self._ops, PHASES[self._phase], self._stack[-1][0] if self._stack else None
            )
        if self._dirty and self._record:
            c = self._cur
            self._events.append((self._ops, self._phase, c[0], c[1], c[2], c[3], c[4]))
        self._dirty = False

    def _set_phase(self, phase: int) -> None:
        if self._phase == _BWD:  # backward is over: its module frames end with it
            self._pop_to(0, backward_only=True)
        self._phase = phase
        self._dirty = True

    # ------------------------------------------------------------------ modules
    def _push(self, name: str, backward: bool = False) -> None:
        self._stack.append([name, self._total, backward])

    def _pop_frame(self) -> None:
        name, peak, _ = self._stack.pop()
        if peak > self._module_peaks.get(name, -1):
            self._module_peaks[name] = peak
        if self._stack and peak > self._stack[-1][1]:
            self._stack[-1][1] = peak

    def _pop_to(self, depth: int, backward_only: bool = False) -> None:
        while len(self._stack) > depth and (not backward_only or self._stack[-1][2]):
            self._pop_frame()

    def _pre_forward(self, name: str):
        def hook(module, args):
            if name == "" and _graph_task_id() == -1 and not self._in_opt and self._phase != _FWD:
                self._set_phase(_FWD)
            self._push(name)

        return hook

    def _post_forward(self, name: str):
        def hook(module, args, output):
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i][0] == name and not self._stack[i][2]:
                    self._pop_to(i)
                    break
            if torch.is_grad_enabled() and _graph_task_id() == -1:
                ts = [t for t in _tensors_in(output) if t.requires_grad]
                if ts:
                    torch.autograd.graph.register_multi_grad_hook(ts, self._pre_backward(name), mode="any")

        return hook

    def _pre_backward(self, name: str):
        chain = [name] if name == "" else [""] + [".".join(name.split(".")[: i + 1]) for i in range(name.count(".") + 1)]

        def hook(grad):
            if self._depth == 0:
                return
            # keep the longest common prefix of the backward frames, push the rest of the chain
            base = 0
            while base < len(self._stack) and not self._stack[base][2]:
                base += 1
            i = 0
            while i < len(chain) and base + i < len(self._stack) and self._stack[base + i][0] == chain[i]:
                i += 1
            self._pop_to(base + i)
            for n in chain[i:]:
                self._push(n, backward=True)

        return hook

    def _install_hooks(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def opt_pre(optimizer, args, kwargs):
            self._in_opt += 1
            self._opt_before = {k for k, e in list(self._live.items()) if e.cat == _O}
            if self._phase != _OPT:
                self._set_phase(_OPT)

        def opt_post(optimizer, args, kwargs):
            self._in_opt -= 1
            if optimizer is self.optimizer or self.optimizer is None:
                self._track_optimizer(optimizer)
                # what the step allocated and still holds outside optimizer.state is not state
                state = {t.untyped_storage()._cdata for t in optimizer_tensors(optimizer)}
                for key, e in list(self._live.items()):  # a list: a weakref callback may fire meanwhile
                    if e.cat == _O and key not in state and key not in self._opt_before:
                        self._cur[_O] -= e.nbytes
                        self._cur[_X] += e.nbytes
                        e.cat = _X
                        self._dirty = True
                self._after_op()
            if not self._in_opt:
                self._set_phase(_OTH)

        self._handles += [register_optimizer_step_pre_hook(opt_pre), register_optimizer_step_post_hook(opt_post)]
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        if self.model is not None:
            for name, mod in self.model.named_modules():
                self._handles.append(mod.register_forward_pre_hook(self._pre_forward(name)))
                self._handles.append(mod.register_forward_hook(self._post_forward(name), always_call=True))
            params.extend(self.model.parameters())
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                params.extend(p for p in group["params"] if isinstance(p, torch.Tensor))

        def on_grad(p: torch.Tensor) -> None:
            if p.grad is not None:
                self._track(p.grad, _G, relabel=True)

        for p in params:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            self._handles.append(p.register_post_accumulate_grad_hook(on_grad))

    def _watch_resize(self) -> None:
        # UntypedStorage.resize_ is a storage method, not an op: no dispatch mode sees it
        orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):  # type: ignore[no-untyped-def]
            old = st.nbytes()
            out = orig(st, size)
            if tracker._depth:
                tracker._on_resize(st, old)
            return out

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "MemoryTracker":
        if self._depth == 0:
            self._track_state()
            self._install_hooks()
            if self.resizes:
                self._watch_resize()
            self._end = None
            self._after_op()  # the starting point is an event (and the first peak candidate)
        self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if self._orig_resize is not None:
                torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
                self._orig_resize = None
            self._in_opt = 0
            if self._phase != _OTH:
                self._set_phase(_OTH)
            self._pop_to(0)
            self._track_state()  # grads / optimizer state created at the very end get their label
            self._dirty = True
            self._after_op()
            self._end = tuple(self._cur)

    # ------------------------------------------------------------------ results
    @property
    def peak_bytes(self) -> int:
        """Largest total of live tracked bytes seen after any op (or at enter/exit)."""
        return self._peak.total

    @property
    def current_bytes(self) -> int:
        """Tracked bytes alive right now (storages freed after the block are subtracted too)."""
        return self._total

    @property
    def peak_phase(self) -> str:
        return self._peak.phase

    @property
    def peak_module(self) -> str | None:
        """Qualified name of the innermost module running at the peak ("" is the model itself)."""
        return self._peak.module

    @property
    def peak_event(self) -> int:
        return self._peak.event

    def breakdown(self, at: str = "peak") -> dict[str, int]:
        """Bytes per category at the peak or at the end of the block (now, if still inside)."""
        if at not in BREAKDOWN_AT:
            raise ValueError(f"at: got {at!r}, expected one of {', '.join(map(repr, BREAKDOWN_AT))}")
        counts = self._peak.counts if at == "peak" else (self._end if self._end is not None else self._cur)
        return dict(zip(CATEGORIES, counts))

    @property
    def timeline(self) -> list[Event]:
        """``Event(index, phase, bytes)`` after each op that changed something (and at enter/exit)."""
        return [Event(e[0], PHASES[e[1]], dict(zip(CATEGORIES, e[2:]))) for e in self._events]

    def phase_peaks(self) -> dict[str, int]:
        """Peak total bytes in each phase that occurred."""
        return phase_peaks(self.timeline)

    @property
    def module_peaks(self) -> dict[str, int]:
        """Qualified module name -> peak total bytes seen while it ran (forward or backward)."""
        peaks = dict(self._module_peaks)
        for name, peak, _ in self._stack:  # still running (inside the block)
            peaks[name] = max(peaks.get(name, 0), peak)
        return dict(sorted(peaks.items(), key=lambda kv: (-kv[1], kv[0])))

    def report(self, top: int = 5) -> str:
        """A text table: categories at the peak and at the end, phase peaks, top modules."""
        peak, end = self.breakdown("peak"), self.breakdown("end")
        w = max(len(c) for c in CATEGORIES) + 2
        lines = [f"{'category':<{w}}{'at peak':>14}{'at end':>14}"]
        for c in CATEGORIES:
            lines.append(f"{c:<{w}}{format_bytes(peak[c]):>14}{format_bytes(end[c]):>14}")
        lines.append(f"{'total':<{w}}{format_bytes(sum(peak.values())):>14}{format_bytes(sum(end.values())):>14}")
        mod = self.peak_module
        lines.append(
            f"peak {format_bytes(self.peak_bytes)} ({self.peak_bytes} B) at op {self.peak_event}, "
            f"phase {self.peak_phase}, module {'(root)' if mod == '' else mod or '(none)'}"
        )
        lines.append("phase peaks: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.phase_peaks().items()))
        mp = list(self.module_peaks.items())[:top]
        if mp:
            lines.append("top modules by peak while running:")
            for name, b in mp:
                lines.append(f"  {('(root)' if name == '' else name):<40}{format_bytes(b):>14}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"MemoryTracker(peak={format_bytes(self.peak_bytes)}, current={format_bytes(self.current_bytes)})"

    def plot(self, ax: Any = None, title: str | None = None, unit: str = "MiB"):
        """Stacked-area timeline by category, phases shaded, the peak marked. Returns the Axes."""
        import matplotlib.pyplot as plt

        div = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
        if unit not in div:
            raise ValueError(f"unit: got {unit!r}, expected one of {', '.join(map(repr, div))}")
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 4))
        ev = self._events
        if not ev:
            raise RuntimeError("plot: the timeline is empty (was the tracker used with timeline=True?)")
        # a step plot: each event's state holds until the next event
        xs, ys = [], [[] for _ in CATEGORIES]
        for i, e in enumerate(ev):
            nxt = ev[i + 1][0] if i + 1 < len(ev) else e[0] + 1
            for x in (e[0], nxt):
                xs.append(x)
                for k in range(5):
                    ys[k].append(e[2 + k] / div[unit])
        colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c"]
        ax.stackplot(xs, ys, labels=CATEGORIES, colors=colors, alpha=0.85, linewidth=0)
        shades = {_FWD: "#e8f0ff", _BWD: "#fff0e0", _OPT: "#e8ffe8"}
        start = ev[0]
        for i in range(1, len(ev) + 1):
            if i == len(ev) or ev[i][1] != start[1]:
                end_x = ev[i][0] if i < len(ev) else ev[-1][0] + 1
                if start[1] in shades:
                    ax.axvspan(start[0], end_x, color=shades[start[1]], zorder=0)
                    ax.text((start[0] + end_x) / 2, 1.0, PHASES[start[1]], transform=ax.get_xaxis_transform(),
                            ha="center", va="bottom", fontsize=8)
                if i < len(ev):
                    start = ev[i]
        px, py = self.peak_event, self.peak_bytes / div[unit]
        ax.axvline(px, color="black", ls="--", lw=1)
        ax.annotate(f"peak {format_bytes(self.peak_bytes)}", (px, py), xytext=(5, -12), textcoords="offset points",
                    fontsize=8)
        ax.set_xlabel("op index")
        ax.set_ylabel(f"live bytes ({unit})")
        ax.set_xlim(xs[0], xs[-1])
        ax.legend(loc="upper left", fontsize=8)
        if title:
            ax.set_title(title, pad=14)
        return ax


# ---------------------------------------------------------------------- lab references
class LiveBytes:
    """The smallest live-bytes counter: ``track(t)`` each tensor; its storage is counted once
    and subtracted when it dies (a weakref callback on the untyped storage).

    >>> lb = LiveBytes(); x = torch.zeros(256); lb.track(x); lb.track(x[:10]); lb.current
    1024
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._refs:
            return
        n = st.nbytes()

        def free(ref: weakref.ref, key: int = key, n: int = n) -> None:
            if self._refs.get(key) is ref:
                del self._refs[key]
                self.current -= n

        self._refs[key] = weakref.ref(st, free)
        self.current += n
        self.peak = max(self.peak, self.current)


def categorize(t: torch.Tensor, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, phase: str | None = None) -> str:
    """Which of ``CATEGORIES`` :class:`MemoryTracker` gives a live tensor's storage.

    The tracker's rule, owners first:

    * ``parameters``: the storage is shared with a parameter or buffer of ``model`` or a
      parameter of ``optimizer`` (a view or ``.detach()`` of one too: storages are compared,
      not tensor objects);
    * ``gradients``: shared with the ``.grad`` of one of those;
    * ``optimizer``: shared with a tensor in ``optimizer.state`` (moments, the step counter);

    else by ``phase``, the phase the storage was born in (one of ``PHASES``): ``"forward"`` or
    ``"backward"`` -> ``activations`` (saved tensors, dropout masks and normalisation statistics,
    which have no ``grad_fn``, and activation gradients), ``"optimizer"`` -> ``optimizer`` (the
    step's temporaries), ``"other"`` -> ``other`` (an input batch, anything made outside the three
    phases, even with a ``grad_fn``). Two caveats, both about time: when a step ends, the tracker
    moves what the step allocated and still holds outside ``optimizer.state`` to ``other`` (pass
    ``phase="other"`` for such a survivor); and its owner labels stick, so an old ``.grad`` that
    you still hold after autograd replaced it stays ``gradients`` there, while this function,
    which sees only the present, calls it by its birth phase.

    ``phase=None`` (the old two-argument call) falls back to a guess the tracker never makes:
    ``activations`` when ``t.grad_fn`` is set, else ``other``. It mislabels dropout masks, the
    statistics LayerNorm saves and activation gradients as ``other`` (lecture 01 shows it on a real
    step); pass the birth phase to get the tracker's label.
    """
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase={phase!r} is not a phase; allowed: {', '.join(map(repr, PHASES))} or None")
    key = t.untyped_storage()._cdata

    def same(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage()._cdata == key

    params = list(model.parameters()) + list(model.buffers()) if model is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    if any(same(p) for p in params):
        return "parameters"
    if any(same(p.grad) for p in params if isinstance(p, torch.Tensor)):
        return "gradients"
    if optimizer is not None and any(same(v) for s in optimizer.state.values() for v in _tensors_in(s)):
        return "optimizer"
    if phase is None:  # the grad_fn guess, kept for two-argument callers
        return "activations" if t.grad_fn is not None else "other"
    born = PHASES.index(phase)  # the same mapping as MemoryTracker.__torch_dispatch__
    return CATEGORIES[_A if born in (_FWD, _BWD) else (_O if born == _OPT else _X)]


def phase_peaks(timeline: Iterable[Any]) -> dict[str, int]:
    """Peak total bytes per phase from a timeline of ``(index, phase, bytes_by_category)``.

    Phases appear in the order they first occur.
    """
    out: dict[str, int] = {}
    for ev in timeline:
        _, phase, by_cat = ev[0], ev[1], ev[2]
        total = sum(by_cat.values()) if isinstance(by_cat, dict) else int(by_cat)
        if total > out.get(phase, -1):
            out[phase] = total
    return out


class _quiet_stderr:
    """Point file descriptor 2 at /dev/null for a moment (C++ log lines bypass ``sys.stderr``)."""

    def __enter__(self) -> None:
        import os
        import sys

        self._saved = None
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)
        except (OSError, ValueError, AttributeError):  # no real descriptor 2: nothing to quiet
            self._saved = None

    def __exit__(self, *exc: Any) -> None:
        import os

        if self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)


def allocator_peak(fn: Callable[[], Any]) -> tuple[int, int]:
    """Run ``fn()`` under ``torch.profiler.profile(profile_memory=True)`` and rebuild the CPU
    allocator's live bytes from its allocation and free events, in time order: returns ``(peak,
    end)``, the highest point and the last one, both above the bytes live when ``fn`` started.

    The counter that is not a twin of :class:`MemoryTracker`: it sees every block the allocator
    serves (kernel scratch and 8-byte wrapped numbers included) and no tensor. It cannot see the
    free of a block allocated before it started, so ``fn`` should not free older memory (make the
    inputs inside ``fn``, or keep them alive)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's C++ side logs its start and stop on file descriptor 2
        prof.__enter__()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    events = []
    while stack:  # the tree in order (a stable sort by time keeps it for equal times)
        n = stack.pop()
        if n.tag == _EventType.Allocation:
            events.append((n.start_time_ns, n.extra_fields.alloc_size))
        stack.extend(reversed(n.children))
    cur = top = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        cur += size
        top = max(top, cur)
    return top, cur


# CUDA kernels known to allocate scratch inside themselves (no op returns it, so a dispatch-level
# tracker cannot see it): softmax's backward copies a non-contiguous incoming gradient (seen in an
# allocator snapshot on an H100 with torch 2.11: one attention-score matrix per layer, in backward).
KERNEL_SCRATCH_FRAMES: tuple[str, ...] = ("softmax_backward_cuda_out::impl",)


def kernel_scratch_at_peak(snapshot: Mapping[str, Any], frames: Sequence[str] = KERNEL_SCRATCH_FRAMES,
                           device: int = 0) -> int:
    """Bytes that CUDA kernels allocated inside themselves and still held at the allocator's peak.

    ``snapshot`` is ``torch.cuda.memory._snapshot()`` taken after recording a step with
    ``torch.cuda.memory._record_memory_history()`` (C++ stacks on, its default). The peak is that of
    the recorded trace; a block counts when one of its C++ frames contains one of ``frames``.
    """
    traces = snapshot.get("device_traces", [])
    if not isinstance(device, int) or not 0 <= device < len(traces):
        raise ValueError(f"device={device!r} is not in the snapshot; allowed: 0..{len(traces) - 1}")
    live: dict[int, Mapping[str, Any]] = {}
    cur = top = 0
    at_top: dict[int, Mapping[str, Any]] = {}
    for ev in traces[device]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
        elif ev["action"] == "free_completed" and live.pop(ev["addr"], None) is not None:
            cur -= ev["size"]
        if cur > top:
            top, at_top = cur, dict(live)
    return sum(ev["size"] for ev in at_top.values()
               if any(f in fr.get("name", "") for fr in ev.get("frames", []) for f in frames))


def fake_activation_bytes(config: Any, batch_size: int, seq_len: int) -> int:
    """Bytes one training forward of ``TinyGPT(config)`` (logits and loss) saves for backward,
    measured on fake tensors: the model and the batch are built under ``FakeTensorMode``, so a
    model far larger than the machine costs nothing. Storages count once (keyed by the storage
    object, since ``data_ptr()`` means nothing on a fake tensor); parameters and buffers are not
    activations.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab.models import TinyGPT

    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size={batch_size!r} and seq_len={seq_len!r} must be >= 1")
    if seq_len > config.block_size:
        raise ValueError(f"seq_len={seq_len} exceeds config.block_size={config.block_size}")
    with FakeTensorMode():
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        y = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        skip = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}
        seen: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if id(st) not in skip:
                seen[id(st)] = st  # holding the storage keeps its id unique while we count
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(x, y)
        total = sum(st.nbytes() for st in seen.values())
        del loss
    return total


def train_losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[Any],
                 steps: int) -> list[float]:
    """``steps`` training steps on ``(x, y)`` pairs from ``batches``; the loss history as floats.

    The leak-free loop: ``loss.item()`` goes into the history, never the tensor (a kept tensor
    keeps its autograd graph, and with ``retain_graph=True`` every saved activation, alive).
    """
    from memlab.models import lm_loss

    history: list[float] = []
    it = iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(loss.item())
    return history
