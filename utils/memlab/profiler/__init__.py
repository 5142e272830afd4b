"""A training-step memory profiler built from scratch: who holds the bytes, and when.

:class:`MemoryTracker` answers the course's one question -- how many bytes, where, and when -- on
the CPU, on a GPU and on fake tensors that allocate nothing (chapter 01). It is checked against
the allocator's own events (:func:`allocator_peak`) and against PyTorch's ``MemTracker``.

Modules: :mod:`~memlab.profiler.tracker` (the tracker, with its module frames and step hooks),
:mod:`~memlab.profiler.storage` (what it counts: categories, phases, events),
:mod:`~memlab.profiler.allocator` (block rounding and the independent counters),
:mod:`~memlab.profiler.compare` (the tracker and the allocator on one step),
:mod:`~memlab.profiler.report` (table and plot), :mod:`~memlab.profiler.timeline` (every storage
as a band in time, for an interactive page or pytorch.org/memory_viz).
"""
from __future__ import annotations

from memlab.core.units import format_bytes
from memlab.profiler.allocator import (CUDA_BLOCK_BYTES, DEFAULT_BLOCK_BYTES, KERNEL_SCRATCH_FRAMES,
                                       allocator_bytes, allocator_peak, kernel_scratch_at_peak)
from memlab.profiler.compare import PeakComparison, peak_beside_allocator
from memlab.profiler.report import format_report, plot_timeline
from memlab.profiler.storage import (BREAKDOWN_AT, CATEGORIES, FRESH_ALIAS_OPS, PHASES, Event, LiveStorage,
                                     optimizer_tensors, phase_peaks, tensors_in)
from memlab.profiler.tracker import MemoryTracker

__all__ = [
    "CATEGORIES",
    "PHASES",
    "MemoryTracker",
    "Event",
    "LiveStorage",
    "CUDA_BLOCK_BYTES",
    "allocator_bytes",
    "allocator_peak",
    "peak_beside_allocator",
    "PeakComparison",
    "phase_peaks",
    "kernel_scratch_at_peak",
    "format_bytes",
    # also public: the pieces the tracker is made of
    "DEFAULT_BLOCK_BYTES",
    "KERNEL_SCRATCH_FRAMES",
    "BREAKDOWN_AT",
    "FRESH_ALIAS_OPS",
    "optimizer_tensors",
    "tensors_in",
    "format_report",
    "plot_timeline",
]
