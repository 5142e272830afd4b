"""What the tracker counts: storages, their categories and phases, and the timeline's events.

The vocabulary is :mod:`memlab.core.vocab`'s: a storage is in exactly one of ``CATEGORIES``, an
op runs in one of ``PHASES``. Inside the tracker they are small ints (indices into those tuples),
which keeps the per-op bookkeeping cheap.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import torch

from memlab.core.vocab import CATEGORIES, PHASES, Category, Phase

__all__ = ["CATEGORIES", "PHASES", "BREAKDOWN_AT", "LiveStorage", "Event", "FRESH_ALIAS_OPS",
           "optimizer_tensors", "tensors_in", "phase_peaks"]

BREAKDOWN_AT: tuple[str, ...] = ("peak", "end")

# category and phase indices (positions in CATEGORIES and PHASES), for the tracker's hot path
_P, _G, _O, _A, _X = (CATEGORIES.index(c.value) for c in (
    Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER, Category.ACTIVATIONS, Category.OTHER))
_FWD, _BWD, _OPT, _OTH = (PHASES.index(p.value) for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER))


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
#: ops that alias an input born outside the dispatcher an instant before, inside the block:
#: ``torch.tensor(...)`` builds its tensor in C++ and hands it to ``lift_fresh``, so the storage
#: is new even though the op returns an alias of its input (:mod:`memlab.profiler.timeline` applies the
#: same rule)
FRESH_ALIAS_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in ("lift_fresh", "lift") if hasattr(torch.ops.aten, name))


def tensors_in(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors in an op's or a module's output, or in an optimizer's per-parameter state.

    Args:
        obj: a tensor, or tuples, lists and dicts of them (three levels deep at most).
        depth: how deep the walk already is (callers leave it at 0).

    Returns:
        An iterator over the tensors found.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3:
        if isinstance(obj, (tuple, list)):
            for o in obj:
                yield from tensors_in(o, depth + 1)
        elif isinstance(obj, dict):
            for o in obj.values():
                yield from tensors_in(o, depth + 1)


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer holds, all counted as ``optimizer``.

    Args:
        optimizer: a ``torch.optim.Optimizer``; an ``extra_state_tensors()`` method, if it has
            one, names buffers kept outside ``state`` (memlab.offload's OffloadedAdamW: its host
            gradient slots and pinned staging).

    Returns:
        The tensors in ``optimizer.state``, then those ``extra_state_tensors()`` returns.
    """
    out = [t for st in optimizer.state.values() for t in tensors_in(st)]
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
    """Append the tensors in an op's arguments to ``out`` (three levels deep at most)."""
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
        """The bytes of all categories together."""
        return sum(self.bytes.values())


@dataclass(frozen=True)
class _Peak:
    total: int
    counts: tuple[int, ...]
    event: int
    phase: str
    module: str | None


def phase_peaks(timeline: Iterable[Any]) -> dict[str, int]:
    """Peak total bytes per phase of a timeline.

    Args:
        timeline: ``(index, phase, bytes)`` items (such as :class:`Event`), where ``bytes`` is a
            dict category -> bytes or a total.

    Returns:
        phase -> the highest total seen in it, phases in the order they first occur.
    """
    out: dict[str, int] = {}
    for ev in timeline:
        _, phase, by_cat = ev[0], ev[1], ev[2]
        total = sum(by_cat.values()) if isinstance(by_cat, dict) else int(by_cat)
        if total > out.get(phase, -1):
            out[phase] = total
    return out
