"""What one rank holds: its bytes of parameters, gradients and optimizer state, and a tracker for them.

Under FSDP2 a parameter is a DTensor whose reported size is the global one; the bytes a rank
holds are those of its local shard, which is what these count (as PyTorch's own
``torch.distributed._tools.mem_tracker`` does).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlab.distributed.zero import ZeroOptimizer

__all__ = ["rank_tracker", "rank_bytes"]


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # a DTensor: the bytes are its local shard's
    return local if isinstance(local, torch.Tensor) else t


def rank_tracker(model: nn.Module | None = None, optimizer: Any = None, *, resizes: bool | None = None,
                 **kwargs: Any):
    """A :class:`memlab.profiler.MemoryTracker` for one rank.

    DTensors (FSDP2's sharded parameters, their gradients and optimizer state) count their local
    shard, not the global size their wrapper reports; a :class:`ZeroOptimizer` is tracked through
    its inner optimizer.

    FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes (and regrows it before the
    next all-gather), which no op returns: with ``resizes`` the tracker watches
    ``UntypedStorage.resize_`` and re-reads every live storage's size after each op
    (``MemoryTracker(resizes=True)``), so those frees and regrowths count when they happen (slower:
    a pass over the live storages per op).

    Args:
        optimizer: a ``torch.optim`` optimizer, a :class:`ZeroOptimizer`, or None.
        resizes: watch storage resizes (None: when ``model`` holds DTensors).
        **kwargs: passed to ``MemoryTracker``.
    """
    from memlab.profiler import MemoryTracker  # the profiler is heavy; a launch need not import it

    if resizes is None:
        resizes = model is not None and any(hasattr(p, "_local_tensor") for p in model.parameters())

    class RankMemoryTracker(MemoryTracker):
        def counted_tensor(self, t: torch.Tensor) -> torch.Tensor:
            return _unwrap(t)

    inner = optimizer.optim if isinstance(optimizer, ZeroOptimizer) else optimizer
    return RankMemoryTracker(model, inner, resizes=resizes, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def rank_bytes(model: nn.Module | None = None, optimizer: Any = None) -> dict[str, int]:
    """Bytes this rank holds, each storage counted once (a view or a DTensor's local shard counts its storage).

    ``optimizer`` may be a ``torch.optim`` optimizer or a :class:`ZeroOptimizer` (its inner optimizer
    and flat buffers). Returns ``{"parameters": bytes, "gradients": bytes, "optimizer": bytes}``.
    """
    seen: set[int] = set()
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}

    def add(key: str, t: torch.Tensor | None) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        st = _local(t).untyped_storage()
        if st.data_ptr() in seen and st.nbytes():
            return
        seen.add(st.data_ptr())
        out[key] += st.nbytes()

    inner = optimizer.optim if isinstance(optimizer, ZeroOptimizer) else optimizer
    params: list[torch.Tensor] = list(model.parameters()) if model is not None else []
    if inner is not None:
        params += [p for g in inner.param_groups for p in g["params"]]
    for p in params:
        add("parameters", p)
    if isinstance(optimizer, ZeroOptimizer):
        add("gradients", optimizer.flat_grad)
        add("gradients", optimizer.shard_grad)
    for p in params:
        add("gradients", p.grad)
    if inner is not None:
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    add("optimizer", v)
    return out
