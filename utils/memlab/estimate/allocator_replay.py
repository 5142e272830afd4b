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

__all__ = ["ReplayResult", "replay", "ReservedEstimate", "estimate_reserved", "AllocationLog", "training_events",
           "SnapshotStart", "snapshot_start", "SnapshotComparison", "compare_snapshot"]


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


# ---------------------------------------------------------------- checking the model against a real allocator's trace
@dataclass
class SnapshotStart:
    """The allocator's state when a CUDA memory snapshot's recording began, rebuilt from the snapshot
    (:func:`snapshot_start`).

    ``segments``: ``(address, size, small)`` of each segment held before the first event (at the end with no
    ``segment_alloc`` in the trace, or freed by a ``segment_free`` before any ``segment_alloc`` of it).
    ``live``: ``(address, block_size, requested_bytes)`` of each block live before the first event (freed in the
    trace with no ``alloc`` before, or live at the end with no ``alloc`` in the trace). ``notes``: the blocks whose
    size the data does not fix (a large-pool block freed in the trace may hold an unsplit remainder of at most
    1 MiB: taken as held, which changes allocated bytes only, as no large request fits such a remainder).
    """

    segments: list[tuple[int, int, bool]]
    live: list[tuple[int, int, int]]
    notes: list[str] = field(default_factory=list)

    @property
    def reserved_bytes(self) -> int:
        return sum(n for _, n, _ in self.segments)

    @property
    def allocated_bytes(self) -> int:
        return sum(n for _, n, _ in self.live)


def _trace(snapshot: Any, device: int) -> tuple[list[dict], list[dict]]:
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise invalid("snapshot", type(snapshot).__name__, "a CUDA memory snapshot dict (torch.cuda.memory._snapshot, "
                                                           "or memlab.profiler.explain.read_snapshot of a pickle)")
    check_int("device", device, minimum=0)
    segs = [s for s in snapshot["segments"] if int(s.get("device", 0)) == device]
    traces = snapshot.get("device_traces") or []
    trace = [e for e in (traces[device] if device < len(traces) else []) if isinstance(e, dict)]
    if not trace:
        raise invalid("snapshot", f"device {device}'s trace is empty", "a snapshot recorded with "
                                                                        "torch.cuda.memory._record_memory_history")
    return segs, trace


def snapshot_start(snapshot: dict, device: int = 0) -> SnapshotStart:
    """The segments and live blocks at the start of ``snapshot``'s trace on ``device`` (:class:`SnapshotStart`).

    A trace's ``alloc`` and ``free_*`` events carry the bytes requested (``orig_size`` / ``requested_size`` in
    ``CUDACachingAllocator.cpp``'s ``record_trace`` calls), not the block's size: a block freed in the trace that
    was live before it is sized by :func:`~memlab.estimate.caching_allocator.round_size`, and in the large pool up
    to the next block known to start in its segment while it was live when the gap is at most 1 MiB (the remainder
    ``should_split`` keeps whole).

    Raises:
        ValueError: not a snapshot with a trace for ``device``.
    """
    from memlab.estimate.caching_allocator import SMALL_SIZE, round_size

    segs, trace = _trace(snapshot, device)
    seg_end: dict[int, tuple[int, bool]] = {int(s["address"]): (int(s["total_size"]), s.get("segment_type") == "small")
                                            for s in segs}
    made = set()
    start_segs: dict[int, tuple[int, bool]] = {}
    for e in trace:
        a = e.get("action")
        if a == "segment_alloc":
            made.add(e["addr"])
        elif a == "segment_free" and e["addr"] not in made:
            start_segs[e["addr"]] = (int(e["size"]), int(e["size"]) == 2 * SMALL_SIZE)  # small: a 2 MiB segment
    for addr, (n, small) in seg_end.items():
        if addr not in made:
            start_segs[addr] = (n, small)
    ends = {}  # the blocks at the end, by address
    for s in segs:
        at = int(s["address"])
        for b in s.get("blocks", []):
            ends[at] = b
            at += int(b["size"])
    live: dict[int, list] = {}  # address -> [block size, requested, index freed or None]
    seen: set[int] = set()
    current: set[int] = set()
    starts_while: list[tuple[int, int]] = []  # (index, address) of every alloc in the trace
    for i, e in enumerate(trace):
        a, addr = e.get("action"), e.get("addr")
        if a == "alloc":
            seen.add(addr)
            current.add(addr)
            starts_while.append((i, addr))
        elif a == "free_requested" and addr not in current and addr not in live:
            live[addr] = [None, int(e["size"]), i]
        elif a == "free_completed":
            current.discard(addr)
    for addr, b in ends.items():
        if b.get("state") == "active_allocated" and addr not in current and addr not in live:
            live[addr] = [int(b["size"]), int(b.get("requested_size", b["size"])), None]
    notes = []

    def segment_of(addr: int) -> tuple[int, int, bool]:
        for s, (n, small) in start_segs.items():
            if s <= addr < s + n:
                return s, n, small
        raise invalid("snapshot", f"block {addr:#x} live before the trace", "a block inside a segment held then")

    for addr, rec in live.items():
        if rec[0] is not None:
            continue
        s, n, small = segment_of(addr)
        size = round_size(rec[1])
        if not small:
            bound = min([s + n] + [b for b in live if addr < b < s + n] +
                        [b for i, b in starts_while if i < rec[2] and addr < b < s + n])
            gap = bound - addr - size
            if 0 < gap <= SMALL_SIZE:
                notes.append(f"{addr:#x}: {rec[1]:,} B requested, freed at event {rec[2]}; its block taken as "
                             f"{size + gap:,} B (the {gap:,} B up to the next known block kept whole), not {size:,} B")
                size += gap
        rec[0] = size
    return SnapshotStart(segments=sorted((a, n, small) for a, (n, small) in start_segs.items()),
                         live=sorted((a, r[0], r[1]) for a, r in live.items()), notes=notes)


@dataclass
class SnapshotComparison:
    """The model (:class:`CachingAllocatorModel`) run from a snapshot's starting state through its trace, against
    what the real allocator did (:func:`compare_snapshot`).

    ``allocs``: alloc events replayed; ``same_address``: those where the model handed out the block at the real
    address. ``real_segments`` / ``model_segments``: ``(index of the alloc event served, segment size)`` of each
    segment taken from the driver during the trace. ``divergences``: the events where the two differ, in words (the
    first is the one that matters: after it the states differ). ``*_end_segments``: the segment sizes held at the
    end; ``*_end_blocks``: every block at the end, ``(address, size, allocated)`` (the real one's state
    ``active_allocated``).
    """

    start: SnapshotStart
    allocs: int
    same_address: int
    real_segments: list[tuple[int, int]]
    model_segments: list[tuple[int, int]]
    real_end_segments: list[int]
    model_end_segments: list[int]
    real_end_blocks: list[tuple[int, int, bool]]
    model_end_blocks: list[tuple[int, int, bool]]
    model_max_allocated: int
    model_max_reserved: int
    divergences: list[str]
    config: AllocatorConfig

    @property
    def real_reserved(self) -> int:
        return sum(self.real_end_segments)

    @property
    def model_reserved(self) -> int:
        return sum(self.model_end_segments)

    @property
    def agrees(self) -> bool:
        """Every block at the real address, every segment taken at the same event with the same size, the same
        segments at the end."""
        return (not self.divergences and self.same_address == self.allocs and self.real_segments == self.model_segments
                and self.real_end_segments == self.model_end_segments and self.real_end_blocks == self.model_end_blocks)

    def describe(self) -> str:
        """One paragraph: the agreement, or the first divergence."""
        from memlab.core.units import format_bytes

        head = (f"{self.allocs:,} allocations from {len(self.start.segments)} segments "
                f"({format_bytes(self.start.reserved_bytes)}) and {len(self.start.live)} live blocks "
                f"({format_bytes(self.start.allocated_bytes)}) held at the start ({self.config.describe()}): ")
        if self.agrees:
            return (head + f"the model handed out every block at the real address and opened the same "
                    f"{len(self.real_segments)} segments of the same sizes at the same events; at the end the same "
                    f"{len(self.real_end_blocks)} blocks in the same {len(self.real_end_segments)} segments, reserved "
                    f"{format_bytes(self.real_reserved)} both")
        return (head + f"{self.same_address:,} at the real address; segments opened: real {len(self.real_segments)}, "
                f"model {len(self.model_segments)}; reserved at the end: real {format_bytes(self.real_reserved)}, "
                f"model {format_bytes(self.model_reserved)}; first divergence: "
                f"{self.divergences[0] if self.divergences else 'none event by event'}")


def _end_blocks(segs: list[dict]) -> list[tuple[int, int, bool]]:
    out = []
    for s in segs:
        at = int(s["address"])
        for b in s.get("blocks", []):
            out.append((at, int(b["size"]), b.get("state") == "active_allocated"))
            at += int(b["size"])
    return sorted(out)


def _seeded(model: Any, start: Any) -> dict[int, int]:
    # the start's segments and live blocks put into ``model``: the real address -> the model's handle of each block
    handles: dict[int, int] = {}
    for addr, n, small in start.segments:
        inside = [b for b in start.live if addr <= b[0] < addr + n]
        for (a, _, _), h in zip(inside, model.seed_segment(addr, n, small, inside)):
            handles[a] = h
    return handles


def compare_snapshot(snapshot: dict, device: int = 0,
                     config: AllocatorConfig | str | None = None) -> SnapshotComparison:
    """Run the caching allocator's model through a real CUDA memory snapshot's trace and compare, event by event.

    The model starts from :func:`snapshot_start` (the segments and live blocks before the first event), takes each
    ``alloc`` (the bytes requested, on its stream) and each ``free_completed`` (when the real allocator returned the
    block to its pool) in order, and opens a segment at the real address when the real allocator did
    (``segment_alloc`` comes just before the ``alloc`` it serves), so that best fit's ties on address fall as they
    fell. Compared: each block's address, each segment taken (event and size), each ``segment_free``, the
    segments at the end.

    Args:
        snapshot: a CUDA memory snapshot dict with a trace (``device_traces``).
        device: the device whose trace to replay.
        config: the allocator options the snapshot was made with; None: PyTorch's defaults.

    Raises:
        ValueError: not a snapshot with a trace, or a trace that frees a block neither it nor the start holds.
    """
    from memlab.estimate.caching_allocator import CachingAllocatorModel

    if isinstance(config, str):
        config = AllocatorConfig.parse(config)
    segs, trace = _trace(snapshot, device)
    start = snapshot_start(snapshot, device)
    model = CachingAllocatorModel(config)
    handles = _seeded(model, start)
    streams: dict[Any, int] = {}
    pending: tuple[int, int] | None = None  # the real segment_alloc waiting for its alloc
    real_new: list[tuple[int, int]] = []
    model_new: list[tuple[int, int]] = []
    diverged: list[str] = []
    allocs = same = 0
    for i, e in enumerate(trace):
        act, addr = e.get("action"), e.get("addr")
        if act == "segment_alloc":
            pending = (addr, int(e["size"]))
        elif act == "alloc":
            allocs += 1
            stream = streams.setdefault(e.get("stream", 0), len(streams))
            before = set(model.segment_layout())
            h = model.malloc(int(e["size"]), stream, segment_address=pending[0] if pending else None)
            opened = [n for seg in model.segment_layout() if seg not in before for n in seg[1:2]]
            for n in opened:
                model_new.append((i, n))
            if pending and not opened:
                diverged.append(f"event {i}: the real allocator took a {pending[1]:,} B segment for {e['size']:,} B; "
                                f"the model found a cached block at {model.address(h):#x}")
            elif opened and not pending:
                diverged.append(f"event {i}: the model took a {opened[0]:,} B segment for "
                                f"{e['size']:,} B; the real allocator used a cached block at {addr:#x}")
            elif opened and pending and opened[0] != pending[1]:
                diverged.append(f"event {i}: segment for {e['size']:,} B: real {pending[1]:,} B, model "
                                f"{opened[0]:,} B")
            if pending:
                real_new.append((i, pending[1]))
            pending = None
            if model.address(h) == addr:
                same += 1
            elif not diverged or not diverged[-1].startswith(f"event {i}:"):
                diverged.append(f"event {i}: {e['size']:,} B at {addr:#x} in the real allocator, at "
                                f"{model.address(h):#x} in the model")
            if addr in handles:
                raise invalid("snapshot", f"event {i} allocates {addr:#x} while it is live", "a consistent trace")
            handles[addr] = h
        elif act == "free_completed":
            if addr not in handles:
                raise invalid("snapshot", f"event {i} frees {addr:#x}, which no event nor the start holds",
                              "a consistent trace")
            model.free(handles.pop(addr))
        elif act == "segment_free":
            diverged.append(f"event {i}: the real allocator freed the segment at {addr:#x} ({e.get('size', 0):,} B); "
                            f"the model frees segments only on a full card or empty_cache")
    return SnapshotComparison(start=start, allocs=allocs, same_address=same, real_segments=real_new,
                              model_segments=model_new,
                              real_end_segments=sorted(int(s["total_size"]) for s in segs),
                              model_end_segments=sorted(n for _, n, _ in model.segment_layout()),
                              real_end_blocks=_end_blocks(segs), model_end_blocks=model.block_layout(),
                              model_max_allocated=model.max_allocated, model_max_reserved=model.max_reserved,
                              divergences=diverged, config=model.config)
