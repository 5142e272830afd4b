"""Activation offloading: saved tensors go to (pinned) host memory in forward and come back in
backward (compare ``torch.autograd.graph.save_on_cpu``), and counting what autograd saves."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from memlab.accounting import saved_activation_bytes, saved_storages
from memlab.checkpoint.recompute import check_callable

__all__ = ["OffloadStats", "offload_activations", "count_saved_tensors", "saved_activation_bytes"]


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

