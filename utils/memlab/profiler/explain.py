"""An OOM post-mortem: what held the memory at the peak, read from a CUDA memory snapshot or an OOM message.

Three inputs, one answer (:func:`explain` -> :class:`Explanation`):

* a CUDA memory snapshot: the pickle of ``torch.cuda.memory._snapshot()`` / ``_dump_snapshot(path)``, with or without
  stack frames, in the layout PyTorch's own reader uses (``torch/cuda/_memory_viz.py``): ``segments`` (one per
  ``cudaMalloc``, each with ``total_size``, ``stream`` and its ``blocks``: ``size``, ``requested_size``, ``state``,
  ``frames``) and ``device_traces`` (per device, the last allocator events: ``alloc``, ``free_requested``,
  ``free_completed``, ``segment_alloc``, ``segment_free``, ... with ``addr``, ``size``, ``frames``);
* memlab's own timeline pickle (:meth:`memlab.profiler.timeline.Timeline.save_snapshot`): the same layout, whose frames
  name each block's category, op and phase, so its breakdown is the tracker's;
* an OOM message pasted as text (``Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which
  1.01 GiB is free. ... 75.02 GiB is allocated by PyTorch, and 1.90 GiB is reserved by PyTorch but unallocated``,
  or the older ``(GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; ...)``).

The peak is the one ``torch.cuda.max_memory_allocated()`` counts: the sum of the allocator's blocks (not of the
requested bytes), a block counted from its ``alloc`` to its ``free_requested``. The trace records requested sizes only,
so each block's size is rebuilt the way PyTorch's caching allocator chose it: the request rounded up to 512 bytes; a
request of at most 1 MiB (the small pool) gets exactly that; a larger one takes the whole free block it was placed in
unless more than 1 MiB would be left over (the allocator splits off only a larger remainder), and that free block
runs from the block's address to the next block then in use (free neighbours are merged), which the trace's addresses
and the segments give. Replayed on three H200 snapshots this reproduces every block size in their segments and the
allocator's peak. Blocks alive before the recording began are found by replaying the trace backwards from the
segments; one of them freed during the recording leaves only its requested size, so a large one is known only to
within 1 MiB (exactly when a later block is placed right after it): the peak is then given as a range. A snapshot whose trace is empty (recording was off) is explained as it was
taken. Fragmentation is PyTorch's own reading of a segment: its free blocks (``inactive``) are reserved but
unallocated; ``expandable_segments:True`` (PyTorch's ``PYTORCH_CUDA_ALLOC_CONF``) lets a segment grow in place, so it
helps when a request failed while the cached free bytes could have held it but no one free block could.

memlab's timeline has no allocator (its segments are made up): given ``allocator`` (a replay of allocation events,
:func:`memlab.estimate.allocator_replay.replay`, which ``memlab explain`` passes; this package sits below
``memlab.estimate`` and does not import it), :func:`explain` replays the timeline's allocations through that model
of PyTorch's caching allocator and reports the reserved bytes and the fragmentation it predicts, marked as the
model's prediction; a real CUDA snapshot keeps its measured segments.

A user's file is read with a restricted unpickler that builds only the builtin containers and scalars this format
holds (dict, list, tuple, str, bytes, int, float, bool, None) and refuses every class or function a pickle names.
"""
from __future__ import annotations

import contextlib
import gc
import io
import pickle
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from memlab.core.units import format_bytes
from memlab.profiler.snapshot_replay import Sizer, end_state, frames_of, replay

__all__ = ["SnapshotError", "TensorBlock", "Explanation", "explain", "read_snapshot", "parse_oom_message",
           "explain_snapshot", "allocation_events"]

_TOP = 10
# frames inside these paths say how PyTorch got there, not who asked: the first frame outside them names the maker
_INTERNAL = ("torch/nn/modules/module.py", "torch/utils/", "torch/_", "torch/autograd/", "torch/nn/functional.py",
             "torch/functional.py", "torch/cuda/", "torch/_tensor.py", "torch/overrides.py", "accelerate/hooks.py",
             "contextlib.py", "functools.py", "<frozen")
_INTERNAL_RE = re.compile("|".join(map(re.escape, _INTERNAL)))


class SnapshotError(ValueError):
    """A file that is neither a CUDA memory snapshot, a memlab timeline pickle nor an OOM message (one line)."""


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, bytes and numbers; any named class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: a memory snapshot holds only builtin "
                                     f"containers and numbers")


@dataclass
class TensorBlock:
    """One live allocation at the peak: its block ``size`` (what the allocator holds), the ``requested`` bytes, its
    ``category`` ("" when the frames do not say) and ``where`` it was made (the innermost frame outside PyTorch)."""

    size: int
    requested: int
    category: str
    where: str
    address: int = 0


@dataclass
class Explanation:
    """What held the memory at the peak.

    ``allocated_bytes`` / ``reserved_bytes``: at the peak of allocated memory (the OOM message's figures for a
    message); ``allocated_upper_bytes``: the most the peak can be where the snapshot does not fix it (blocks made
    before the recording and freed during it: see the notes), else equal to ``allocated_bytes``; ``free_in_segments_bytes``: reserved but unallocated (the fragmentation), ``largest_free_block_bytes``
    the largest contiguous free block in one segment, ``segments`` the segments with free bytes (address, total,
    free, largest free block), largest first; ``request_bytes``: the failed request (a message, or a snapshot taken
    at an OOM), 0 if unknown. ``by_category`` and ``by_source`` split the live bytes at the peak by category (from a
    memlab timeline's frames, or read from the stack frames) and by where they were made; ``largest`` the ten
    largest live blocks. ``when`` says which moment the figures are from; ``notes`` what could not be known.

    ``predicted_*`` (a memlab timeline explained with an ``allocator``; 0 and ``predicted_by`` "" otherwise): what a
    model of PyTorch's caching allocator predicts for the timeline's allocations on a CUDA card, a prediction and
    not a measurement: reserved and allocated (in blocks) at the allocated peak, the most reserved over the trace,
    and ``predicted_by`` the model and its settings.
    """

    source: str
    kind: str  # "snapshot", "timeline", "oom message"
    when: str
    allocated_bytes: int
    reserved_bytes: int
    allocated_upper_bytes: int = -1  # the most the peak can be; -1 (or allocated_bytes): it is allocated_bytes
    free_in_segments_bytes: int = 0
    largest_free_block_bytes: int = 0
    request_bytes: int = 0
    capacity_bytes: int = 0
    free_on_device_bytes: int = 0
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)
    by_category: dict[str, int] = field(default_factory=dict)
    by_source: dict[str, int] = field(default_factory=dict)
    largest: list[TensorBlock] = field(default_factory=list)
    expandable_segments: str = ""
    notes: list[str] = field(default_factory=list)
    predicted_reserved_bytes: int = 0
    predicted_allocated_bytes: int = 0
    predicted_max_reserved_bytes: int = 0
    predicted_by: str = ""

    def text(self) -> str:
        """The post-mortem as plain text."""
        allocated = format_bytes(self.allocated_bytes)
        if self.allocated_upper_bytes > self.allocated_bytes:
            allocated = (f"{allocated} up to {format_bytes(self.allocated_upper_bytes)} (not fixed by the snapshot: "
                         f"see the notes; the breakdowns below count {allocated})")
        out = [f"{self.source}: {self.kind}; {self.when}",
               f"allocated {allocated}, reserved {format_bytes(self.reserved_bytes)} "
               f"(reserved but unallocated {format_bytes(self.reserved_bytes - self.allocated_bytes)})"]
        if self.request_bytes:
            out.append(f"failed request: {format_bytes(self.request_bytes)}")
        if self.capacity_bytes:
            other = self.capacity_bytes - self.free_on_device_bytes - self.reserved_bytes
            out.append(f"device: {format_bytes(self.capacity_bytes)} total, {format_bytes(self.free_on_device_bytes)} "
                       f"free, {format_bytes(max(other, 0))} outside PyTorch's cache (CUDA context, other processes)")
        if self.segments:
            out.append(f"fragmentation: {format_bytes(self.free_in_segments_bytes)} free inside {len(self.segments)} "
                       f"segment(s); largest free block {format_bytes(self.largest_free_block_bytes)}")
            for addr, total, free, big in self.segments[:5]:
                out.append(f"  segment 0x{addr:x}: {format_bytes(total)}, {format_bytes(free)} free "
                           f"(largest block {format_bytes(big)})")
        if self.expandable_segments:
            out.append(f"expandable_segments: {self.expandable_segments}")
        if self.predicted_by:
            frag = self.predicted_reserved_bytes - self.predicted_allocated_bytes
            out.append(f"caching-allocator model ({self.predicted_by}): the model's prediction for a CUDA card, not a "
                       f"measurement: reserved {format_bytes(self.predicted_reserved_bytes)} at the allocated peak "
                       f"(allocated {format_bytes(self.predicted_allocated_bytes)} in blocks), fragmentation "
                       f"{format_bytes(frag)} (reserved but unallocated there); max reserved over the trace "
                       f"{format_bytes(self.predicted_max_reserved_bytes)}")
        for title, table in (("by category", self.by_category), ("by where it was made", self.by_source)):
            if table:
                out.append(f"live at the peak, {title}:")
                total = sum(table.values()) or 1
                for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:_TOP]:
                    out.append(f"  {format_bytes(v):>12}  {100 * v / total:5.1f}%  {k}")
        if self.largest:
            out.append(f"the {len(self.largest)} largest live blocks:")
            for b in self.largest:
                cat = f" [{b.category}]" if b.category else ""
                out.append(f"  {format_bytes(b.size):>12}{cat}  {b.where}")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


# ------------------------------------------------------------------ reading
def read_snapshot(path: str | Path) -> dict:
    """The snapshot dict in ``path`` (a bare list of segments is wrapped as PyTorch's reader does), read with the
    restricted unpickler.

    Raises:
        SnapshotError: not a pickle, a truncated one, one that names a class, or not a snapshot (one line).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    with path.open("rb") as f:
        return _load_snapshot(str(path), f, path.stat().st_size)


_EXPECTED = ("expected a CUDA memory snapshot (the pickle of torch.cuda.memory._snapshot(): a dict with 'segments'), "
             "a memlab timeline pickle or a CUDA OOM message as text")


def _snapshot_from_bytes(name: str, data: bytes) -> dict:
    return _load_snapshot(name, io.BytesIO(data), len(data))


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused inside: a snapshot is millions of small dicts (one per stack frame), and
    the collections that every few hundred new containers trigger would find no cycle among them and take most of
    the time (5x for reading a 100 MB snapshot: memlab bench explain). Reference counting still frees them."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _load_snapshot(name: str, f: Any, nbytes: int) -> dict:
    try:
        with _gc_paused():
            obj = _RestrictedUnpickler(f).load()
    except EOFError:
        raise SnapshotError(f"{name}: truncated pickle ({nbytes:,} bytes end mid-object); {_EXPECTED}") from None
    except pickle.UnpicklingError as exc:
        raise SnapshotError(f"{name}: {str(exc).splitlines()[0]}; {_EXPECTED}") from None
    except Exception as exc:  # a corrupt stream raises what its opcodes meet (ValueError, KeyError, ...)
        raise SnapshotError(f"{name}: not a readable pickle ({type(exc).__name__}); {_EXPECTED}") from None
    if isinstance(obj, list):
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise SnapshotError(f"{name}: a pickle of {type(obj).__name__} without 'segments'; {_EXPECTED}")
    for seg in obj["segments"]:
        if not (isinstance(seg, dict) and isinstance(seg.get("blocks"), list) and "total_size" in seg
                and all(isinstance(b, dict) and "size" in b and "state" in b for b in seg["blocks"])):
            raise SnapshotError(f"{name}: a segment without total_size or blocks (size, state); {_EXPECTED}")
    return obj


_SIZE = r"([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_UNIT = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _size(text: str, pattern: str) -> int | None:
    m = re.search(pattern.replace("SIZE", _SIZE), text)
    if m is None:
        return None
    return int(round(float(m.group(1)) * _UNIT[m.group(2)]))


def parse_oom_message(text: str) -> dict[str, int]:
    """The figures of a CUDA OOM message (PyTorch 2.1+ and the older form): ``request``, ``capacity``, ``free``,
    ``allocated``, ``reserved_unallocated`` (or ``reserved``), in bytes; a figure the message lacks is left out.

    Raises:
        SnapshotError: no "Tried to allocate" in ``text``.
    """
    request = _size(text, r"Tried to allocate SIZE")
    if request is None:
        raise SnapshotError(f"no 'Tried to allocate ...' in the text; {_EXPECTED}")
    out = {"request": request}
    new = {"capacity": r"total capacity of SIZE", "free": r"of which SIZE is free",
           "allocated": r"SIZE is allocated by PyTorch", "reserved_unallocated": r"SIZE is reserved by PyTorch but"}
    old = {"capacity": r"SIZE total capacity", "allocated": r"SIZE already allocated", "free": r"SIZE free",
           "reserved": r"SIZE reserved in total by PyTorch"}
    for table in (new, old):
        for key, pattern in table.items():
            v = _size(text, pattern)
            if v is not None and key not in out:
                out[key] = v
    if "reserved" in out and "allocated" in out and "reserved_unallocated" not in out:
        out["reserved_unallocated"] = out["reserved"] - out["allocated"]
    return out


def _oom_explanation(name: str, text: str) -> Explanation:
    f = parse_oom_message(text)
    allocated = f.get("allocated", 0)
    cached = f.get("reserved_unallocated", 0)
    e = Explanation(source=name, kind="oom message", when="at the failed allocation", allocated_bytes=allocated,
                    reserved_bytes=allocated + cached, free_in_segments_bytes=cached, request_bytes=f["request"],
                    capacity_bytes=f.get("capacity", 0), free_on_device_bytes=f.get("free", 0))
    if "allocated" not in f:
        e.notes.append("the message does not say how much PyTorch had allocated")
    e.expandable_segments = _expandable_verdict(f["request"], cached, None, f.get("free", 0))
    e.notes.append("a message has no per-tensor detail: torch.cuda.memory._record_memory_history() before the run and "
                   "torch.cuda.memory._dump_snapshot(path) in an OOM handler give memlab explain the tensors")
    return e


def _expandable_verdict(request: int, cached: int, largest: int | None, free_device: int) -> str:
    """Whether ``expandable_segments:True`` would have let the request through, in words."""
    if not request:
        if largest is not None and cached > 2 * max(largest, 1):
            return (f"might help: the cached free memory ({format_bytes(cached)}) is split into blocks of at most "
                    f"{format_bytes(largest)}")
        return "no failed request to judge; little of the cache is split"
    if largest is not None and largest >= request:
        return "would not help: a free cached block could hold the request (the cache was not the limit)"
    if cached + free_device >= request:
        return (f"would likely help: the cached but unallocated {format_bytes(cached)} plus the device's free "
                f"{format_bytes(free_device)} cover the {format_bytes(request)} request, but no single block did "
                f"(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    short = request - cached - free_device
    return (f"would not help: even all cached and free memory is {format_bytes(short)} short of the request; the "
            f"live tensors must shrink (real demand, not fragmentation)")


# ------------------------------------------------------------------ a snapshot at its peak
def _is_python(f: dict) -> bool:
    """A Python frame (a .py file, or one such as <frozen runpy> or <string>); C++ frames name a .cpp file, '??' or
    nothing."""
    name = str(f.get("filename", ""))
    return name.endswith(".py") or name.startswith("<")


# C++ frames that say how an allocation was recorded or served, not who asked for it
_CPP_PLUMBING = re.compile(r"^(torch::unwind::|torch::CapturedTraceback::|torch::cuda::\(anonymous namespace\)::gather|"
                           r"c10::cuda::CUDACachingAllocator::|at::detail::empty_|at::\(anonymous namespace\)::create_out|"
                           r"c10::impl::wrap_kernel_functor|c10::Dispatcher::|at::_ops::\w+::redispatch|"
                           r"c10::impl::BoxedKernelWrapper|c10::BoxedKernel::|\?\?$)")
# frames naming PyTorch's cuBLAS / cuBLASLt workspace (at::cuda::getCurrentCUDABlasHandle sets one per handle and
# stream through the caching allocator at the first matmul; CUBLAS_WORKSPACE_CONFIG sets its size)
_CUBLAS_WORKSPACE = re.compile(r"setWorkspaceForHandle|getCurrentCUDABlasHandle|getCUDABlasLtWorkspace|"
                               r"cublas\w*[Ww]orkspace")
_AUTOGRAD_THREAD = re.compile(r"torch::autograd::Engine::(thread_main|evaluate_function)")


def _short(name: str) -> str:
    """A C++ function's name without its argument list and return type."""
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the first '(' at template depth 0 opens the argument list
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous namespace)", i):
            cut = i
            break
    head = name[:cut].strip()
    return head.rsplit(" ", 1)[-1] if " " in head and "<" not in head.rsplit(" ", 1)[-1] else head


def _cpp_maker(names: list[str]) -> str:
    """The C++ frame that best names a block's maker: the cuBLAS workspace, else the ATen op and the autograd node
    that ran it, else the first frame that is not the unwinder, the allocator or the dispatcher."""
    ws = next((n for n in names if _CUBLAS_WORKSPACE.search(n)), None)
    if ws is not None:
        lt = "Lt" if "BlasLt" in ws else ""
        return f"the cuBLAS{lt} workspace ({_short(ws)})"
    op = next((m.group(1) for n in names if (m := re.match(r"at::_ops::(\w+)::call\b", n))), None)
    node = next((m.group(1) for n in names if (m := re.search(r"autograd::generated::(\w+)::apply\b", n))), None)
    if op or node:
        return " in ".join(x for x in (f"aten::{op}" if op else "", node) if x)
    top = next((n for n in names if not _CPP_PLUMBING.match(n)), names[0] if names else "?")
    return _short(top)


def _category(frames: list[dict]) -> str:
    """A block's category: the one a memlab timeline wrote, else read from the stack ("" with no frames)."""
    if not frames:
        return ""
    first = str(frames[0].get("filename", ""))
    if first.startswith("category: "):
        return first[len("category: "):]
    names = [str(f.get("name", "")) for f in frames]
    if any(_CUBLAS_WORKSPACE.search(n) for n in names):
        return "cuBLAS workspace"
    py = [f for f in frames if _is_python(f)]
    files = [str(f.get("filename", "")).replace("\\", "/") for f in py]
    pnames = [str(f.get("name", "")) for f in py]
    if any("torch/optim/" in p for p in files) or any(n in ("_init_group", "step") and "optim" in p
                                                     for n, p in zip(pnames, files)):
        return "optimizer"
    if any(n in ("backward", "_engine_run_backward", "run_backward") for n in pnames) or (
            not py and any(_AUTOGRAD_THREAD.match(n) for n in names)):  # autograd's own thread has no Python frame
        return "backward (gradients, activation gradients)"
    if any(n == "forward" or n == "_call_impl" for n in pnames):
        return "activations (forward)"
    if any(n in ("_apply", "to", "cuda", "from_pretrained", "__init__", "reset_parameters") for n in pnames):
        return "parameters (model load)"
    return "other"


def _where(frames: list[dict]) -> str:
    if not frames:
        return "(no frames: record with torch.cuda.memory._record_memory_history())"
    first = str(frames[0].get("filename", ""))
    if first.startswith("category: "):  # a memlab timeline: the op, shape and phase
        return str(frames[0].get("name", ""))
    py = [f for f in frames if _is_python(f)]
    names = [str(f.get("name", "")) for f in frames]
    if not py:
        return f"C++ only (no Python frame): {_cpp_maker(names)}"
    place = ""
    for f in py:
        p = str(f.get("filename", "")).replace("\\", "/")
        if not _INTERNAL_RE.search(p):
            place = f"{p.rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '')}"
            break
    if not place:
        f = py[0] if py else frames[0]
        place = f"{str(f.get('filename', '?')).rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '')}"
    if any(_CUBLAS_WORKSPACE.search(n) for n in names):
        return f"{_cpp_maker(names)}, first matmul at {place}"
    return place


def _live_at(live: dict[int, dict], trace: list[dict], index: int) -> dict[int, dict]:
    """The allocated blocks after ``trace[:index]``. A block freed later is brought back with its ``alloc`` event's
    frames (a free's frames say where it was freed), or the free's when its alloc is older than the trace."""
    made = {ev.get("addr"): ev for ev in trace[:index] if ev.get("action") == "alloc"}
    live = dict(live)
    for ev in reversed(trace[index:]):
        act, addr = ev.get("action"), ev.get("addr")
        if act == "alloc":
            live.pop(addr, None)
        elif act == "free_completed" and addr not in live:
            born = made.get(addr, ev)
            live[addr] = {"size": ev.get("size", 0), "requested_size": born.get("size", ev.get("size", 0)),
                          "frames": born.get("frames", [])}
    return live


def _fragmentation(segments: list[dict]) -> tuple[int, int, list[tuple[int, int, int, int]]]:
    free_total, largest, rows = 0, 0, []
    for seg in segments:
        free = [int(b["size"]) for b in seg["blocks"] if b["state"] == "inactive"]
        if free:
            rows.append((int(seg.get("address", 0)), int(seg["total_size"]), sum(free), max(free)))
            free_total += sum(free)
            largest = max(largest, max(free))
    rows.sort(key=lambda r: -r[2])
    return free_total, largest, rows


def allocation_events(snapshot: dict, device: int = 0) -> list[tuple]:
    """The allocations of ``device``'s trace as :func:`memlab.estimate.allocator_replay.replay` takes them: first an
    ``("alloc", address, size)`` for each block live before the trace (found by replaying it backwards from the
    segments, in address order), then the trace's ``alloc`` and ``free_completed`` events (``("free", address)``)."""
    segs = [s for s in snapshot["segments"] if int(s.get("device", 0)) == device]
    traces = snapshot.get("device_traces") or []
    trace = [e for e in (traces[device] if device < len(traces) else []) if isinstance(e, dict)]
    start = _live_at(end_state(segs), trace, 0)
    out: list[tuple] = [("alloc", a, int(start[a]["size"])) for a in sorted(start)]
    live = set(start)
    for ev in trace:
        act, addr = ev.get("action"), ev.get("addr")
        if act == "alloc" and addr not in live:
            live.add(addr)
            out.append(("alloc", addr, int(ev.get("size", 0))))
        elif act == "free_completed" and addr in live:
            live.discard(addr)
            out.append(("free", addr))
    return out


def _predict(e: Explanation, snapshot: dict, allocator: Callable[[list[tuple]], Any], device: int) -> None:
    """Fill ``e.predicted_*`` with ``allocator``'s replay of the snapshot's allocations on ``device``."""
    r = allocator(allocation_events(snapshot, device))
    e.predicted_reserved_bytes, e.predicted_allocated_bytes = int(r.reserved_at_peak), int(r.allocated_at_peak)
    e.predicted_max_reserved_bytes = int(r.max_reserved)
    conf = getattr(getattr(r, "config", None), "describe", None)
    e.predicted_by = "memlab.estimate.caching_allocator" + (f", {conf()}" if conf else "")


def _attribute(e: Explanation, live: list, timeline: bool, traced: bool) -> None:
    # the live blocks at the peak by category, by source line, and the largest of them, into ``e``
    by_cat: dict[str, int] = defaultdict(int)
    by_src: dict[str, int] = defaultdict(int)
    blocks = []
    for b in live:
        fr = b.frames
        if b.before and not fr and traced:  # no alloc event in the recording: made before it began
            cat = _BEFORE
            where = _BEFORE + (f"; freed during it at {_where(b.freed_frames)}" if b.freed_frames else "")
        else:
            cat, where = _category(fr), _where(fr)
        by_cat[cat or "unknown (no frames)"] += b.size
        by_src[where.split(" -> ")[0] if timeline else re.sub(r":\d+ ", " ", where)] += b.size
        blocks.append(TensorBlock(b.size, b.requested, cat, where, int(b.addr)))
    e.by_category, e.by_source = dict(by_cat), dict(by_src)
    e.largest = sorted(blocks, key=lambda t: -t.size)[:_TOP]


def explain_snapshot(snapshot: dict, source: str = "snapshot",
                     allocator: Callable[[list[tuple]], Any] | None = None) -> Explanation:
    """:class:`Explanation` of a snapshot dict (:func:`read_snapshot`): the device with the most reserved memory,
    at the peak of allocated memory its trace reaches.

    Args:
        allocator: for a memlab timeline (no real allocator behind it): a function replaying
            :func:`allocation_events` through a caching-allocator model, returning an object with
            ``reserved_at_peak``, ``allocated_at_peak`` and ``max_reserved`` (such as
            :func:`memlab.estimate.allocator_replay.replay`, or a ``functools.partial`` of it with a config); its
            prediction fills ``predicted_*``. Not used for a CUDA snapshot, whose segments are measured.
    """
    segments = snapshot["segments"]
    devices = defaultdict(int)
    for seg in segments:
        devices[int(seg.get("device", 0))] += int(seg["total_size"])
    device = max(devices, key=devices.get) if devices else 0
    segs = [s for s in segments if int(s.get("device", 0)) == device]
    traces = snapshot.get("device_traces") or []
    trace = [e for e in (traces[device] if device < len(traces) else []) if isinstance(e, dict)]
    timeline = _is_timeline(segs, trace)
    r = replay(segs, trace, None if timeline else Sizer(snapshot.get("allocator_settings")))
    index, allocated, reserved = r.index, r.allocated, r.reserved
    when = ("at the snapshot (no allocator trace: recording was off)" if not trace else
            "at the snapshot, which is the peak of its trace" if index == len(trace) else
            f"at the peak of allocated memory, after event {index:,} of {len(trace):,} in the trace")
    free, largest, rows = _fragmentation(segs)
    if timeline:  # its addresses are made up, one after another: no allocator, no cache to fragment
        free, largest, rows, reserved = 0, 0, [], allocated
    oom = [e for e in trace if e.get("action") == "oom"]
    e = Explanation(source=source, kind="memlab timeline" if timeline else "CUDA memory snapshot", when=when,
                    allocated_bytes=allocated, reserved_bytes=max(reserved, allocated),
                    allocated_upper_bytes=r.upper, free_in_segments_bytes=free,
                    largest_free_block_bytes=largest, segments=rows,
                    request_bytes=int(oom[-1].get("size", 0)) if oom else 0)
    _attribute(e, r.live, timeline, bool(trace))
    e.expandable_segments = _expandable_verdict(e.request_bytes, free, largest if rows else 0,
                                                int(oom[-1].get("device_free", 0)) if oom else 0)
    if len(devices) > 1:
        e.notes.append(f"{len(devices)} devices in the snapshot; explained: device {device} (the most reserved)")
    if timeline:
        e.expandable_segments = ""
        if allocator is not None:
            _predict(e, snapshot, allocator, device)
            e.notes.append("a memlab timeline counts tensors, not an allocator: reserved is allocated here; the "
                           "caching-allocator line is the model's prediction for a CUDA card")
        else:
            e.notes.append("a memlab timeline counts tensors, not an allocator: reserved is allocated, no "
                           "fragmentation (explain(path, allocator=memlab.estimate.allocator_replay.replay) or the "
                           "memlab explain command adds the caching-allocator model's prediction)")
    elif index != len(trace) and trace:
        e.notes.append("the segments (fragmentation) are as the snapshot was taken; the live blocks as at the peak")
    placed = [b for b in r.uncertain if not b.before]
    if placed:
        e.notes.append(f"{len(placed)} block(s) over 1 MiB lie outside every segment the snapshot and its trace "
                       f"name: each may be up to 1 MiB larger than its request (counted at the request)")
    if r.upper > r.allocated:
        unsure = [b for b in r.uncertain if b.before]
        e.notes.append(
            f"the peak of allocated memory (what torch.cuda.max_memory_allocated() counts: the allocator's blocks) "
            f"is between {format_bytes(r.allocated)} and {format_bytes(r.upper)}: {len(unsure)} block(s) "
            f"({format_bytes(sum(b.requested for b in unsure))} requested) were made before the recording began "
            f"and freed during it, so the snapshot keeps only their requested sizes; a request over 1 MiB takes "
            f"the whole free block it is placed in when no more than 1 MiB would be left, so each may be up to "
            f"1 MiB larger (start _record_memory_history() before those tensors are made to fix the figure)")
    if r.disagree:
        e.notes.append(f"the caching allocator's placement rules gave {r.disagree} of {r.modelled} blocks alive at "
                       f"the end a size other than the segments' (the segments' is used): the peak may be off")
    if not any(b.frames or b.freed_frames for b in r.live):
        e.notes.append("no stack frames: categories and places need _record_memory_history(stacks='python')")
    return e


_BEFORE = "made before the recording began"


def _is_timeline(segs: list[dict], trace: list[dict]) -> bool:
    """A memlab timeline pickle: its frames name each block's category."""
    for b in [b for s in segs for b in s["blocks"]][:50] + trace[:50]:
        fr = frames_of(b)
        if fr and str(fr[0].get("filename", "")).startswith("category: "):
            return True
    return False


def explain(path: str | Path, allocator: Callable[[list[tuple]], Any] | None = None) -> Explanation:
    """Explain the file at ``path``: a CUDA memory snapshot pickle, a memlab timeline pickle or an OOM message.
    ``allocator``: as :func:`explain_snapshot` takes it (a memlab timeline's predicted reserved memory).

    Raises:
        SnapshotError: anything else, a truncated pickle, a pickle naming a class (one line naming the file and
            what was expected).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; {_EXPECTED}")
    with path.open("rb") as f:
        first = f.read(1)
        if first == b"\x80" or first in (b"}", b"]", b"("):  # a pickle (protocol 2+, or 0/1's first opcode)
            f.seek(0)  # read from the file as it streams in: the bytes are never held whole beside the objects
            with _gc_paused():  # until the snapshot is freed: a collection would walk all of its objects
                snapshot = _load_snapshot(str(path), f, path.stat().st_size)
                e = explain_snapshot(snapshot, source=str(path), allocator=allocator)
                del snapshot
            return e
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SnapshotError(f"{path}: neither a pickle nor text; {_EXPECTED}") from None
    try:
        return _oom_explanation(str(path), text)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
