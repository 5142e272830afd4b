"""One step counted twice: by :class:`~memlab.profiler.MemoryTracker` and by the allocator, in
the same run, and once more by the allocator alone: the habit every chapter follows for the memory
numbers it claims (:func:`peak_beside_allocator`)."""
from __future__ import annotations

import gc

from dataclasses import dataclass
from typing import Any, Callable

import torch

from memlab.profiler.allocator import allocator_peak
from memlab.profiler.tracker import MemoryTracker

__all__ = ["PeakComparison", "peak_beside_allocator"]


@dataclass(frozen=True)
class PeakComparison:
    """One step's peak counted twice: by :class:`~memlab.profiler.MemoryTracker` and by the
    allocator, both as a rise above the bytes live when the step started.

    Attributes:
        tracker: the tracker's peak minus its count at the start of the step.
        allocator: the allocator's peak rise in the same run (CPU: its events; CUDA:
            ``max_memory_allocated`` minus ``memory_allocated`` at the start).
        untracked: the allocator's peak rise in a second run of the step without the tracker
            (``None`` when not asked): where it differs from ``allocator``, running under the
            tracker changed what was measured.
        device: ``"cpu"`` or ``"cuda"``, the counter used.
    """

    tracker: int
    allocator: int
    untracked: int | None
    device: str

    @property
    def gap(self) -> int:
        """``allocator - tracker``: bytes the allocator served that no tensor the tracker saw held
        (kernel scratch, collective buffers, wrapped numbers), negative where the tracker charges
        what the allocator did not serve in this step."""
        return self.allocator - self.tracker

    def __str__(self) -> str:
        line = (f"tracker {self.tracker:,} B | allocator ({self.device}) {self.allocator:,} B, same run "
                f"(gap {self.gap:+,} B)")
        if self.untracked is not None:
            line += f" | allocator without the tracker {self.untracked:,} B ({self.untracked - self.allocator:+,} B)"
        return line


def _cuda_rise(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def _device_of(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> str:
    # the device type a step on this model (else optimizer) runs on: its first parameter's or buffer's
    tensors = []
    if model is not None:
        tensors = [*model.parameters(), *model.buffers()][:1]
    if not tensors and optimizer is not None:
        tensors = [p for g in optimizer.param_groups for p in g["params"]][:1]
    if tensors:
        return tensors[0].device.type
    return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"


def peak_beside_allocator(step: Callable[[], Any], model: torch.nn.Module | None = None,
                          optimizer: torch.optim.Optimizer | None = None, *, device: str | None = None,
                          untracked: bool = True, warmup: bool = True, **tracker_kwargs: Any) -> PeakComparison:
    """Run ``step()`` under a :class:`~memlab.profiler.MemoryTracker` and the allocator's own counter
    at once, and (``untracked=True``) once more under the allocator alone: the habit every chapter
    follows for the memory numbers it claims.

    >>> x = torch.ones(1024)
    >>> c = peak_beside_allocator(lambda: x * 2, untracked=False)
    >>> c.tracker, c.allocator >= 4096
    (4096, True)

    Args:
        step: a callable with no argument that runs the step. It runs twice when ``untracked``, so
            warm it up first (a first optimizer step creates the state) and make each call leave the
            memory as it found it.
        model, optimizer: passed to the tracker (its categories and module frames).
        device: ``"cpu"`` (``torch.profiler`` memory events) or ``"cuda"`` (the caching allocator's
            statistics). None: where the model's (else the optimizer's) first parameter or buffer lives; with
            neither, ``"cuda"`` once this process has initialised CUDA, else ``"cpu"``. (A fixed ``"cpu"``
            default measured CPU allocations beside a CUDA model: 4 B tracked, on an H200, 2026-11-28.)
        untracked: also measure a run without the tracker.
        warmup: on CPU, run ``step()`` once more first under the profiler, its figure discarded. The
            profiler learns a block's size only when the block is allocated while a profiler runs;
            the free of an older block is an event of unknown size, which it drops. A step that
            frees what the step before it made (``zero_grad(set_to_none=True)`` at its start) would
            then count the new gradients without the old ones going: measured, the whole gradient
            too high (8,398,868 B on a 2.1M-parameter MLP) in the first profiled run only.
        **tracker_kwargs: passed to :class:`~memlab.profiler.MemoryTracker`.

    Raises:
        ValueError: ``device`` is neither ``"cpu"`` nor ``"cuda"``, or ``step`` is not callable.
    """
    if device is None:
        device = _device_of(model, optimizer)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; allowed: 'cpu' or 'cuda'")
    if not callable(step):
        raise ValueError(f"step={step!r} is not callable; allowed: a function of no argument that runs the step")
    tracker = MemoryTracker(model, optimizer, device=device, **tracker_kwargs)
    start: list[int] = []

    def tracked() -> None:
        with tracker:
            start.append(tracker.current_bytes)
            step()

    counter = _cuda_rise if device == "cuda" else (lambda f: allocator_peak(f)[0])

    def measure(f: Callable[[], Any]) -> int:
        # garbage of earlier code (reference cycles holding tensors) collected first, and no collection inside:
        # a cycle freed in the middle of one measured run lowers its count by the tensor's size. Seen: the
        # tracked run's allocator figure 4,076 B under the tracker's in one run in three after
        # tests/ch01/test_tracker_fastpath.py (also before this session's changes); with this, 0 in 6
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            return counter(f)
        finally:
            if enabled:
                gc.enable()

    if warmup and device == "cpu":
        measure(step)  # the blocks the measured runs free are then ones the profiler saw allocated
    rise = measure(tracked)
    alone = measure(step) if untracked else None
    return PeakComparison(tracker.peak_bytes - start[0], rise, alone, device)
