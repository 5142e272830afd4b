"""Replaying a training step's allocations through :mod:`memlab.estimate.caching_allocator`: reserved memory and
nvidia-smi's figure for a sequence of events (:func:`estimate_reserved`), and the events of a traced step
(:class:`AllocationLog`, filled by the estimator's tracker) rebuilt into a run of several steps
(:func:`training_events`), as ``torch.cuda.max_memory_reserved`` sees a run from the model's load on."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

from memlab.core.validation import check_int, invalid
from memlab.estimate.caching_allocator import AllocatorConfig, CachingAllocatorModel

__all__ = ["ReplayResult", "replay", "ReservedEstimate", "estimate_reserved", "AllocationLog", "training_events"]


@dataclass
class ReplayResult:
    """What a replay reached: the peaks of ``torch.cuda.memory_stats`` and the state at the allocated peak.

    ``fragmentation_bytes`` is reserved minus allocated at the moment allocated peaked (cached, unused bytes);
    ``rounding_bytes`` is allocated minus requested there (512-byte rounding and unsplit remainders).
    """

    max_allocated: int
    max_reserved: int
    max_requested: int
    reserved_at_peak: int
    allocated_at_peak: int
    requested_at_peak: int
    segments: int
    retries: int
    events: int
    config: AllocatorConfig = field(default_factory=AllocatorConfig)

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved minus allocated at the allocated peak."""
        return self.reserved_at_peak - self.allocated_at_peak

    @property
    def rounding_bytes(self) -> int:
        """Allocated minus requested at the allocated peak."""
        return self.allocated_at_peak - self.requested_at_peak


def replay(events: Iterable[tuple], config: AllocatorConfig | str | None = None, *,
           capacity_bytes: int | None = None) -> ReplayResult:
    """Replay allocation and free events through :class:`CachingAllocatorModel`.

    Args:
        events: in time order, ``("alloc", key, nbytes)`` or ``("alloc", key, nbytes, stream)`` and
            ``("free", key)``; a key is any hashable naming one allocation while it is live.
        config: an :class:`AllocatorConfig`, a ``PYTORCH_CUDA_ALLOC_CONF`` string, or None (PyTorch's defaults).
        capacity_bytes: what the allocator may reserve; None: no limit (nothing is ever freed to the driver).

    Raises:
        ValueError: a malformed event (named by its position), a key allocated twice or freed while not live.
        AllocatorOutOfMemory: the sequence does not fit ``capacity_bytes``.
    """
    if isinstance(config, str):
        config = AllocatorConfig.parse(config)
    model = CachingAllocatorModel(config, capacity_bytes)
    handles: dict[Any, int] = {}
    peak = (0, 0, 0)
    n = 0
    for n, ev in enumerate(events, 1):
        kind = ev[0] if isinstance(ev, tuple) and ev else None
        if kind == "alloc" and len(ev) in (3, 4):
            if ev[1] in handles:
                raise invalid(f"events[{n - 1}]", ev, f"an alloc of a key that is not live ({ev[1]!r} is)")
            try:
                handles[ev[1]] = model.malloc(ev[2], ev[3] if len(ev) == 4 else 0)
            except ValueError as exc:
                raise invalid(f"events[{n - 1}]", ev, f"('alloc', key, nbytes >= 0[, stream >= 0]): {exc}") from None
            if model.allocated > peak[0]:
                peak = (model.allocated, model.reserved, model.requested)
        elif kind == "free" and len(ev) == 2:
            if ev[1] not in handles:
                raise invalid(f"events[{n - 1}]", ev, "a free of a live key")
            model.free(handles.pop(ev[1]))
        else:
            raise invalid(f"events[{n - 1}]", ev, "('alloc', key, nbytes), ('alloc', key, nbytes, stream) or "
                                                  "('free', key)")
    return ReplayResult(max_allocated=model.max_allocated, max_reserved=model.max_reserved,
                        max_requested=model.max_requested, reserved_at_peak=peak[1], allocated_at_peak=peak[0],
                        requested_at_peak=peak[2], segments=model.segments, retries=model.retries, events=n,
                        config=model.config)


@dataclass
class ReservedEstimate:
    """Reserved memory and nvidia-smi's figure predicted by a replay (:func:`estimate_reserved`)."""

    replay: ReplayResult
    context_bytes: int
    context_source: str

    @property
    def reserved_bytes(self) -> int:
        """The predicted ``torch.cuda.max_memory_reserved``."""
        return self.replay.max_reserved

    @property
    def allocated_bytes(self) -> int:
        """The predicted ``torch.cuda.max_memory_allocated`` (blocks, unsplit remainders included)."""
        return self.replay.max_allocated

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved minus allocated at the allocated peak."""
        return self.replay.fragmentation_bytes

    @property
    def nvidia_smi_bytes(self) -> int:
        """What nvidia-smi shows for the process: reserved plus the CUDA context."""
        return self.reserved_bytes + self.context_bytes

    @property
    def note(self) -> str:
        """The estimate's note: how the reserved figure was made, and what it came to."""
        from memlab.core.units import format_bytes

        return (f"reserved: the traced allocations replayed through a model of PyTorch's CUDA caching allocator "
                f"(memlab.estimate.caching_allocator: the model's storages, the cuBLAS workspaces, then "
                f"three steps, the first creating the optimizer state; {self.replay.config.describe()}): "
                f"max_memory_reserved {format_bytes(self.reserved_bytes)}, "
                f"{format_bytes(self.fragmentation_bytes)} cached at the allocated peak; nvidia-smi adds the CUDA "
                f"context, {format_bytes(self.context_bytes)} ({self.context_source})")

    def describe(self) -> str:
        """One line: allocated, reserved, the fragmentation and nvidia-smi's figure with its context."""
        from memlab.core.units import format_bytes

        return (f"allocator model: allocated {format_bytes(self.allocated_bytes)}, reserved "
                f"{format_bytes(self.reserved_bytes)} (fragmentation at the peak "
                f"{format_bytes(self.fragmentation_bytes)}), nvidia-smi {format_bytes(self.nvidia_smi_bytes)} "
                f"with a {format_bytes(self.context_bytes)} CUDA context ({self.context_source})")


def estimate_reserved(events: Iterable[tuple], config: AllocatorConfig | str | None = None, *,
                      context_bytes: int | None = None, context_source: str | None = None,
                      capacity_bytes: int | None = None) -> ReservedEstimate:
    """Predict ``max_memory_reserved`` and nvidia-smi's figure for a sequence of allocations (:func:`replay`).

    Args:
        events: as :func:`replay` takes them.
        config: the allocator's options (:class:`AllocatorConfig` or a ``PYTORCH_CUDA_ALLOC_CONF`` string).
        context_bytes: the CUDA context nvidia-smi adds; default :data:`memlab.core.gpus.CONTEXT_RESERVE_BYTES`
            (its source is :data:`memlab.core.gpus.CONTEXT_RESERVE_SOURCE`).
        context_source: where ``context_bytes`` comes from (required wording when you give one: default "given").
        capacity_bytes: as :func:`replay`.
    """
    from memlab.core import gpus

    if context_bytes is None:
        context_bytes, source = gpus.CONTEXT_RESERVE_BYTES, gpus.CONTEXT_RESERVE_SOURCE
    else:
        check_int("context_bytes", context_bytes, minimum=0)
        source = "given"
    if context_source is not None:
        if not isinstance(context_source, str) or not context_source:
            raise invalid("context_source", context_source, "a non-empty string or None")
        source = context_source
    return ReservedEstimate(replay(events, config, capacity_bytes=capacity_bytes), context_bytes, source)


# ---------------------------------------------------------------- the estimator's hook: a tracked step's events
class AllocationLog:
    """The storages a tracked step allocates and frees, in order, for :func:`training_events`.

    :func:`memlab.estimate.attention.make_tracker`'s tracker feeds it: :meth:`start` with the storages alive when
    tracking starts (the model's, the optimizer's), :meth:`see` with every op's outputs, :meth:`mark` when the
    optimizer step starts, :meth:`transient` for scratch a kernel holds while it runs. A storage's free is its
    last reference dying (a weak reference's callback), as the caching allocator gets the block back.
    """

    def __init__(self) -> None:
        self.initial: list[tuple[int, int, str]] = []  # (id, nbytes, category) alive at the start
        self.events: list[tuple] = []  # ("alloc", id, nbytes), ("free", id), ("mark", name)
        self._live: dict[int, tuple[int, Any, int]] = {}  # storage key -> (id, weak reference, nbytes)
        self._ids = itertools.count()

    def _add(self, st: Any, nbytes: int) -> int:
        import weakref

        i = next(self._ids)
        key = st._cdata
        log = self.events

        def freed(ref: Any, key: int = key, i: int = i) -> None:
            e = self._live.get(key)
            if e is not None and e[0] == i:
                del self._live[key]
            log.append(("free", i))

        self._live[key] = (i, weakref.ref(st, freed), nbytes)
        return i

    def start(self, storages: Iterable[tuple[Any, str]]) -> None:
        """Note the storages alive now (``(untyped storage, category)`` pairs) as the step's starting state."""
        for st, category in storages:
            n = st.nbytes()
            if n and st._cdata not in self._live:
                self.initial.append((self._add(st, n), n, category))

    def see(self, out: Any, args: Any, kwargs: Any) -> None:
        """Note the storages an op returned (``out``) that no earlier op made and that are not one of its
        arguments' (a view of memory born before tracking)."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs: set[int] | None = None
        for o in outs:
            if isinstance(o, (tuple, list)):
                for oo in o:
                    inputs = self._see_one(oo, args, kwargs, inputs)
            else:
                inputs = self._see_one(o, args, kwargs, inputs)

    def _see_one(self, o: Any, args: Any, kwargs: Any, inputs: set[int] | None) -> set[int] | None:
        try:
            st = o.untyped_storage()
        except (AttributeError, NotImplementedError, RuntimeError, TypeError):
            return inputs
        if o.device.type == "meta":
            return inputs
        key, n = st._cdata, st.nbytes()
        e = self._live.get(key)
        if e is not None and e[1]() is st:
            if n != e[2]:  # resized in place: the allocator frees the old block and takes a new one
                self.events.append(("free", e[0]))
                del self._live[key]
                if n:
                    self.events.append(("alloc", self._add(st, n), n))
            return inputs
        if inputs is None:
            from memlab.profiler.storage import tensors_in

            inputs = set()
            for t in tensors_in((args, kwargs)):
                try:
                    inputs.add(t.untyped_storage()._cdata)
                except (NotImplementedError, RuntimeError, TypeError):
                    pass
        if n and key not in inputs:
            self.events.append(("alloc", self._add(st, n), n))
        return inputs

    def mark(self, name: str) -> None:
        """Note a moment of the step (``"optimizer"``: the optimizer step starts)."""
        self.events.append(("mark", name))

    def transient(self, nbytes: int) -> None:
        """Note ``nbytes`` allocated and freed at once (a kernel's scratch)."""
        i = next(self._ids)
        self.events += [("alloc", i, nbytes), ("free", i)]


def training_events(log: AllocationLog, *, steps: int = 3, workspaces: Iterable[int] = (),
                    host_scalars: bool = True) -> list[tuple]:
    """The allocations of a training run rebuilt from one tracked steady step (``log``): the model's storages, the
    ``workspaces`` (bytes each: the cuBLAS workspaces, optimizer state counted beside the trace), then ``steps`` steps, the first creating the optimizer state where the
    optimizer step starts (as PyTorch's optimizers create it lazily), each later one freeing what the step before
    left (``zero_grad(set_to_none=True)``: the gradients) before it runs. ``host_scalars``: leave out optimizer
    state of at most 8 bytes (AdamW's step counts live on the host unless ``capturable`` or ``fused``).

    Raises:
        ValueError: ``steps`` not an int >= 1.
    """
    check_int("steps", steps, minimum=1)
    base = [("alloc", ("p", i), n) for i, n, cat in log.initial if cat != "optimizer"]
    state = [("alloc", ("p", i), n) for i, n, cat in log.initial
             if cat == "optimizer" and not (host_scalars and n <= 8)]
    out = base + [("alloc", ("ws", j), int(n)) for j, n in enumerate(workspaces)]
    alive = {ev[1] for ev in out}
    added = not any(ev[0] == "mark" and ev[1] == "optimizer" for ev in log.events)
    if added:  # no optimizer step seen (an optimizer run inside backward): the state exists from the start
        out += state
        alive |= {ev[1] for ev in state}
    left: list[Any] = []
    for k in range(steps):
        out += [("free", key) for key in left]
        alive -= set(left)
        made: dict[Any, None] = {}
        for ev in log.events:
            if ev[0] == "mark":
                if ev[1] == "optimizer" and not added:
                    out += state
                    alive |= {s[1] for s in state}
                    added = True
                continue
            key = (k, ev[1]) if ev[0] == "alloc" or (k, ev[1]) in made else ("p", ev[1])
            if ev[0] == "alloc":
                out.append(("alloc", key, ev[2]))
                made[key] = None
            elif key in made:
                out.append(("free", key))
                del made[key]
            elif key in alive:
                out.append(("free", key))
                alive.discard(key)
        left = list(made)
    return out
