"""Communication: the bytes each rank sends per step, by the paper's formula and counted as it happens.

Rajbhandari et al. 2020, sec. 7: stages 0-2 move 2 P elements per step (an all-reduce is a
reduce-scatter plus an all-gather); stage 3 moves 3 P (an extra all-gather in backward). A
``TorchDispatchMode`` sees every c10d collective, ours and FSDP2's alike, and counts it as a ring
algorithm sends it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from memlab.core.validation import check_choice, check_positive_int
from memlab.distributed.zero import STAGES

__all__ = ["comm_volume_bytes", "CommCounter"]


def comm_volume_bytes(n_params: int, world_size: int, stage: int, *, bytes_per_element: int = 2) -> dict[str, float]:
    """Bytes each rank sends per step, with ring collectives (Rajbhandari et al. 2020, section 7).

    A ring reduce-scatter or all-gather of P elements sends ``(N - 1)/N x P`` elements per rank; an
    all-reduce is both. Stages 0-2: reduce-scatter (or all-reduce) of the gradients and all-gather
    of the parameters: ``2 (N-1)/N P``. Stage 3: all-gather of the parameters in forward and again
    in backward, reduce-scatter of the gradients: ``3 (N-1)/N P`` (1.5x). Returns bytes per
    collective kind, and ``total``.

    Raises:
        ValueError: an unknown stage or a world size < 1.
    """
    check_choice("stage", stage, STAGES)
    check_positive_int("world_size", world_size)
    one = (world_size - 1) / world_size * n_params * bytes_per_element
    if stage == 3:
        parts = {"all-gather (forward)": one, "all-gather (backward)": one, "reduce-scatter (gradients)": one}
    elif stage == 0:
        parts = {"all-reduce (gradients) = reduce-scatter + all-gather": 2 * one}
    else:
        parts = {"reduce-scatter (gradients)": one, "all-gather (updated parameters)": one}
    parts["total"] = sum(parts.values())
    return parts


class CommCounter:
    """Count the bytes this rank sends in collectives while the ``with`` block runs.

    A ``TorchDispatchMode`` sees the c10d ops (``allreduce_``, ``reduce_``, ``_reduce_scatter_base_``,
    ``_allgather_base_``, ``broadcast_``, the list forms ``allgather_`` / ``reduce_scatter_``): ours and
    FSDP2's alike. Bytes sent per rank are counted as a ring algorithm sends them (ZeRO, sec. 7): a
    reduce-scatter or an all-gather of a buffer of B bytes (the whole buffer: the all-gather's output,
    the reduce-scatter's input) ``(N-1)/N B``, an all-reduce ``2 (N-1)/N B``; a ``reduce`` to one owner
    is counted as its piece of a reduce-scatter, ``(N-1)/N B``; a broadcast ``(N-1)/N B``; a barrier
    nothing. Any other c10d op (all-to-all, gather, scatter, send / recv ...) raises ``ValueError``
    naming it, before it runs on any rank, instead of being counted as free. ``sent`` maps a kind to
    bytes, ``calls`` to the number of collectives, ``total`` sums ``sent``.

    Args:
        world_size: N for the ring cost (None: the default group's size when a collective runs).
    """

    KINDS = {"allreduce_": "all-reduce", "allreduce_coalesced_": "all-reduce",
             "reduce_": "reduce (pieces of a reduce-scatter)",
             "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_tensor_coalesced_": "reduce-scatter",
             "reduce_scatter_": "reduce-scatter",
             "_allgather_base_": "all-gather", "allgather_into_tensor_coalesced_": "all-gather",
             "allgather_": "all-gather",
             "broadcast_": "broadcast", "barrier": "barrier"}
    # ops in the c10d namespace that send nothing
    IGNORED = frozenset({"check_for_nan"})

    def __init__(self, world_size: int | None = None) -> None:
        self.world_size = world_size
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._mode: Any = None

    @property
    def total(self) -> float:
        """The bytes sent in all collectives counted so far."""
        return sum(self.sent.values())

    def _count(self, name: str, args: tuple) -> None:
        if name in self.IGNORED:
            return
        kind = self.KINDS.get(name)
        if kind is None:
            known = ", ".join(sorted(self.KINDS))
            raise ValueError(f"CommCounter: collective c10d::{name} is not one it can count (known: {known}); "
                             "it refuses to count it as free: use a reduce-scatter, all-gather, all-reduce, reduce or "
                             "broadcast, or teach CommCounter its ring cost")
        if kind == "barrier":
            self.calls[kind] = self.calls.get(kind, 0) + 1
            return
        # the full buffer: the largest tensor, or a list of per-rank pieces (allgather_'s output list,
        # reduce_scatter_'s input list, allreduce_coalesced_'s tensors) summed
        sizes = [a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):
                ts = [t for t in a if isinstance(t, torch.Tensor)]
                if ts:
                    sizes.append(sum(t.numel() * t.element_size() for t in ts) if name == "allreduce_coalesced_"
                                 else max(t.numel() * t.element_size() for t in ts))
                for inner in a:
                    if isinstance(inner, (list, tuple)):
                        sizes.append(sum(t.numel() * t.element_size() for t in inner if isinstance(t, torch.Tensor)))
        if not sizes:
            return
        n = self.world_size or dist.get_world_size()
        nbytes = max(sizes)
        factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
        self.sent[kind] = self.sent.get(kind, 0.0) + factor * nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def __enter__(self) -> "CommCounter":
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "c10d" in func.namespace:
                    counter._count(func._schema.name.split("::")[-1], args)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
