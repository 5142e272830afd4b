"""What the allocator does, next to what the tracker counts: block rounding, and the independent counters.

:func:`allocator_peak` rebuilds the CPU allocator's live bytes from ``torch.profiler``'s memory
events (``profile_memory=True``), the counter the tracker is checked against;
:func:`kernel_scratch_at_peak` finds, in a CUDA allocator snapshot, the scratch that kernels
allocate inside themselves (which no dispatch-level tracker can see).
"""
from __future__ import annotations

import gc
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["CUDA_BLOCK_BYTES", "DEFAULT_BLOCK_BYTES", "allocator_bytes", "allocator_peak",
           "KERNEL_SCRATCH_FRAMES", "kernel_scratch_at_peak"]

#: The CUDA caching allocator rounds every block up to a multiple of this (``kMinBlockSize`` in
#: PyTorch's ``c10/cuda/CUDACachingAllocator.cpp``); the CPU allocator gives what was asked.
CUDA_BLOCK_BYTES = 512
#: The rounding policy a :class:`MemoryTracker` uses unless given another: device type -> block.
DEFAULT_BLOCK_BYTES: Mapping[str, int] = {"cuda": CUDA_BLOCK_BYTES}

# CUDA kernels known to allocate scratch inside themselves (no op returns it, so a dispatch-level
# tracker cannot see it): softmax's backward copies a non-contiguous incoming gradient (seen in an
# allocator snapshot on an H100 with torch 2.11: one attention-score matrix per layer, in backward).
KERNEL_SCRATCH_FRAMES: tuple[str, ...] = ("softmax_backward_cuda_out::impl",)


def allocator_bytes(nbytes: int, device: str | torch.device,
                    block_bytes: Mapping[str, int] | None = None) -> int:
    """Bytes the allocator of ``device`` takes for a request of ``nbytes``: ``nbytes`` rounded up
    to a multiple of the device's block.

    >>> allocator_bytes(100, "cuda"), allocator_bytes(100, "cpu"), allocator_bytes(0, "cuda")
    (512, 100, 0)

    Args:
        device: the device or its type (``"cuda"``, ``"cuda:1"``, ``"cpu"``, ``"meta"``).
        block_bytes: device type -> block size; default :data:`DEFAULT_BLOCK_BYTES` (CUDA's
            512-byte blocks, every other device as asked).
    """
    dev = device if isinstance(device, str) else device.type
    block = (DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes).get(dev.split(":")[0], 1)
    return -(-nbytes // block) * block if block > 1 else nbytes


class _quiet_stderr:
    # point file descriptor 2 at /dev/null for a moment (C++ log lines bypass sys.stderr)

    def __enter__(self) -> None:
        import os
        import sys

        self._saved = None
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)
        except (OSError, ValueError, AttributeError):  # no real descriptor 2: nothing to quiet
            self._saved = None

    def __exit__(self, *exc: Any) -> None:
        import os

        if self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)


class _stderr_without:
    # while the block runs, file descriptor 2 goes to a temporary file; at the end every line of it
    # but those containing ``drop`` is written back (the profiler's C++ note that a block made before
    # it started was freed is not the user's business: allocator_peak documents that limit)

    def __init__(self, drop: str) -> None:
        self.drop = drop.encode()

    def __enter__(self) -> None:
        import os
        import sys
        import tempfile

        self._saved = self._tmp = None
        try:
            sys.stderr.flush()
            self._tmp = tempfile.TemporaryFile()
            self._saved = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
        except (OSError, ValueError, AttributeError):  # no real descriptor 2: nothing to filter
            self._saved = None

    def __exit__(self, *exc: Any) -> None:
        import os

        if self._saved is None:
            return
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        kept = [line for line in self._tmp.read().splitlines(keepends=True) if self.drop not in line]
        self._tmp.close()
        if kept:
            os.write(2, b"".join(kept))


_UNKNOWN_BLOCK = "allocated before the profiling started"


def allocator_peak(fn: Callable[[], Any]) -> tuple[int, int]:
    """The CPU allocator's peak and end bytes while ``fn()`` runs, from its own events.

    ``fn`` runs under ``torch.profiler.profile(profile_memory=True)``; the allocation and free
    events are replayed in time order. The counter that is not a twin of :class:`MemoryTracker`:
    it sees every block the allocator serves (kernel scratch and 8-byte wrapped numbers included)
    and no tensor. It cannot see the free of a block allocated before it started, so ``fn`` should
    not free older memory (make the inputs inside ``fn``, or keep them alive). The garbage collector is
    off while ``fn`` runs: a collection there could free garbage of earlier work (a measured model kept
    alive by a reference cycle, say), and the allocator does report that free when the block was made
    under an earlier profiler, which pulls the peak down (a chapter 09 test once read 882,896 B for a
    step whose peak is 1,474,768 B). No full collection before: it costs 0.1-0.2 s a call with
    transformers imported, and the graders and tests call this in loops.

    Returns:
        ``(peak, end)``: the highest point and the last one, both above the bytes live when ``fn``
        (called once, with no argument) started.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    enabled = gc.isenabled()
    gc.disable()  # no collection inside fn (see above)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's C++ side logs its start and stop on file descriptor 2
        prof.__enter__()
    try:
        with _stderr_without(_UNKNOWN_BLOCK):
            fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
        if enabled:
            gc.enable()
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    events = []
    while stack:  # the tree in order (a stable sort by time keeps it for equal times)
        n = stack.pop()
        if n.tag == _EventType.Allocation:
            events.append((n.start_time_ns, n.extra_fields.alloc_size))
        stack.extend(reversed(n.children))
    cur = top = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        cur += size
        top = max(top, cur)
    return top, cur


def kernel_scratch_at_peak(snapshot: Mapping[str, Any], frames: Sequence[str] = KERNEL_SCRATCH_FRAMES,
                           device: int = 0) -> int:
    """Bytes that CUDA kernels allocated inside themselves and still held at the allocator's peak:
    the bytes of the matching blocks alive at the trace's peak.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` taken after recording a step with
            ``torch.cuda.memory._record_memory_history()`` (C++ stacks on, its default). The peak is
            that of the recorded trace.
        frames: a block counts when one of its C++ frames contains one of these names.
        device: the CUDA device index in the snapshot.

    Raises:
        ValueError: ``device`` is not in the snapshot.
    """
    traces = snapshot.get("device_traces", [])
    if not isinstance(device, int) or not 0 <= device < len(traces):
        raise ValueError(f"device={device!r} is not in the snapshot; allowed: 0..{len(traces) - 1}")
    live: dict[int, Mapping[str, Any]] = {}
    cur = top = 0
    at_top: dict[int, Mapping[str, Any]] = {}
    for ev in traces[device]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
        elif ev["action"] == "free_completed" and live.pop(ev["addr"], None) is not None:
            cur -= ev["size"]
        if cur > top:
            top, at_top = cur, dict(live)
    return sum(ev["size"] for ev in at_top.values()
               if any(f in fr.get("name", "") for fr in ev.get("frames", []) for f in frames))
