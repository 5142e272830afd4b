"""Activation offloading: saved tensors go to (pinned) host memory in forward and come back in
backward (compare ``torch.autograd.graph.save_on_cpu``); the inputs of checkpointed layers kept in
host memory (:func:`offload_checkpoints`, chapter 09); and counting what autograd saves.

With every decoder layer checkpointed, what a step keeps on the device through forward is each
layer's input, ``L x batch x seq x hidden`` elements (Chen et al. 2016). Offloading those inputs
to host memory, copied on a side stream while the next layer computes and brought back one layer
ahead of the recomputation in backward, leaves about two of them on the device: the approach of
torchtune's ``OffloadActivations`` (``torchtune.training.OffloadActivations``, with
``enable_activation_offloading``) and of Unsloth's offloaded gradient checkpointing for long contexts.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from memlab.accounting import saved_activation_bytes, saved_storages
from memlab.checkpoint.layers import disable, enable
from memlab.checkpoint.recompute import check_callable, checkpoint
from memlab.core.validation import check_bool, check_choice

__all__ = ["OffloadStats", "offload_activations", "count_saved_tensors", "saved_activation_bytes",
           "offload_checkpoints", "OffloadedCheckpoints", "CheckpointOffloadStats", "HOST_DEVICES"]


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

    Raises:
        ValueError: ``min_bytes`` < 0.
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

    Raises:
        ValueError: ``fn`` is not callable.
    """
    check_callable("count_saved_tensors", fn)
    with torch.enable_grad():
        seen = saved_storages(fn, *args, **kwargs)
    return len(seen), sum(seen.values())



# ----------------------------------------------------------------------------- checkpoint inputs
#: where :func:`offload_checkpoints` keeps the layer inputs: "cpu" (the host), or "meta" (their shapes
#: only, for a trace on fake tensors that counts host bytes apart: :mod:`memlab.estimate`)
HOST_DEVICES = ("cpu", "meta")
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


@dataclass
class CheckpointOffloadStats:
    """What :func:`offload_checkpoints` moved, counted on every device.

    On a CPU the device *is* the host: the input's copy lives in the same memory as the input it
    replaces, so nothing is saved; the bytes are counted all the same (what a CUDA run moves over
    PCIe), ``same_memory`` says so.
    """

    offloaded_tensors: int = 0   # layer inputs copied to the host in forward
    offloaded_bytes: int = 0     # their bytes
    fetched_bytes: int = 0       # bytes brought back for the recomputation in backward
    prefetched: int = 0          # of those fetches, how many were started one layer ahead
    host_bytes: int = 0          # host copies alive now
    peak_host_bytes: int = 0     # the most alive at once
    same_memory: bool = False    # a layer input was on the CPU: its "host" copy saved nothing


class _HostCopy:
    # One checkpointed call's input: the tensor itself while the forward runs (``live``), then its
    # host copy (``host``; None under host "meta"); ``ready`` a device copy fetched ahead of need.
    __slots__ = ("live", "host", "shape", "dtype", "device", "requires_grad", "nbytes", "prev", "index",
                 "d2h", "ready", "ready_event", "stats", "__weakref__")

    def __init__(self, x: torch.Tensor, index: int, stats: CheckpointOffloadStats) -> None:
        self.live: torch.Tensor | None = x
        self.host: torch.Tensor | None = None
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.requires_grad = x.requires_grad
        self.nbytes = x.numel() * x.element_size()
        self.prev: Any = None
        self.index = index
        self.d2h: Any = None
        self.ready: torch.Tensor | None = None
        self.ready_event: Any = None
        self.stats = stats
        stats.offloaded_tensors += 1
        stats.offloaded_bytes += self.nbytes
        stats.host_bytes += self.nbytes
        stats.peak_host_bytes = max(stats.peak_host_bytes, stats.host_bytes)

    def __del__(self) -> None:
        self.stats.host_bytes -= self.nbytes


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class OffloadedCheckpoints:
    """The handle :func:`offload_checkpoints` returns: ``layers`` (the indices wrapped), ``stats``
    (:class:`CheckpointOffloadStats`), :meth:`remove`."""

    def __init__(self, model: nn.Module, pin_memory: bool, prefetch: bool, host_device: str) -> None:
        self.model = model
        self.pin_memory, self.prefetch, self.host_device = pin_memory, prefetch, host_device
        self.stats = CheckpointOffloadStats()
        self.layers: list[int] = []
        self._streams: dict[Any, Any] = {}
        self._last: Any = None  # weakref to the latest layer input offloaded (the chain of one forward)

    # -- the host side
    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _offload(self, x: torch.Tensor, index: int) -> _HostCopy:
        box = _HostCopy(x, index, self.stats)
        last = self._last() if self._last is not None else None
        if last is not None and last.index == index - 1:
            box.prev = weakref.ref(last)  # the layer recomputed just before this one in backward
        self._last = weakref.ref(box)
        if self.host_device == "meta":
            if not _is_fake(x):
                raise ValueError("offload_checkpoints: host_device='meta' keeps no values; allowed only on fake "
                                 "tensors (a memlab.estimate trace); use host_device='cpu'")
            return box
        if x.device.type == "cpu":
            self.stats.same_memory = True
        pin = self.pin_memory and x.device.type == "cuda"
        box.host = torch.empty_like(x, device="cpu", pin_memory=pin)
        if pin:  # asynchronous on a side stream; the allocator keeps x's block until the copy is done
            stream = self._side_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                box.host.copy_(x, non_blocking=True)
                box.d2h = torch.cuda.Event()
                box.d2h.record(stream)
            x.record_stream(stream)
        else:
            box.host.copy_(x)
        return box

    def _copy_in(self, box: _HostCopy, ahead: bool) -> torch.Tensor:
        if box.host is None:  # host "meta": a fresh device buffer of the input's shape (a fake trace)
            return torch.empty(box.shape, dtype=box.dtype, device=box.device)
        if box.device.type == "cpu":  # the device is the host: nothing to copy
            return box.host
        if box.d2h is None:
            return box.host.to(box.device)
        if not ahead:
            torch.cuda.current_stream(box.device).wait_event(box.d2h)
            return box.host.to(box.device, non_blocking=True)
        stream = self._side_stream(box.device)
        with torch.cuda.stream(stream):
            t = box.host.to(box.device, non_blocking=True)  # after the D2H copy: the same stream
            box.ready_event = torch.cuda.Event()
            box.ready_event.record(stream)
        return t

    def _fetch(self, box: _HostCopy) -> torch.Tensor:
        # the input of one call of the layer: itself in forward, its copy brought back in backward
        if box.live is not None:
            return box.live
        t, box.ready = box.ready, None
        if t is None:
            t = self._copy_in(box, ahead=False)
        elif box.ready_event is not None:  # fetched ahead on the side stream: wait for it, then use it here
            current = torch.cuda.current_stream(box.device)
            current.wait_event(box.ready_event)
            t.record_stream(current)
            box.ready_event = None
        self.stats.fetched_bytes += box.nbytes
        prev = box.prev() if (self.prefetch and box.prev is not None) else None
        if prev is not None and prev.live is None and prev.ready is None:
            prev.ready = self._copy_in(prev, ahead=True)  # the layer before is recomputed next
            self.stats.prefetched += 1
        t = t.detach()
        return t.requires_grad_(box.requires_grad) if t.is_floating_point() else t

    # -- the layers
    def wrap(self, layer: nn.Module, index: int) -> None:
        """Give ``layer`` a forward that checkpoints it and keeps its input on the host."""
        forward = type(layer).forward.__get__(layer)

        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            _drop_empty_caches(kwargs, index)
            key = None if args else "hidden_states"
            x = args[0] if args else kwargs.pop("hidden_states", None)
            if not isinstance(x, torch.Tensor):
                if key is not None and x is not None:
                    kwargs[key] = x
                return checkpoint(forward, *args, **kwargs)
            rest = args[1:]
            box = self._offload(x, index)

            def call(box: _HostCopy, anchor: torch.Tensor, *rest: Any, **kw: Any) -> Any:
                t = self._fetch(box)
                return forward(t, *rest, **kw) if key is None else forward(*rest, hidden_states=t, **kw)

            # the anchor (0 bytes on x's device) tells checkpoint which device's RNG and autocast to replay
            out = checkpoint(call, box, x.new_empty(0), *rest, **kwargs)
            box.live = None  # the forward is done: only the host copy is kept
            return out

        layer.forward = run

    def remove(self) -> None:
        """The decoder layers run their own forward again (as :func:`memlab.checkpoint.disable` leaves them)."""
        disable(self.model)
        self.layers = []


def _drop_empty_caches(kwargs: dict, index: int) -> None:
    # a KV cache in training would keep every layer's keys and values (and be written twice): an empty
    # one is dropped, one that holds tokens refused (as memlab.checkpoint.enable does)
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is None:
            continue
        get = getattr(cache, "get_seq_length", None)
        if callable(get) and int(get()) > 0:
            raise ValueError(f"offload_checkpoints: decoder layer {index} got {name}= a KV cache that already holds "
                             f"tokens; a checkpointed layer runs twice and would write it twice; allowed with "
                             f"gradients on: use_cache=False and no past_key_values")
        kwargs[name] = None


def offload_checkpoints(model: nn.Module, *, pin_memory: bool = True, prefetch: bool = True,
                        host_device: str = "cpu") -> OffloadedCheckpoints:
    """Checkpoint every decoder layer of ``model`` and keep each layer's input in host memory.

    The layers are :func:`memlab.models.decoder_layers`; each one's forward runs under this chapter's
    :func:`memlab.checkpoint.checkpoint` (RNG and autocast replayed), and :func:`memlab.checkpoint.enable`
    sets the model up first (``use_cache`` off, transformers' own checkpointing off). What a checkpoint
    keeps is its input; here the input is copied to the host as soon as the layer has it and the device
    copy is dropped when the layer's forward returns (it is freed if nothing else holds it). In backward,
    the recomputation of a layer brings its input back; with ``prefetch`` it also starts bringing back
    the input of the layer before, which backward recomputes next. Gradients are those of plain
    checkpointing (the same values, recomputed from an exact copy).

    On CUDA the host copies are page-locked (``pin_memory``) and made on a side stream, overlapping the
    next layer's compute, and the fetches ahead of need run on the same stream; the device then holds
    about two layer inputs instead of one per layer, for PCIe traffic of twice the inputs' bytes per
    step. On a CPU the host is the device: the copy is a plain CPU tensor that replaces the input, so no
    memory is saved, but the code path and ``handle.stats`` (bytes moved, host bytes alive) are the same
    (``stats.same_memory`` is then True).

    Args:
        pin_memory: page-locked host copies on CUDA (asynchronous copies); ignored on a CPU.
        prefetch: bring back the previous layer's input while the current one is recomputed.
        host_device: "cpu", or "meta" to keep only the inputs' shapes: for a trace on fake tensors
            (:mod:`memlab.estimate`) whose host bytes are counted apart (refused on real tensors).

    Returns:
        An :class:`OffloadedCheckpoints` handle: ``stats``, ``layers``, ``remove()``.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: a flag that is not a bool, a bad ``host_device``, a KV cache holding tokens, a model
            without decoder layers.
    """
    check_bool("pin_memory", pin_memory)
    check_bool("prefetch", prefetch)
    check_choice("host_device", host_device, HOST_DEVICES)
    from memlab.models import decoder_layers

    enable(model)  # checks the model; use_cache off, transformers' checkpointing off; marks the layers
    handle = OffloadedCheckpoints(model, pin_memory, prefetch, host_device)
    for i, layer in enumerate(decoder_layers(model)):
        handle.wrap(layer, i)
        handle.layers.append(i)
    return handle
