"""The training-step memory tracker: every tensor storage of a step, by category, phase and module.

Built from two PyTorch mechanisms: a ``TorchDispatchMode`` sees every aten op inside the ``with``
block (forward, the autograd engine's backward, the optimizer step) and so every tensor those ops
return; a weak reference to each tensor's *untyped storage*, whose callback runs the moment the
last tensor using it dies, subtracts its bytes exactly when the memory is given back. Views share
one storage, so each storage is counted once. The design follows PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker``, which differs only in how it charges a view
of memory born before the block (it charges the whole storage; this tracker charges nothing). As
``MemTracker`` holds a ``ModTracker``, :class:`MemoryTracker` holds its module frames as an object
(:class:`_ModuleFrames`).

Phases: ``forward`` while the model's forward runs (a pre/post hook on the root module),
``backward`` while the autograd engine runs (``torch._C._current_graph_task_id() != -1``),
``optimizer`` inside ``Optimizer.step`` (the global step pre/post hooks), ``other`` otherwise.
Categories: see :class:`MemoryTracker`.

Limits: ops that bypass the dispatcher (``no_dispatch``, C++ extensions calling the allocator,
cuBLAS workspaces, scratch a kernel allocates inside itself) are invisible. And the run it watches
is not quite the run without it: autograd sums the gradients of a tensor used several times in
place (``aten::add_`` into the first gradient) only when no tensor is "subclass-like", and
``at::isTensorSubclassLike`` answers yes for every tensor while any Python dispatch mode is active
(``c10::impl::dispatch_mode_enabled()``). Under this tracker, as under a dispatch mode that does
nothing, each such sum runs out of place (``aten::add``) and holds one more gradient-sized buffer
for an instant: a step that feeds one tensor to several branches (chunked attention's key and value
chunks, each used by every later query chunk) can peak higher tracked than untracked, by up to one such
gradient (lecture 05 measures it with :func:`memlab.profiler.peak_beside_allocator`; tests in
``tests/ch05/test_tracker_accumulation.py``). A dispatch mode cannot avoid it, since the engine's
choice is made in C++ before the op reaches the mode. The tracker is exact for the run it watches.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from memlab.core.units import format_bytes
from memlab.core.validation import check_choice, check_int
from memlab.core.vocab import Category, Phase
from memlab.profiler.allocator import DEFAULT_BLOCK_BYTES, allocator_bytes
from memlab.profiler.report import format_report, plot_timeline
from memlab.profiler.storage import (BREAKDOWN_AT, CATEGORIES, FRESH_ALIAS_OPS, PHASES, Event, LiveStorage,
                                     optimizer_tensors, tensors_in)

__all__ = ["MemoryTracker"]

_graph_task_id = torch._C._current_graph_task_id

# the hot path counts categories and phases as small ints: their positions in CATEGORIES and PHASES
_P, _G, _O, _A, _X = (CATEGORIES.index(c.value) for c in (
    Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER, Category.ACTIVATIONS, Category.OTHER))
_FWD, _BWD, _OPT, _OTH = (PHASES.index(p.value) for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER))
# what a new storage is, by the phase it is born in: activations in forward and backward, optimizer
# state in the optimizer step, other otherwise
_PHASE_CAT = [0] * len(PHASES)
_PHASE_CAT[_FWD] = _PHASE_CAT[_BWD] = _A
_PHASE_CAT[_OPT] = _O
_PHASE_CAT[_OTH] = _X
_PHASE_CAT = tuple(_PHASE_CAT)


class _Entry(weakref.ref):
    """One live storage: the weak reference to it (calling the entry gives the storage, or None
    once it died), its key, charged bytes, category index, its block, and ``base``, the allocator
    bytes it held before the tracker met it (never charged).

    One object per storage, made without a Python ``__init__``, whose callback is the tracker's one
    bound ``_free`` (no closure per storage): the tracker makes one for most ops of a step, and the
    garbage collector runs once per 700 such objects alive."""

    __slots__ = ("key", "nbytes", "cat", "block", "base")


# a timeline event is _EVENT_WIDTH ints in one flat list: op index, phase index, bytes per category
_EVENT_WIDTH = 2 + len(CATEGORIES)


# per op, computed once from its schema: bit 1, it writes into an argument (in place or out=), so
# it can resize a storage the tracker has not met yet and sizes are read before it runs; bit 2, it
# may return an alias of an argument (a view, the tensor an in-place op returns); bit 4, the one
# argument it writes is its first, ``self`` (``add_``, ``mul_``: the optimizer's ops), so a tracked
# ``self`` is all it takes to know that no size needs reading before it runs. An op with neither
# of the first two returns fresh storages only, and its arguments are never walked (most ops of a step)
_WRITES, _ALIASES, _SELF = 1, 2, 4
_KINDS: dict[int, int] = {}
_KIND_OPS: list[Any] = []
# per op that writes into arguments, the ones it writes: (position or None, name); absent: unknown, all
_WRITTEN: dict[int, tuple[tuple[int | None, str], ...]] = {}
# returns with no alias annotation that are views all the same (autograd's reasons, see native_functions.yaml)
_UNANNOTATED_VIEWS = frozenset(("_unsafe_view",))


def _op_kind(func: Any) -> int:
    # keyed by id (an OpOverload's __hash__ is Python code); _KIND_OPS keeps each op, so its id stays its own
    k = _KINDS.get(id(func))
    if k is None:
        try:
            schema = func._schema
            written = tuple((None if a.kwarg_only else i, a.name) for i, a in enumerate(schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write)
            k = _WRITES if written else 0
            if written:
                _WRITTEN[id(func)] = written
                if written == ((0, "self"),):
                    k |= _SELF
            if (any(r.alias_info is not None for r in schema.returns)
                    or schema.name.split("::")[-1] in _UNANNOTATED_VIEWS):
                k |= _ALIASES
        except AttributeError:  # not an OpOverload: assume it may do both
            k = _WRITES | _ALIASES
        _KINDS[id(func)] = k
        _KIND_OPS.append(func)
    return k


# per op: (its kind, the callable that runs it). For an OpOverload that is its ``_op``, the builtin its
# ``__call__`` calls (one Python frame less per op); anything else (a TorchBindOpOverload, a higher-order
# op) is called as it is
_INFO: dict[int, tuple[int, Any]] = {}


def _op_info(func: Any) -> tuple[int, Any]:
    info = _INFO.get(id(func))
    if info is None:
        call = func
        if type(func) is torch._ops.OpOverload and type(func).__call__ is _OVERLOAD_CALL:
            call = getattr(func, "_op", func)
        info = _INFO[id(func)] = (_op_kind(func), call)  # _op_kind keeps func alive, so its id stays its own
    return info


_OVERLOAD_CALL = torch._ops.OpOverload.__call__
# a fake tensor's device, asked for as an op (see MemoryTracker.__torch_dispatch__); torch imports fake_tensor itself
_PRIM_DEVICE = torch.ops.prim.device.default
_FakeTensor = torch._subclasses.fake_tensor.FakeTensor


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    # the tensors an op writes into (only these can grow); every argument tensor when the schema is unknown
    written = _WRITTEN.get(id(func))
    if written is None:
        return _arg_tensors(args, kwargs)
    out: list[torch.Tensor] = []
    for i, name in written:
        a = args[i] if i is not None and i < len(args) else kwargs.get(name)
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            tensors_in(a, 2, out)
    return out


def _arg_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    # tensors_in((args, kwargs)), without the walk for the usual flat argument tuple
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            tensors_in(a, 2, out)
    if kwargs:
        tensors_in(kwargs, 1, out)
    return out


_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _plain_hooks(mod: torch.nn.Module) -> bool:
    # the module registers forward hooks as torch.nn.Module does (its methods not overridden) in the
    # dicts this torch keeps them in, so the tracker may add its own there directly
    cls = type(mod)
    return (cls.register_forward_pre_hook is _MODULE_PRE_HOOK and cls.register_forward_hook is _MODULE_HOOK
            and type(getattr(RemovableHandle, "next_id", None)) is int
            and all(isinstance(mod.__dict__.get(d), dict) for d in _MODULE_HOOK_DICTS))


_MODULE_PRE_HOOK = torch.nn.Module.register_forward_pre_hook
_MODULE_HOOK = torch.nn.Module.register_forward_hook

_CHAINS: dict[str, tuple[str, ...]] = {}


def _chain(name: str) -> tuple[str, ...]:
    # a module's qualified name and those of its parents, the root ("") first
    c = _CHAINS.get(name)
    if c is None:
        c = (name,) if name == "" else ("",) + tuple(
            ".".join(name.split(".")[: i + 1]) for i in range(name.count(".") + 1))
        if len(_CHAINS) < 100_000:
            _CHAINS[name] = c
    return c


class _ModuleFrames:
    """Which module is running, and the highest total each one saw (the part PyTorch's ``ModTracker``
    plays for its ``MemTracker``).

    Forward hooks push and pop module frames; in backward, the module whose output gradient arrived
    last is running (with its parents) until the next one starts. Backward attribution is by
    output-gradient arrival (a hook on each module's outputs that runs for the first of their
    gradients in each backward, as ``torch.autograd.graph.register_multi_grad_hook(mode="any")``
    does), exact for sequential models and approximate where modules interleave.

    A frame is ``[qualified name, max total while active, is_backward_frame]``. ``total`` reads the
    tracker's current bytes; ``on_root_forward`` runs when the model's own forward starts outside
    the autograd engine.
    """

    def __init__(self, total: Callable[[], int], on_root_forward: Callable[[], None]) -> None:
        self.stack: list[list] = []
        self._peaks: dict[str, int] = {}  # frames that ended: name -> peak
        self._total = total
        self._on_root_forward = on_root_forward
        self._handles: list[Any] = []
        self._active = False

    def install(self, model: torch.nn.Module) -> None:
        """Forward pre/post hooks on every submodule of ``model``, until :meth:`remove`."""
        for name, mod in model.named_modules():
            pre, post = self._pre_forward(name), self._post_forward(name)
            if _plain_hooks(mod):
                # what register_forward_pre_hook(pre) and register_forward_hook(post, always_call=True)
                # do, in their order, without their two RemovableHandle objects (a fresh tracker per
                # step registers two hooks per module: a tenth of its cost in a small model's step)
                i = RemovableHandle.next_id
                RemovableHandle.next_id = i + 2
                mod._forward_pre_hooks[i] = pre
                mod._forward_hooks[i + 1] = post
                mod._forward_hooks_always_called[i + 1] = True
                self._handles.append((mod, i))
            else:
                self._handles.append(mod.register_forward_pre_hook(pre))
                self._handles.append(mod.register_forward_hook(post, always_call=True))
        self._active = True

    def remove(self) -> None:
        """Remove the hooks and end every frame (backward hooks left on a graph do nothing from now)."""
        for h in self._handles:
            if type(h) is tuple:  # installed by hand: what the two handles' remove() do
                mod, i = h
                mod._forward_pre_hooks.pop(i, None)
                mod._forward_pre_hooks_with_kwargs.pop(i, None)
                mod._forward_hooks.pop(i + 1, None)
                mod._forward_hooks_with_kwargs.pop(i + 1, None)
                mod._forward_hooks_always_called.pop(i + 1, None)
            else:
                h.remove()
        self._handles.clear()
        self._active = False
        self.pop_to(0)

    def module_peaks(self) -> dict[str, int]:
        """Qualified module name -> peak total bytes seen while it ran, the highest first."""
        peaks = dict(self._peaks)
        for name, peak, _ in self.stack:  # still running (inside the block)
            peaks[name] = max(peaks.get(name, 0), peak)
        return dict(sorted(peaks.items(), key=lambda kv: (-kv[1], kv[0])))

    @property
    def innermost(self) -> str | None:
        """The name of the innermost module running, or None."""
        return self.stack[-1][0] if self.stack else None

    def see(self, total: int) -> None:
        """The innermost running module saw ``total`` bytes."""
        if self.stack and total > self.stack[-1][1]:
            self.stack[-1][1] = total

    def end_backward(self) -> None:
        """The backward is over: its frames end with it."""
        self.pop_to(0, backward_only=True)

    def pop_to(self, depth: int, backward_only: bool = False) -> None:
        """End frames until ``depth`` remain (only backward frames with ``backward_only``)."""
        while len(self.stack) > depth and (not backward_only or self.stack[-1][2]):
            name, peak, _ = self.stack.pop()
            if peak > self._peaks.get(name, -1):
                self._peaks[name] = peak
            if self.stack and peak > self.stack[-1][1]:
                self.stack[-1][1] = peak

    def _push(self, name: str, backward: bool = False) -> None:
        self.stack.append([name, self._total(), backward])

    def _pre_forward(self, name: str):
        stack, total = self.stack, self._total

        def hook(module, args):
            if name == "" and _graph_task_id() == -1:
                self._on_root_forward()
            stack.append([name, total(), False])  # _push, inlined

        return hook

    def _post_forward(self, name: str):
        backward_hook = self._pre_backward(name)  # built once per module, not once per forward

        stack = self.stack  # the same list for the frames' life

        def hook(module, args, output):
            if stack and stack[-1][0] == name and not stack[-1][2]:  # the usual case: this module's frame is on top
                self.pop_to(len(stack) - 1)
            else:
                for i in range(len(stack) - 1, -1, -1):
                    if stack[i][0] == name and not stack[i][2]:
                        self.pop_to(i)
                        break
            if torch.is_grad_enabled() and _graph_task_id() == -1:
                if type(output) is torch.Tensor:  # tensors_in's answer for one plain tensor
                    if output.requires_grad:
                        output.register_hook(backward_hook)
                    return
                ts = [t for t in tensors_in(output) if t.requires_grad]
                if len(ts) == 1:  # the usual case: one hook on the one output
                    ts[0].register_hook(backward_hook)
                elif ts:
                    first = self._first_grad_only(backward_hook)
                    for t in ts:
                        t.register_hook(first)

        return hook

    @staticmethod
    def _first_grad_only(fn: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        # torch.autograd.graph.register_multi_grad_hook(mode="any") without its lock and wrappers
        # (a tenth of the tracker's cost, registered after every module's forward): ``fn`` runs for
        # the first of the outputs' gradients in each backward pass
        seen: set[int] = set()

        def hook(grad: torch.Tensor) -> None:
            task = _graph_task_id()
            if task not in seen:
                seen.add(task)
                fn(grad)

        return hook

    def _pre_backward(self, name: str):
        chain: Any = None  # the names from the root to this module, made at the first backward

        def hook(grad):
            nonlocal chain
            if not self._active:
                return
            if chain is None:
                chain = _chain(name)
            # keep the longest common prefix of the backward frames, push the rest of the chain
            base = 0
            while base < len(self.stack) and not self.stack[base][2]:
                base += 1
            i = 0
            while i < len(chain) and base + i < len(self.stack) and self.stack[base + i][0] == chain[i]:
                i += 1
            self.pop_to(base + i)
            for n in chain[i:]:
                self._push(n, backward=True)

        return hook


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

    Categories, each storage in exactly one: ``parameters`` (parameters and buffers of the model,
    parameters of the optimizer); ``gradients`` (their ``.grad``, re-labelled when autograd
    accumulates them); ``optimizer`` (tensors in ``optimizer.state``; during ``optimizer.step`` every
    new storage, and after the step what is still alive outside ``state`` moves to ``other``);
    ``activations`` (anything else allocated while the forward or the backward runs: saved
    activations, their gradients, recomputed activations); ``other`` (the rest, such as a batch
    moved to the device).

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
        timeline: record the timeline (an event after each op that changed something). False is the
            peak-only mode: the peak, its categories, phase and module peaks and the end breakdown are
            the same, :attr:`timeline` is empty and :meth:`plot` has nothing to draw.
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
        self._events: list[int] = []  # flat: _EVENT_WIDTH ints per event
        self._timeline_memo: tuple[int, list] = (0, [])  # (len(_events), the timeline built from them): see timeline
        self._dirty = True
        # the peak: its total, and (bytes per category, op index, phase index, innermost module)
        self._peak_total = 0
        self._peak: tuple = (tuple(self._cur), 0, _OTH, None)
        self._free_cb = self._free  # one bound method, the callback of every entry
        self._end: tuple[int, ...] | None = None
        self._frames = _ModuleFrames(lambda: self._total, self._root_forward_starts)
        self._frame_stack = self._frames.stack  # the same list, read after every op
        # the peak of each phase (-1: not seen yet) and the phases in the order they first occurred
        self._phase_peak = [-1] * len(PHASES)
        self._phase_order: list[int] = []
        self._handles: list[Any] = []
        self._depth = 0
        self._in_opt = 0
        self._opt_before: set[int] = set()
        self._orig_resize: Any = None
        cls = type(self)
        self._unwrap = None if cls.counted_tensor is MemoryTracker.counted_tensor else self.counted_tensor
        self._hook = None if cls.after_op is MemoryTracker.after_op else self.after_op
        self._slow_after = True  # _after_op in full after each op (resizes or a hook): set on entering

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
        """The bytes the allocator takes for ``nbytes`` on ``device`` (a device or its type): the
        rounding policy (see :func:`allocator_bytes` and ``block_bytes``)."""
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
            entries = [e] if e is not None and e() is storage else []
        change = 0
        for e in entries:
            st = e()
            if st is not None:
                change += self._resize_entry(e, st.nbytes())
        return change

    def live_storages(self) -> list[LiveStorage]:
        """The storages the tracker holds now, one :class:`LiveStorage` each."""
        out = []
        for key, e in list(self._live.items()):
            st = e()
            if st is not None:
                out.append(LiveStorage(key, st, e.nbytes, CATEGORIES[e.cat]))
        return out

    def add_transient(self, nbytes: int, category: str = "activations") -> None:
        """Count ``nbytes`` (an int >= 0) alive for one moment, now, in ``category`` (one of
        :data:`CATEGORIES`): buffers no tensor shows, such as scratch a kernel allocates inside
        itself (see :func:`kernel_scratch_at_peak`). The peak and the timeline see the spike; the
        current total is unchanged afterwards.

        Raises:
            ValueError: naming a bad ``nbytes`` or ``category``.
        """
        check_int("nbytes", nbytes, minimum=0)
        check_choice("category", category, CATEGORIES)
        if nbytes == 0:
            return
        cat = CATEGORIES.index(category)
        for sign in (1, -1):
            self._cur[cat] += sign * nbytes
            self._total += sign * nbytes
            self._dirty = True
            self._after_op()

    # ------------------------------------------------------------------ storages
    def _new_entry(self, st: torch.UntypedStorage, key: int, dev_type: str, cat: int, base: int | None) -> None:
        # start counting a storage: all its bytes, or (base: the bytes it held before the tracker
        # met it, already rounded) only what it grew since
        block = self.block_bytes.get(dev_type, 1)
        n = st.nbytes()
        if block > 1:
            n = -(-n // block) * block
        b = 0 if base is None else base
        e = _Entry(st, self._free_cb)
        e.key, e.nbytes, e.cat, e.block, e.base = key, n - b, cat, block, b
        self._live[key] = e
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
        # count t's storage (an owner's when relabel: it is charged in full and takes cat)
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
        # count an op's output: a storage the tracker has not met is new, unless it is one of the
        # op's inputs' storages, born before tracking (a view or an alias: only growth is charged);
        # returns the inputs' storage keys (computed once per op, when first needed)
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
            for t in _arg_tensors(args, kwargs):
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

    def _track_fresh(self, o: torch.Tensor, cat: int) -> None:
        # an output of an op that returns no alias of its arguments: a storage not met yet is new
        if self._unwrap is not None:
            o = self._unwrap(o)
        try:
            st = o.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):
            return
        key = st._cdata
        e = self._live.get(key)
        if e is not None:
            self._resize_entry(e, st.nbytes())
            return
        if self._device_type is not None and o.device.type != self._device_type:
            return
        self._new_entry(st, key, o.device.type, cat, None)

    def _untracked_sizes(self, func: Any, args: Any, kwargs: Any) -> dict[int, tuple]:
        # before an op that writes into its arguments: the allocator bytes of each storage it writes that
        # the tracker has not met, so that a resize by the op is charged (from this size)
        out: dict[int, tuple] = {}
        for t in _written_tensors(func, args, kwargs):
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

    def _free(self, e: _Entry) -> None:
        # an entry's callback: its storage died (an entry replaced under its key is no longer counted)
        live = self._live
        if live.get(e.key) is e:
            del live[e.key]
            self._cur[e.cat] -= e.nbytes
            self._total -= e.nbytes
            self._dirty = True

    def _track_state(self) -> None:
        # label what the model and the optimizer hold right now: buffers, then each parameter and its
        # gradient, then the optimizer's state (a tensor met twice is labelled by its first meeting)
        params: list[torch.Tensor] = []
        if self.model is not None:
            params.extend(self.model.parameters())
            self._track_owned(self.model.buffers(), _P)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                params.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
        seen: set[int] = set()
        owned: list[torch.Tensor] = []  # each parameter, then its gradient
        cats: list[int] = []
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            owned.append(p)
            cats.append(_P)
            g = p.grad
            if g is not None:
                owned.append(g)
                cats.append(_G)
        self._track_owned(owned, cats)
        if self.optimizer is not None:
            self._track_optimizer(self.optimizer)

    def _track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._track_owned(optimizer_tensors(optimizer), _O)

    def _track_owned(self, tensors: Any, cats: int | list[int]) -> None:
        # _track(t, cat, relabel=True) for each tensor, inlined (enter and exit label a few hundred); cats: one
        # category for all, or a list, one per tensor
        live, unwrap, device_type = self._live, self._unwrap, self._device_type
        cat = cats
        for j, owned in enumerate(tensors):
            if type(cats) is list:
                cat = cats[j]
            t = owned if unwrap is None else unwrap(owned)
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError, TypeError):  # sparse, mkldnn, opaque subclasses
                continue
            key = st._cdata
            e = live.get(key)
            if e is None:
                dev = t.device.type
                if device_type is None or dev == device_type:
                    self._new_entry(st, key, dev, cat, None)
                continue
            n = st.nbytes()
            if e.block > 1:
                n = -(-n // e.block) * e.block
            d = n - e.base - e.nbytes
            if d:
                self._cur[e.cat] += d
                self._total += d
                e.nbytes += d
                self._dirty = True
            if e.base or e.cat != cat:
                self._track(owned, cat, relabel=True)

    # ------------------------------------------------------------------ the dispatch hook
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless this says False:
        # two eval-frame switches and two wrapper calls per op, a tenth of the tracker's cost. Nothing
        # is compiled inside the hook, and a torch.compile'd function called in the block still runs
        # with its ops counted (tests/ch01/test_profiler.py)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # _dispatch_general with three fast paths, equal to it in every count, event and peak
        # (tests/ch01/test_tracker_fastpath.py): a fake tensor's device, read by C++ code (TensorIterator, the
        # autograd engine, .to) as an op, prim::device (two of every three ops a fake trace sends here; a real
        # tensor's device is no op), is answered here as FakeTensorMode answers it (its ``device``: the fake
        # device) when nothing is pending (no event to record, no size to sync); an op that writes only into a
        # tracked ``self`` reads no size before it runs; one tensor out is counted here, without the general walk
        if func is _PRIM_DEVICE and not self._dirty and not self._slow_after and type(args[0]) is _FakeTensor:
            self._ops += 1
            return args[0].device
        if kwargs is None:
            kwargs = {}
        info = _INFO.get(id(func))
        if info is None:
            info = _op_info(func)
        kind = info[0]
        if not kind & _WRITES:
            before = None
        elif kind & _SELF and self._unwrap is None and args and isinstance(args[0], torch.Tensor):
            # _untracked_sizes of an op that writes its self only: nothing to read when self is tracked
            try:
                tracked = args[0].untyped_storage()._cdata in self._live
            except (NotImplementedError, RuntimeError, TypeError):
                tracked = True  # no storage: _untracked_sizes skips it too
            before = {} if tracked else self._untracked_sizes(func, args, kwargs)
        else:
            before = self._untracked_sizes(func, args, kwargs)
        out = info[1](*args, **kwargs)
        if not before and self._unwrap is None and isinstance(out, torch.Tensor):
            # one tensor out and no size read before: _count_outputs inlined
            phase = self._phase
            if self._in_opt:
                if phase != _OPT:
                    self._set_phase(_OPT)
                    phase = _OPT
            elif _graph_task_id() != -1:
                if phase != _BWD:
                    self._set_phase(_BWD)
                    phase = _BWD
            elif phase == _BWD:
                self._set_phase(_OTH)
                phase = _OTH
            try:
                st = out.untyped_storage()
            except (NotImplementedError, RuntimeError, TypeError):
                st = None
            if st is not None:
                key = st._cdata
                live = self._live
                e = live.get(key)
                if e is not None:
                    # a storage already counted; a view never resizes it, any other op may (_resize_entry inlined)
                    if kind != _ALIASES:
                        n = st.nbytes()
                        if e.block > 1:
                            n = -(-n // e.block) * e.block
                        d = n - e.base - e.nbytes
                        if d:
                            self._cur[e.cat] += d
                            self._total += d
                            e.nbytes += d
                            self._dirty = True
                elif kind & _ALIASES:  # perhaps an alias of an argument born before tracking
                    self._track_outputs(func, (out,), _PHASE_CAT[phase], args, kwargs, before)
                else:  # a new storage: _new_entry inlined
                    dev = "cpu" if type(out) is torch.Tensor and out.is_cpu else out.device.type
                    if self._device_type is None or dev == self._device_type:
                        block = self.block_bytes.get(dev, 1)
                        n = st.nbytes()
                        if block > 1:
                            n = -(-n // block) * block
                        cat = _PHASE_CAT[phase]
                        e = _Entry(st, self._free_cb)
                        e.key, e.nbytes, e.cat, e.block, e.base = key, n, cat, block, 0
                        live[key] = e
                        if n:
                            self._cur[cat] += n
                            self._total += n
                            self._dirty = True
        else:
            self._count_outputs(func, kind, out, args, kwargs, before)
            phase = self._phase
        self._ops += 1
        if self._slow_after:
            self._after_op()
            return out
        if not self._dirty:
            # nothing changed since the last _after_op (every change of a count or the phase sets _dirty, and
            # a frame starts at the current total): its peaks and frames stand, and there is no event
            return out
        # _after_op without the resizes and the hook, inlined (it runs after every op)
        total = self._total
        frames = self._frame_stack
        if frames and total > frames[-1][1]:
            frames[-1][1] = total
        if total > self._phase_peak[phase]:
            if self._phase_peak[phase] < 0:
                self._phase_order.append(phase)
            self._phase_peak[phase] = total
            if total > self._peak_total:
                self._peak_total = total
                self._peak = (tuple(self._cur), self._ops, phase, frames[-1][0] if frames else None)
        if self._record:
            ev = self._events
            ev.append(self._ops)
            ev.append(phase)
            ev += self._cur
        self._dirty = False
        return out

    def _dispatch_general(self, func, types, args=(), kwargs=None):
        # every op the general way, the reference of __torch_dispatch__'s fast paths (a subclass of the
        # tests uses it as its __torch_dispatch__)
        if kwargs is None:
            kwargs = {}
        kind = _op_info(func)[0]
        before = self._untracked_sizes(func, args, kwargs) if kind & _WRITES else None
        out = func(*args, **kwargs)
        self._count_outputs(func, kind, out, args, kwargs, before)
        self._ops += 1
        self._after_op()
        return out

    def _count_outputs(self, func: Any, kind: int, out: Any, args: Any, kwargs: Any, before: dict | None) -> None:
        # the op ran: start the phase it ran in, count its outputs (and the arguments it resized)
        if isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = out
        else:  # no tensor out (e.g. the profiler's record_function ops): nothing to allocate
            outs = ()
        if not (outs or before):
            return
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
        cat = _PHASE_CAT[phase]
        if kind & _ALIASES or before:
            self._track_outputs(func, outs, cat, args, kwargs, before)
        else:  # fresh storages only
            for o in outs:
                if isinstance(o, torch.Tensor):
                    self._track_fresh(o, cat)
                elif isinstance(o, (tuple, list)):
                    for oo in o:
                        if isinstance(oo, torch.Tensor):
                            self._track_fresh(oo, cat)

    def _track_outputs(self, func: Any, outs: Any, cat: int, args: Any, kwargs: Any, before: dict | None) -> None:
        # the outputs of an op that may alias an argument or writes into one
        inputs = () if func in FRESH_ALIAS_OPS else None
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

    def _after_op(self) -> None:
        if self.resizes:
            self.sync_sizes()
        if self._hook is not None and self._hook() is False:
            return
        total = self._total
        frames = self._frame_stack  # _ModuleFrames.see, inlined (it runs after every op)
        if frames and total > frames[-1][1]:
            frames[-1][1] = total
        phase = self._phase
        if total > self._phase_peak[phase]:
            if self._phase_peak[phase] < 0:
                self._phase_order.append(phase)
            self._phase_peak[phase] = total
            if total > self._peak_total:
                self._peak_total = total
                self._peak = (tuple(self._cur), self._ops, phase, frames[-1][0] if frames else None)
        if self._dirty and self._record:
            ev = self._events
            ev.append(self._ops)
            ev.append(phase)
            ev += self._cur
        self._dirty = False

    def _set_phase(self, phase: int) -> None:
        if self._phase == _BWD:
            self._frames.end_backward()
        self._phase = phase
        self._dirty = True

    def _root_forward_starts(self) -> None:
        if not self._in_opt and self._phase != _FWD:
            self._set_phase(_FWD)

    # ------------------------------------------------------------------ hooks outside the dispatcher
    def _install_hooks(self) -> None:
        # the optimizer step's global pre/post hooks (the optimizer phase and its state), the model's
        # module frames, and a post-accumulate hook on every trainable parameter (the gradients)
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
            self._frames.install(self.model)
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
        # UntypedStorage.resize_ is a storage method, not an op: no dispatch mode sees it, so it is
        # wrapped while the tracker is entered (resizes=True)
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

    def _on_resize(self, st: torch.UntypedStorage, old: int) -> None:
        # UntypedStorage.resize_ ran: charge the change now
        key = st._cdata
        e = self._live.get(key)
        if e is not None and e() is st:
            self._resize_entry(e, st.nbytes())
            return
        dev = st.device.type
        if self._device_type is not None and dev != self._device_type:
            return
        cat = _O if self._in_opt else (_A if self._phase in (_FWD, _BWD) else _X)
        self._new_entry(st, key, dev, cat, self.allocated_bytes(old, dev))

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "MemoryTracker":
        if self._depth == 0:
            self._slow_after = bool(self.resizes or self._hook is not None)
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
            self._frames.remove()
            if self._orig_resize is not None:
                torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
                self._orig_resize = None
            self._in_opt = 0
            if self._phase != _OTH:
                self._set_phase(_OTH)
            self._track_state()  # grads / optimizer state created at the very end get their label
            self._dirty = True
            self._after_op()
            self._end = tuple(self._cur)

    # ------------------------------------------------------------------ results
    @property
    def peak_bytes(self) -> int:
        """Largest total of live tracked bytes seen after any op (or at enter/exit)."""
        return self._peak_total

    @property
    def current_bytes(self) -> int:
        """Tracked bytes alive right now (storages freed after the block are subtracted too)."""
        return self._total

    @property
    def peak_phase(self) -> str:
        """The phase running at the peak."""
        return PHASES[self._peak[2]]

    @property
    def peak_module(self) -> str | None:
        """Qualified name of the innermost module running at the peak ("" is the model itself)."""
        return self._peak[3]

    @property
    def peak_event(self) -> int:
        """The index of the op after which the peak was reached."""
        return self._peak[1]

    @property
    def module_peaks(self) -> dict[str, int]:
        """Qualified module name -> peak total bytes seen while it ran (forward or backward)."""
        return self._frames.module_peaks()

    def breakdown(self, at: str = "peak") -> dict[str, int]:
        """Bytes per category (every one of :data:`CATEGORIES`) at ``"peak"`` or at the ``"end"``
        of the block (now, if still inside).

        Raises:
            ValueError: ``at`` is neither.
        """
        check_choice("at", at, BREAKDOWN_AT)
        counts = self._peak[0] if at == "peak" else (self._end if self._end is not None else self._cur)
        return dict(zip(CATEGORIES, counts))

    @property
    def timeline(self) -> list[Event]:
        """``Event(index, phase, bytes)`` after each op that changed something (and at enter/exit)."""
        ev, w = self._events, _EVENT_WIDTH
        # events are only ever appended: built once per length (an estimate reads it three or four times)
        n, built = self._timeline_memo
        if n != len(ev):
            built = [Event(ev[i], PHASES[ev[i + 1]], dict(zip(CATEGORIES, ev[i + 2:i + w])))
                     for i in range(0, len(ev), w)]
            self._timeline_memo = (len(ev), built)
        return list(built)

    def phase_peaks(self) -> dict[str, int]:
        """Peak total bytes in each phase that occurred, in the order the phases first occurred (kept
        after every op, so with ``timeline=False`` too; equal to ``phase_peaks(self.timeline)``)."""
        return {PHASES[p]: self._phase_peak[p] for p in self._phase_order}

    def report(self, top: int = 5) -> str:
        """A text table (:func:`memlab.profiler.format_report`): categories at the peak and at the
        end, phase peaks, the ``top`` modules."""
        return format_report(self, top)

    def __repr__(self) -> str:
        return f"MemoryTracker(peak={format_bytes(self.peak_bytes)}, current={format_bytes(self.current_bytes)})"

    def plot(self, ax: Any = None, title: str | None = None, unit: str = "MiB"):
        """Stacked-area timeline by category, phases shaded, the peak marked, on ``ax`` (a matplotlib
        Axes, or None for a new figure) in ``unit`` (``"B"``, ``"KiB"``, ``"MiB"`` or ``"GiB"``).

        Returns:
            The Axes.
        """
        ev, w = self._events, _EVENT_WIDTH
        events = [tuple(ev[i:i + w]) for i in range(0, len(ev), w)]
        return plot_timeline(events, self.peak_event, self.peak_bytes, ax=ax, title=title, unit=unit)
