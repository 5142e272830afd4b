"""MemoryTracker's fast paths answer exactly as its general path.

``MemoryTracker.__torch_dispatch__`` counts the usual op (one tensor out; an in-place op on a tensor
it already tracks) without the general walk over outputs and arguments; ``_dispatch_general`` is
that walk for every op. A tracker whose dispatch is the general one is the reference here: over
views, in-place and out= ops, resizes, multi-output ops, nested tuples, lists of tensors, complex
and sparse tensors, storages born before the block, training steps (with checkpointing, AdamW and
SGD), fake tensors and CUDA's block rounding, both give the same report: peak, its categories,
phase, module and op, the end breakdown, phase and module peaks, the timeline, the live storages
and the op count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

try:
    import memlab  # noqa: F401
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "utils"))

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from memlab.models import TinyGPT, TinyGPTConfig, lm_loss, tiny_llama  # noqa: E402
from memlab.profiler import MemoryTracker  # noqa: E402


class GeneralTracker(MemoryTracker):
    """The reference: every op takes the general path."""

    __torch_dispatch__ = MemoryTracker._dispatch_general


class CountingTracker(MemoryTracker):
    """The fast tracker, counting the ops with tensors out that the general path counted (the fast path
    hands them to ``_count_outputs``), so a test can check that the fast path ran at all."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.general_ops = 0

    def _count_outputs(self, func, kind, out, args, kwargs, before):
        self.general_ops += isinstance(out, (torch.Tensor, tuple, list))
        return super()._count_outputs(func, kind, out, args, kwargs, before)


def report(tr: MemoryTracker) -> dict:
    return dict(
        peak=tr.peak_bytes, current=tr.current_bytes, phase=tr.peak_phase, module=tr.peak_module,
        event=tr.peak_event, at_peak=tr.breakdown("peak"), at_end=tr.breakdown("end"),
        timeline=tr.timeline, phase_peaks=tr.phase_peaks(), module_peaks=tr.module_peaks,
        live=sorted((s.nbytes, s.category) for s in tr.live_storages()), ops=tr._ops)


def both(work, **kwargs) -> tuple[dict, dict, CountingTracker]:
    """``work(tracker_class, **kwargs)`` (it builds its own inputs, then returns its tracker) with the
    fast and the general tracker; the two reports and the fast tracker."""
    fast = work(CountingTracker, **kwargs)
    general = work(GeneralTracker, **kwargs)
    return report(fast), report(general), fast


# ---------------------------------------------------------------- ops, one kind after another
def op_zoo(cls, timeline: bool = True):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=g)  # born before the block: its views cost nothing
    old_small = torch.empty(0)  # grown inside by an out= op, then by resize_
    old_target = torch.zeros(64, 32)  # written in place inside, never grown
    old_grown = torch.empty(10)  # first met inside by an in-place resize_ of itself: the growth costs
    keep = []
    with cls(timeline=timeline) as tr:
        a = torch.randn(64, 32, generator=g)
        b = torch.randn(64, 32, generator=g)
        # views of a new storage and of an old one
        keep += [a.view(-1), a.t(), a.transpose(0, 1), a[3:9], a.expand(2, 64, 32), a.unsqueeze(0), a.detach(),
                 a.as_strided((8, 8), (1, 8)), a.narrow(1, 2, 5), a.select(0, 1), a.reshape(32, 64), a.diagonal()]
        keep += [old.view(-1), old.t(), old[:5], old.detach(), old.unsqueeze(1)]
        # fresh single outputs, then freed
        c = a + b
        d = torch.matmul(a, b.t())
        del d
        e = (a * 2).sin().exp()
        # in-place: a tracked self, an old self, a slice of each, a returned alias kept
        a.add_(1.0)
        c.mul_(b)
        keep.append(c.clamp_(-1, 1))
        old_target.add_(1.0)
        old_target[:3].zero_()
        a[:2].fill_(0.5)
        c.copy_(b)
        # out= ops: into a new storage (the same size, then grown), into an old one (grown: the growth costs)
        out = torch.empty(64, 32)
        torch.add(a, b, out=out)
        grow = torch.empty(0)
        torch.mul(a, 3.0, out=grow)
        torch.mul(a, 2.0, out=old_small)
        # resize_ (an op): a new storage and an old one
        r = torch.empty(10)
        r.resize_(1000)
        old_small.resize_(5000)
        old_grown.resize_(1000)
        # multi-output ops (fresh), nested tuples, lists of tensors, views in lists
        values, idx = a.max(dim=0)
        sv, si = torch.sort(b, dim=1)
        ln = torch.native_layer_norm(a, [32], torch.ones(32), torch.zeros(32), 1e-5)
        parts = a.split(8)
        chunks = list(torch.chunk(b, 3, dim=1))
        rows = torch.unbind(c)
        grid = torch.meshgrid(torch.arange(5.0), torch.arange(7.0), indexing="ij")
        summed = torch._foreach_add([a, b], [c, e])
        torch._foreach_mul_(summed, 2.0)
        torch._foreach_add_([old_target, a], 1.0)
        cat = torch.cat([a, b, *summed])
        stacked = torch.stack(list(parts)[:3])
        # complex: views across dtypes, complex ops
        z = torch.complex(a, b)
        zr = torch.view_as_real(z)
        zc = torch.view_as_complex(zr)
        za = z.abs() + (z * z.conj()).real
        # sparse (no storage: not counted) and ops on it
        s = a.to_sparse()
        sd = (s * 2).to_dense()
        # scalars, a tensor built outside the dispatcher (lift_fresh), set_ to another storage
        item = a.sum().item()
        t = torch.tensor([1.0, 2.0, 3.0])
        holder = torch.empty(0)
        holder.set_(b.untyped_storage(), 0, (64, 32), (32, 1))
        del e, b
        keep += [c, out, grow, r, values, idx, sv, si, ln, parts, chunks, rows, grid, summed, cat, stacked,
                 z, zr, zc, za, s, sd, item, t, holder]
    del keep
    return tr


@pytest.mark.parametrize("timeline", [True, False])
def test_every_kind_of_op_gives_the_general_report(timeline):
    fast, general, tr = both(op_zoo, timeline=timeline)
    assert fast == general
    assert fast["ops"] > 60 and fast["peak"] > 0
    assert tr.general_ops < fast["ops"] / 2  # the fast path took most ops
    if timeline:
        assert len(fast["timeline"]) > 20


def test_the_zoo_charges_what_it_should():
    # a few of the zoo's figures, by hand, so that "equal" is not "equally wrong"
    x = torch.randn(64, 32)  # born before the block
    small = torch.empty(0)
    with MemoryTracker() as tr:
        v = x.t()  # a view of an old storage: 0 B
        assert tr.current_bytes == 0
        x.add_(1.0)  # in place on an old storage, not grown: 0 B
        assert tr.current_bytes == 0
        torch.mul(x, 2.0, out=small)  # an old, empty storage grown to 8192 B
        assert tr.current_bytes == 8192
        y = x + 1  # a new storage
        assert tr.current_bytes == 8192 + 8192
        y.mul_(2)  # in place on a tracked storage
        w = y.view(-1)  # a view of it
        assert tr.current_bytes == 8192 + 8192
        m, i = x.max(dim=0)  # two new storages: 32 floats, 32 int64
        assert tr.current_bytes == 8192 + 8192 + 128 + 256
        del y, w
        assert tr.current_bytes == 8192 + 128 + 256
        grown = torch.empty(10)
    with MemoryTracker() as tr:
        grown.resize_(1000)  # in place on an old self: 40 B -> 4000 B, the growth costs
        assert tr.current_bytes == 4000 - 40
    del v, m, i, grown


# ---------------------------------------------------------------- training steps
GPT = dict(block_size=64, n_layer=2, n_head=4, n_embd=64)


def _gpt() -> nn.Module:
    return TinyGPT(TinyGPTConfig(**GPT))


def _llama() -> nn.Module:
    return tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 48))


BUILDS = {"mlp": _mlp, "tinygpt": _gpt, "llama": _llama}


def training(cls, build: str, optim: str = "adamw", checkpointing: bool = False, steps: int = 2,
             timeline: bool = True, batch_inside: bool = True):
    torch.manual_seed(0)
    model = BUILDS[build]()
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optim == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    if build == "mlp":
        x, y = torch.randn(64, 48, generator=g), None
    else:
        x, y = torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)
    tr = cls(model, opt, timeline=timeline)
    with tr:
        for _ in range(steps):
            xb, yb = (x.clone(), None if y is None else y.clone()) if batch_inside else (x, y)
            if build == "mlp":
                loss = model(xb).pow(2).mean()
            elif build == "llama":
                loss = model(input_ids=xb, labels=yb).loss
            else:
                loss = lm_loss(model, xb, yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return tr


@pytest.mark.parametrize("build,kw", [
    ("mlp", {}),
    ("mlp", {"optim": "sgd", "batch_inside": False}),
    ("tinygpt", {}),
    ("tinygpt", {"checkpointing": True, "timeline": False}),
    ("llama", {}),
    ("llama", {"checkpointing": True}),
    ("llama", {"optim": "sgd", "timeline": False}),
])
def test_training_steps_give_the_general_report(build, kw):
    fast, general, tr = both(training, build=build, **kw)
    assert fast == general
    assert {"forward", "backward", "optimizer"} <= set(fast["phase_peaks"])
    assert fast["module_peaks"] and fast["at_end"]["optimizer"] > 0
    assert tr.general_ops < fast["ops"] / 4


def test_a_fake_tensor_step_gives_the_general_report():
    with FakeTensorMode():
        fast, general, tr = both(training, build="tinygpt")
    assert fast == general and fast["peak"] > 0
    assert tr.general_ops < fast["ops"] / 4  # fake tensors take the fast path too


def fake_cuda(cls, device=None):
    with FakeTensorMode():
        with cls(device=device) as tr:
            a = torch.empty(3, device="cuda")  # 12 B: one 512 B block
            b = torch.empty(200, device="cuda")
            c = (a + 1).view(3, 1)
            b.add_(1)
            d = torch.empty(10)  # cpu
            e = d * 2
            parts = b.split(7)
            m, i = b.view(20, 10).max(dim=1)
            o = torch.empty(0, device="cuda")
            torch.mul(b, 2.0, out=o)  # grown from 0 B to a 1024 B block
        tr.keep = [a, b, c, d, e, parts, m, i, o]
    return tr


@pytest.mark.parametrize("device", [None, "cuda", "cpu"], ids=["every_device", "gpu_only", "cpu_only"])
def test_fake_cuda_blocks_and_the_device_filter_give_the_general_report(device):
    # (ids without the word "cuda": the repository's conftest skips a test with that keyword on a CPU)
    fast, general, _ = both(fake_cuda, device=device)
    assert fast == general and fast["peak"] > 0
    if device == "cuda":
        assert fast["peak"] % 512 == 0


class Hooked(MemoryTracker):
    """A subclass with an after_op hook (the tracker then runs its full after-op bookkeeping)."""

    def after_op(self):
        return self.current_bytes % 3 != 1  # leave a few moments out


class HookedGeneral(Hooked):
    __torch_dispatch__ = MemoryTracker._dispatch_general


def test_a_subclass_hook_gives_the_same_report_on_both_paths():
    assert report(op_zoo(Hooked)) == report(op_zoo(HookedGeneral))


def test_module_hooks_run_where_the_public_api_puts_them_and_leave_with_the_block():
    # the tracker adds its forward hooks to a plain module's hook dicts itself (no RemovableHandle): they
    # must run after the hooks registered before the block and before those registered inside it, as
    # register_forward_hook(always_call=True) places them, and leave every dict as it found it
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    seen = []
    model[0].register_forward_hook(lambda m, a, o: seen.append(("before", tr._frames.innermost)))
    dicts = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
             "_forward_hooks_always_called")
    snapshot = [{d: dict(getattr(m, d)) for d in dicts} for m in model.modules()]
    tr = MemoryTracker(model)
    with tr:
        assert all(type(h) is tuple for h in tr._frames._handles)  # the direct path ran
        inside = model[0].register_forward_hook(lambda m, a, o: seen.append(("inside", tr._frames.innermost)))
        model(torch.randn(2, 4)).sum().backward()
        inside.remove()
    # the tracker's post-forward hook pops the module's frame between the two
    assert seen == [("before", "0"), ("inside", "")]
    assert [{d: dict(getattr(m, d)) for d in dicts} for m in model.modules()] == snapshot
    assert set(tr.module_peaks) == {"", "0", "1"}
