"""What running under MemoryTracker changes in the step it measures (lecture 05, section 9).

Autograd sums the gradients of a tensor used several times in its input buffer. Without a Python
dispatch mode it adds each new gradient into the first one in place (``aten::add_``); under any
``TorchDispatchMode`` every tensor counts as "subclass-like" (``at::isTensorSubclassLike`` returns
true while ``c10::impl::dispatch_mode_enabled()``), so the engine adds out of place
(``aten::add``) and, for an instant, holds one more gradient-sized buffer. The tracker counts that
buffer exactly (it is in its run); the run without the tracker never allocates it. These tests pin
the size of the difference and its cause on this CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from memlab import attention
from memlab.profiler import allocator_peak, peak_beside_allocator

N = 1 << 16  # elements of the tensor whose gradient is summed: 262,144 B in fp32
SCALARS = 64  # 8-byte wrapped numbers no op returns: the only other difference between the counters


class NoOp(TorchDispatchMode):
    """A dispatch mode that only runs each op: no bookkeeping, no reference kept."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def used(times: int) -> None:
    """A step where ``y`` feeds ``times`` branches: autograd sums ``times`` gradients of ``y``."""
    x = torch.randn(N, requires_grad=True)
    y = x * 2
    loss = sum((y * (i + 2)).sum() for i in range(times))
    loss.backward()


def test_a_gradient_summed_twice_costs_one_buffer_more_under_the_tracker():
    once = peak_beside_allocator(lambda: used(1))
    twice = peak_beside_allocator(lambda: used(2))
    for c in (once, twice):  # the tracker counts its own run: the same as the allocator in that run
        assert abs(c.gap) <= SCALARS, c
    assert abs(once.untracked - once.allocator) <= SCALARS, once  # nothing summed: nothing changes
    # summed: the run without the tracker peaks one gradient (N * 4 B) lower
    assert abs((twice.allocator - twice.untracked) - 4 * N) <= SCALARS, twice


def test_any_dispatch_mode_does_it_not_the_trackers_references():
    def under_noop():
        with NoOp():
            used(2)

    tracked = peak_beside_allocator(lambda: used(2))
    noop, _ = allocator_peak(under_noop)
    assert abs(noop - tracked.allocator) <= SCALARS, (noop, tracked)
    assert noop - tracked.untracked >= 4 * N - SCALARS, (noop, tracked)


def _adds(fn) -> tuple[int, int]:
    # (in-place adds, out-of-place adds) of N-element tensors the profiler records
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    names = [e.name for e in prof.events() if e.input_shapes and e.input_shapes[0] == [N]]
    return names.count("aten::add_"), names.count("aten::add")


def test_the_engine_adds_out_of_place_under_a_dispatch_mode():
    def under_noop():
        with NoOp():
            used(2)

    in_place, out_of_place = _adds(lambda: used(2))
    assert (in_place, out_of_place) == (1, 0)
    in_place, out_of_place = _adds(under_noop)
    assert in_place == 0 and out_of_place >= 1


def _attention_step(fn, heads=4, seq=256, dim=64):
    q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
    o = fn(q, k, v)
    o.backward(torch.ones_like(o))


def test_lecture_05_chunked_attention_difference_is_an_out_of_place_gradient_sum():
    # lecture 05's sizes: 4 heads x 256 x 64, chunks of 128. Each key/value chunk is a slice of k or v
    # whose backward returns a whole (1, 4, 256, 64) gradient (262,144 B), summed into k's / v's. Under
    # the tracker the sums run out of place; the highest of them allocates its 262,144 B right after a
    # 131,072-B block is freed, where the untracked run had its peak: +131,072 B (allocator events
    # read in time order, this CPU, torch 2.13)
    grad = 1 * 4 * 256 * 64 * 4
    chunked = peak_beside_allocator(lambda: _attention_step(
        lambda q, k, v: attention.chunked_attention(q, k, v, causal=True, q_chunk=128, kv_chunk=128)))
    assert abs(chunked.gap) <= SCALARS, chunked
    assert abs((chunked.allocator - chunked.untracked) - grad // 2) <= SCALARS, chunked
    flash = peak_beside_allocator(lambda: _attention_step(
        lambda q, k, v: attention.flash_attention(q, k, v, causal=True, block_q=128, block_k=128)))
    assert abs(flash.gap) <= SCALARS and abs(flash.untracked - flash.allocator) <= SCALARS, flash


def test_lecture_05_sdpa_scratch_is_a_gap_not_a_change():
    # SDPA's CPU kernel allocates scratch no op returns: the allocator serves more than the tracker
    # counts, in both runs alike (the tracker does not change SDPA's path)
    sdpa = peak_beside_allocator(lambda: _attention_step(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    assert sdpa.gap > 1024, sdpa
    assert abs(sdpa.untracked - sdpa.allocator) <= SCALARS, sdpa
