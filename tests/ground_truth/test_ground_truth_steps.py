"""Ground truth for memory: memlab's steps side by side with the production ones, counted by the
CPU allocator's own events, and MemoryTracker proven equal to those events where it is used.

The counter here is not memlab's: ``torch.profiler.profile(profile_memory=True)`` records one event
per block the CPU allocator serves or takes back; summed in time order they give the allocator's
live bytes, whose highest point is the peak (``_allocator``, written here independently of
``memlab.profiler.allocator_peak``). Every comparison states its tolerance; where two numbers
differ by a known amount, the assert message names it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import memlab  # noqa: F401
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "utils"))

from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from memlab import attention as att  # noqa: E402
from memlab.profiler import MemoryTracker, allocator_peak  # noqa: E402

B, H, S, D, BLOCK = 1, 2, 256, 32, 64  # attention shape: (B, H, S, D) fp32, 64 KiB per tensor
QKV = B * H * S * D * 4


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


def _op(n):
    """The chain of ops and frames that asked for an allocation, innermost first ("" if none)."""
    names, p = [], n.parent
    while p is not None:
        names.append(p.name)
        p = p.parent
    return " < ".join(names)


def _allocator(fn, inner=None):
    """Run ``fn`` profiled (inside ``inner``, a context manager, if given). Returns the allocator's
    peak above the start, its live bytes at the end, and the blocks alive at the peak as
    ``(size, the ops that asked for it, innermost first)``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if inner is None:
            fn()
        else:
            with inner:
                fn()
    allocs = sorted((n for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
                     if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    cur = top = 0
    live: dict[int, object] = {}
    at_top: dict[int, object] = {}
    for n in allocs:
        f = n.extra_fields
        cur += f.alloc_size
        if f.alloc_size > 0:
            live[f.ptr] = n
        else:
            live.pop(f.ptr, None)
        if cur > top:
            top, at_top = cur, dict(live)
    return top, cur, [(n.extra_fields.alloc_size, _op(n)) for n in at_top.values()]


IMPLS = {
    "naive": lambda q, k, v: att.naive_attention(q, k, v, causal=True),
    "chunked": lambda q, k, v: att.chunked_attention(q, k, v, causal=True, q_chunk=BLOCK, kv_chunk=BLOCK),
    "flash": lambda q, k, v: att.flash_attention(q, k, v, causal=True, block_q=BLOCK, block_k=BLOCK),
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, requires_grad=i < 3) for i in range(4)]


def _attention_step(name, backward, old=None):
    """One attention call (and its backward): on ``old`` inputs made before, or on new ones."""
    def run():
        q, k, v, do = old if old is not None else _inputs()
        o = IMPLS[name](q, k, v)
        if backward:
            o.backward(do)
            if old is not None:
                for t in old[:3]:
                    t.grad = None
    return run


@pytest.fixture(autouse=True)
def _one_thread():
    """SDPA's CPU kernel sizes its scratch by the thread count: one thread, the same on every machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------ MemoryTracker == allocator events
@pytest.mark.parametrize("inputs", ["before", "inside"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("name", ["naive", "chunked", "flash"])
def test_tracker_equals_the_allocator_on_chapter_05s_attention(name, backward, inputs):
    """Chapter 05's torch attentions, inputs made before the tracker or inside it, the tracker and
    the profiler on the same run: the allocator's peak is the tracker's plus scalars no op returns
    (8-byte wrapped Python numbers such as the ``scale`` in ``s * scale``, made inside the C++ call,
    and 8-byte constants inside composite ops such as ``isinf``), at most 128 B here, against 2 KiB
    for the smallest plausible mistake (one row of logsumexp). Before the view fix the tracker
    charged q, k and v (3 x 64 KiB) made before it as soon as an op sliced them (flash fwd+bwd,
    inputs before: 733,184 B tracked where the allocator saw 471,060 B)."""
    old = _inputs() if inputs == "before" else None
    step = _attention_step(name, backward, old)
    step()  # warm-up
    tracker = MemoryTracker()
    top, end, at_top = _allocator(step, inner=tracker)
    scalars = sum(size for size, _ in at_top if size <= 8)
    assert 0 <= top - tracker.peak_bytes <= min(scalars, 128), (
        f"{name} {'fwd+bwd' if backward else 'fwd'}, inputs {inputs}: allocator peak {top} B, tracker "
        f"{tracker.peak_bytes} B; scalars (<= 8 B) alive at the allocator's peak: {scalars} B")


def test_a_dispatch_mode_changes_what_autograd_allocates():
    """The observer effect, named: under any Python dispatch mode (a no-op one here, or the tracker)
    autograd adds the gradients of a tensor used several times (chunked attention's slices of q)
    out of place, ``aten::add`` allocating a new buffer each time, where the plain run adds in place.
    The tracker is exact for the run it sees (test above); that run allocates more than an unobserved
    one. Flash and naive attention are unaffected."""
    class Noop(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for name, affected in (("chunked", True), ("flash", False), ("naive", False)):
        step = _attention_step(name, True)
        step()
        plain = _allocator(step)[0]
        observed = _allocator(step, inner=Noop())[0]
        tracker = MemoryTracker()
        with_tracker = _allocator(step, inner=tracker)[0]
        assert observed == with_tracker  # the tracker's run is any dispatch mode's run
        if affected:
            assert observed - plain >= QKV // 2, (name, plain, observed)
        else:  # only wrapped numbers (8 B each) differ
            assert 0 <= observed - plain <= 256, (name, plain, observed)


# ------------------------------------------------------------------ flash (memlab) vs SDPA
def test_flash_vs_sdpa_by_the_allocator():
    """memlab's flash attention (PyTorch) vs F.scaled_dot_product_attention (its CPU flash kernel),
    one causal forward + backward, inputs made inside the window, counted by the allocator with no
    tracker running. The old figure (README: flash peak 1.76x SDPA) came from the tracker charging
    q, k, v, made before it, when flash sliced them; SDPA's kernel takes them whole, and allocates
    scratch inside itself that no op returns (seen by the allocator only, inside its op)."""
    peaks = {}
    for name in ("flash", "sdpa", "naive"):
        step = _attention_step(name, True)
        step()
        peaks[name] = _allocator(step)[0]
    inputs = 4 * QKV
    # both hold the inputs (4 x 64 KiB), the three gradients and the output; flash adds its fp32
    # block temporaries (a few 64 x 64 blocks), SDPA its kernel's scratch: within 25% of each other
    ratio = peaks["flash"] / peaks["sdpa"]
    assert 0.8 <= ratio <= 1.25, f"flash {peaks['flash']} B / SDPA {peaks['sdpa']} B = {ratio:.3f}"
    assert peaks["flash"] >= inputs + 3 * QKV and peaks["sdpa"] >= inputs + 3 * QKV
    # and both far below the full score matrix (naive keeps S x S probabilities per head)
    assert peaks["naive"] > 2 * peaks["flash"]

    # the tracker, same run, sees SDPA's inputs, outputs and saved tensors but not its scratch:
    tracker = MemoryTracker()
    top, _, at_top = _allocator(_attention_step("sdpa", True), inner=tracker)
    inside_sdpa = sum(size for size, ops in at_top if "scaled_dot_product" in ops)
    scalars = sum(size for size, _ in at_top if size <= 8)
    unseen = top - tracker.peak_bytes
    assert 1024 < unseen <= inside_sdpa + scalars, (
        f"allocator {top} B - tracker {tracker.peak_bytes} B = {unseen} B should be scratch of SDPA's CPU "
        f"kernel (blocks allocated inside the SDPA ops and alive at the peak: {inside_sdpa} B, outputs included)")


# ------------------------------------------------------------------ memlab.checkpoint vs torch.utils.checkpoint
class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _checkpointed_step(model, how):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from memlab.checkpoint import checkpoint as memlab_checkpoint

    def run():
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        h = x
        for blk in model:
            if how == "memlab":
                h = memlab_checkpoint(blk, h)
            elif how == "torch":
                h = torch_checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        h.square().mean().backward()
        model.zero_grad(set_to_none=True)
    return run


def test_memlab_checkpoint_vs_torch_checkpoint_by_the_allocator():
    """Four residual MLP blocks (width 64, batch 256), each checkpointed: memlab.checkpoint and
    torch.utils.checkpoint(use_reentrant=False), one forward + backward, counted by the allocator
    with nothing else running. Both keep each block's input only and recompute one block at a time:
    equal peaks within 1% (the smallest plausible mistake, keeping one block's 256 x 256 hidden
    activation, is 256 KiB)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(64) for _ in range(4)])
    peaks = {}
    for how in ("none", "memlab", "torch"):
        step = _checkpointed_step(model, how)
        step()
        peaks[how] = _allocator(step)[0]
    ratio = peaks["memlab"] / peaks["torch"]
    assert abs(ratio - 1) <= 0.01, f"memlab {peaks['memlab']} B vs torch {peaks['torch']} B: {ratio:.4f}"
    assert peaks["none"] > 1.3 * peaks["torch"], peaks  # and checkpointing does save


# ------------------------------------------------------------------ ZeRO ranks vs plain data parallelism
SMALL_LLAMA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=1)
SEQ = 8  # a short batch: the step's peak is in the optimizer step, where the ranks communicate
GLOO_SLACK = 32 * 1024  # gloo's threads allocate a few blocks of their own, some runs (16 KiB seen)


def _zero_vs_dp(rank, world_size):
    """On each rank, for DP (stage 0: every gradient all-reduced, a full AdamW) and memlab's ZeRO
    stages 1 and 2: a warm-up step, then one step counted by the allocator (its batch made inside)
    and, separately, one step under the rank tracker. Returns per stage (bytes held at the start of
    the step, the allocator's rise over the step, the tracker's peak, parameters, parameter tensors)."""
    import torch.distributed as dist

    from memlab import distributed as D
    from memlab.models import lm_loss, tiny_llama

    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = tiny_llama(**SMALL_LLAMA)
        if stage:
            opt = D.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        vocab = model.config.vocab_size

        def step():
            g = torch.Generator().manual_seed(rank)
            x = torch.randint(0, vocab, (2, SEQ), generator=g)
            y = torch.randint(0, vocab, (2, SEQ), generator=g)
            lm_loss(model, x, y).backward()
            if stage == 0:
                with torch.no_grad():
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(world_size)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        held = sum(D.rank_bytes(model, opt).values())
        rise = _allocator(step)[0]
        tracker = D.rank_tracker(model, opt)
        with tracker:
            step()
        params = list(model.parameters())
        out[stage] = (held, rise, tracker.peak_bytes, sum(p.numel() for p in params), len(params))
    return out


def test_zero_ranks_vs_data_parallelism_by_the_allocator():
    """Two gloo processes, chapter 08's tiny Llama (one layer, a 2 x 8 batch, so that the peak is in
    the optimizer step): each rank's peak is the bytes it holds when the step starts (parameters,
    gradient buffers, optimizer state, counted from those tensors) plus the allocator's rise over
    the step, made with no tracker running.

    DP: the rank tracker (on another step of the same rank) gives the same peak within 64 B (its run
    allocates 48 B more: scalars under a dispatch mode). ZeRO-1: the allocator's peak is at the final
    all-gather of the parameters; its rise is the clone of this rank's slice (4 B x P/2) + a whole
    flat parameter (4 B x P) that gloo's ``c10d::_allgather_base_`` allocates inside itself and no
    op returns + the batch (+ up to 32 KiB that gloo's threads allocate in some runs; the buffer is
    297 KiB here). The tracker cannot see that buffer (nor, for ZeRO-2, the reduces' scratch during
    backward, which varies run to run): it puts ZeRO-1 below DP where the allocator puts it above."""
    from memlab import distributed as D

    ranks = D.launch(_zero_vs_dp, 2, timeout=240)
    batch = 2 * 2 * SEQ * 8  # x and y, int64
    for rank, res in enumerate(ranks):
        peak = {s: held + rise for s, (held, rise, _, _, _) in res.items()}
        tracked = {s: t for s, (_, _, t, _, _) in res.items()}
        n = res[0][3]
        flat = 4 * D.padded_size(n, 2)  # the flat parameter (fp32)
        assert abs(peak[0] - tracked[0]) <= 64, (
            f"rank {rank} DP: allocator {res[0][0]} B held + {res[0][1]} B rise = {peak[0]} B, tracker {tracked[0]} B")
        rise = res[1][1]
        assert 0 <= rise - (flat + flat // 2 + batch) <= GLOO_SLACK, (
            f"rank {rank} ZeRO-1: allocator rise {rise} B should be gloo's all-gather buffer {flat} B + the "
            f"slice's clone {flat // 2} B + the batch {batch} B (+ <= {GLOO_SLACK} B of gloo's own)")
        for s in (1, 2):
            assert tracked[s] < peak[s] - flat // 4, (
                f"rank {rank} ZeRO-{s}: tracker {tracked[s]} B, allocator {peak[s]} B: the tracker should miss gloo's "
                f"{flat} B buffer")
        assert tracked[1] < tracked[0] and peak[1] > peak[0], (
            f"rank {rank}: ZeRO-1 vs DP, tracker {tracked[1]} vs {tracked[0]} B, allocator {peak[1]} vs {peak[0]} B")
        # ZeRO-2 holds less than ZeRO-1 when the step starts (its gradient half); its allocator peak need not be
        # lower: the reduces' scratch during backward varies run to run (one CI run: ZeRO-2 1,396,228 B against
        # ZeRO-1 1,367,684 B on rank 1), so the peaks are not compared
        assert res[2][0] < res[1][0], f"rank {rank}: ZeRO-2 holds {res[2][0]} B vs ZeRO-1 {res[1][0]} B"
