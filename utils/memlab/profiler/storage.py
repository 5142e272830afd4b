"""What the tracker counts and hands back: the vocabulary, live storages and the timeline's events.

The vocabulary is :mod:`memlab.core.vocab`'s: a storage is in exactly one of ``CATEGORIES``, an
op runs in one of ``PHASES``.
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch

from memlab.core.vocab import CATEGORIES, PHASES

__all__ = ["CATEGORIES", "PHASES", "BREAKDOWN_AT", "LiveStorage", "Event", "FRESH_ALIAS_OPS",
           "optimizer_tensors", "tensors_in", "phase_peaks"]

BREAKDOWN_AT: tuple[str, ...] = ("peak", "end")


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


#: ops that alias an input born outside the dispatcher an instant before, inside the block:
#: ``torch.tensor(...)`` builds its tensor in C++ and hands it to ``lift_fresh``, so the storage
#: is new even though the op returns an alias of its input (:mod:`memlab.profiler.timeline` applies the
#: same rule)
FRESH_ALIAS_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in ("lift_fresh", "lift") if hasattr(torch.ops.aten, name))


def tensors_in(obj: Any, depth: int = 0, out: list | None = None) -> list[torch.Tensor]:
    """The tensors in ``obj``: a tensor, or tuples, lists and dicts of them, three levels deep at
    most (an op's arguments or outputs, a module's output, an optimizer's per-parameter state).

    Args:
        depth: how deep the walk already is (callers leave it at 0).
        out: a list to append the tensors to (a new one by default); it is returned.
    """
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3:
        if isinstance(obj, (tuple, list)):
            for o in obj:
                tensors_in(o, depth + 1, out)
        elif isinstance(obj, dict):
            for o in obj.values():
                tensors_in(o, depth + 1, out)
    return out


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer holds, all counted as ``optimizer``: those in ``optimizer.state``,
    then those its ``extra_state_tensors()`` method returns, if it has one (buffers kept outside
    ``state``: memlab.offload's OffloadedAdamW keeps its host gradient slots and pinned staging there).
    """
    out: list[torch.Tensor] = []
    for st in optimizer.state.values():  # tensors_in(st) for each, its first level inlined
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    out.append(v)
                elif isinstance(v, (tuple, list, dict)):
                    tensors_in(v, 1, out)
        else:
            tensors_in(st, 0, out)
    extra = getattr(optimizer, "extra_state_tensors", None)
    if callable(extra):
        out += [t for t in extra() if isinstance(t, torch.Tensor)]
    return out


class Event(NamedTuple):
    """One point of the timeline: the state after dispatched op number ``index``."""

    index: int
    phase: str
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        """The bytes of all categories together."""
        return sum(self.bytes.values())


def phase_peaks(timeline: Iterable[Any]) -> dict[str, int]:
    """Peak total bytes per phase of a timeline, phases in the order they first occur.

    Args:
        timeline: ``(index, phase, bytes)`` items (such as :class:`Event`), where ``bytes`` is a
            dict category -> bytes or a total.
    """
    out: dict[str, int] = {}
    for ev in timeline:
        _, phase, by_cat = ev[0], ev[1], ev[2]
        total = sum(by_cat.values()) if isinstance(by_cat, dict) else int(by_cat)
        if total > out.get(phase, -1):
            out[phase] = total
    return out
