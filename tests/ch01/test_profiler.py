"""Tests for memlab.profiler: MemoryTracker against PyTorch's MemTracker, fake tensors and CUDA."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn

try:
    import memlab  # noqa: F401
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "utils"))

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from memlab.models import TinyGPT, TinyGPTConfig, lm_loss, tiny_llama  # noqa: E402
from memlab.course.reference.ch01 import LiveBytes, categorize  # noqa: E402
from memlab.profiler import (  # noqa: E402
    CATEGORIES,
    PHASES,
    MemoryTracker,
    kernel_scratch_at_peak,
    phase_peaks,
)

GPT = dict(block_size=64, n_layer=2, n_head=4, n_embd=64)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(48, 192), nn.GELU(), nn.LayerNorm(192), nn.Linear(192, 48))


def gpt(**kw) -> nn.Module:
    return TinyGPT(TinyGPTConfig(**{**GPT, **kw}))


def llama() -> nn.Module:
    return tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)


def batch(model: nn.Module, b: int = 4, t: int = 32):
    g = torch.Generator().manual_seed(1)
    if isinstance(model, nn.Sequential):
        return torch.randn(b * t, 48, generator=g), None
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def train_step(model, opt, x, y) -> None:
    loss = model(x).pow(2).mean() if y is None else lm_loss(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def setup(build, optim="adamw", checkpointing=False, seed=0):
    torch.manual_seed(seed)
    model = build()
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, opt


def _clone(t):
    return None if t is None else t.clone()


def memtracker_peaks(build, steps=2, batch_inside=True, **kw) -> list[int]:
    """Peak 'Total' of PyTorch's MemTracker, one fresh tracker per step (it refuses a 2nd root call).
    ``batch_inside``: the batch is copied inside the tracked block (as moving it to the device would)."""
    model, opt = setup(build, **kw)
    x, y = batch(model)
    out = []
    for _ in range(steps):
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            train_step(model, opt, *((_clone(x), _clone(y)) if batch_inside else (x, y)))
        out.append(sum(dev["Total"] for dev in mt.get_tracker_snapshot("peak").values()))
    return out


def our_peaks(build, steps=2, batch_inside=True, **kw) -> list[int]:
    model, opt = setup(build, **kw)
    x, y = batch(model)
    out = []
    for _ in range(steps):
        tr = MemoryTracker(model, opt)
        with tr:
            train_step(model, opt, *((_clone(x), _clone(y)) if batch_inside else (x, y)))
        out.append(tr.peak_bytes)
    return out


# ---------------------------------------------------------------- byte-exact agreement with MemTracker
@pytest.mark.parametrize(
    "name,build,kw",
    [
        ("mlp-adamw", mlp, {}),
        ("mlp-sgd", mlp, {"optim": "sgd"}),
        ("tinygpt-adamw", gpt, {}),
        ("tinygpt-adamw-checkpointing", gpt, {"checkpointing": True}),
        ("tiny_llama-adamw", llama, {}),
        ("tiny_llama-adamw-checkpointing", llama, {"checkpointing": True}),
    ],
)
def test_peak_equals_memtracker_to_the_byte(name, build, kw):
    # step 1 creates the optimizer state inside the step, step 2 starts with it
    want = memtracker_peaks(build, **kw)
    got = our_peaks(build, **kw)
    assert got == want, f"{name}: MemoryTracker {got} vs MemTracker {want}"
    assert want[1] > want[0] or kw.get("optim") == "sgd" or name.startswith("mlp")


def test_nested_with_memtracker_same_run():
    model, opt = setup(gpt)
    x, y = batch(model)
    for _ in range(2):
        mt = MemTracker()
        mt.track_external(model, opt)
        tr = MemoryTracker(model, opt)
        with mt, tr:
            train_step(model, opt, x.clone(), y.clone())
        assert tr.peak_bytes == mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("build", [gpt, llama])
def test_memtracker_charges_a_batch_made_before_it_the_allocator_does_not(build):
    """PyTorch's MemTracker shares the blind spot MemoryTracker had: the step's loss views the
    targets ``y`` (made before the block), and MemTracker charges y's whole storage then, though
    the allocator allocates nothing for a view. MemoryTracker charges 0 B for it."""
    model, _ = setup(build)
    y_bytes = batch(model)[1].untyped_storage().nbytes()
    want = memtracker_peaks(build, batch_inside=False)
    got = our_peaks(build, batch_inside=False)
    assert [w - g for w, g in zip(want, got)] == [y_bytes] * 2, (
        f"MemTracker {want} vs MemoryTracker {got}: expected MemTracker higher by the targets' {y_bytes} B")


# ---------------------------------------------------------------- counting rules
def test_views_count_once_and_frees_are_subtracted():
    with MemoryTracker() as tr:
        a = torch.zeros(1000)  # 4000 B
        v = a[10:20].view(2, 5)  # views share the storage
        w = a.unsqueeze(0)
        assert tr.current_bytes == 4000
        b = a * 2  # a new storage
        assert tr.current_bytes == 8000
        del a, v, w  # the last reference to the first storage: its bytes are given back
        assert tr.current_bytes == 4000
    assert tr.peak_bytes == 8000
    del b
    assert tr.current_bytes == 0
    assert tr.breakdown("end") == {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": 0, "other": 4000}


def test_storage_dies_with_its_last_view():
    with MemoryTracker() as tr:
        a = torch.ones(256)
        v = a[:4]
        del a
        assert tr.current_bytes == 1024  # v keeps the whole storage alive
        del v
        assert tr.current_bytes == 0


def test_categories_and_breakdown_keys():
    model, opt = setup(gpt)
    x, y = batch(model)
    train_step(model, opt, x, y)  # optimizer state exists now
    param_bytes = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage()._cdata: p for p in model.parameters()}.values())
    buf_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    opt_bytes = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
    tr = MemoryTracker(model, opt)
    with tr:
        loss = lm_loss(model, x, y)
        loss.backward()
        grads_mid = tr.breakdown("end")["gradients"]
        opt.step()
    for at in ("peak", "end"):
        bd = tr.breakdown(at)
        assert list(bd) == list(CATEGORIES)
        assert all(isinstance(v, int) and v >= 0 for v in bd.values())
    end = tr.breakdown("end")
    assert sum(tr.breakdown("peak").values()) == tr.peak_bytes
    assert end["parameters"] == param_bytes + buf_bytes
    assert end["optimizer"] == opt_bytes
    assert grads_mid == param_bytes  # every parameter has a gradient after backward
    assert end["gradients"] == param_bytes  # no zero_grad inside the block
    assert tr.breakdown("peak")["activations"] > 0
    with pytest.raises(ValueError, match="'peak', 'end'"):
        tr.breakdown("middle")


def test_optimizer_state_appears_at_first_step():
    model, opt = setup(mlp)
    x, _ = batch(model)
    tr = MemoryTracker(model, opt)
    with tr:
        train_step(model, opt, x, None)
    tl = tr.timeline
    assert tl[0].bytes["optimizer"] == 0
    assert tr.breakdown("end")["optimizer"] == sum(2 * p.numel() * 4 + 4 for p in model.parameters())  # exp_avg, exp_avg_sq, step
    first_opt = next(e for e in tl if e.bytes["optimizer"] > 0)
    assert first_opt.phase == "optimizer"


def test_phases_in_order_and_phase_peaks():
    model, opt = setup(gpt)
    x, y = batch(model)
    tr = MemoryTracker(model, opt)
    with tr:
        train_step(model, opt, x, y)
    phases = [e.phase for e in tr.timeline]
    order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert order[:4] == ["other", "forward", "backward", "optimizer"], order
    pp = tr.phase_peaks()
    assert max(pp.values()) == tr.peak_bytes
    assert pp == phase_peaks(tr.timeline)
    assert [e.index for e in tr.timeline] == sorted(e.index for e in tr.timeline)
    # forward rises, backward: gradients rise while activations fall
    bw = [e for e in tr.timeline if e.phase == "backward"]
    assert bw[-1].bytes["gradients"] > bw[0].bytes["gradients"]
    assert bw[-1].bytes["activations"] < max(e.bytes["activations"] for e in bw)


def test_module_peaks_and_peak_module():
    model, opt = setup(gpt)
    x, y = batch(model)
    train_step(model, opt, x, y)
    tr = MemoryTracker(model, opt)
    with tr:
        train_step(model, opt, x, y)
    names = {n for n, _ in model.named_modules()}
    mp = tr.module_peaks
    assert {"", "blocks.0", "blocks.1.mlp.c_fc", "lm_head"} <= set(mp)
    assert set(mp) <= names
    assert all(v <= tr.peak_bytes for v in mp.values())
    assert tr.peak_module in names
    assert mp[tr.peak_module] == tr.peak_bytes
    assert mp[""] == max(e.total for e in tr.timeline if e.phase in ("forward", "backward"))
    # a parent's peak is at least each child's
    assert mp["blocks.0"] >= mp["blocks.0.mlp"] >= mp["blocks.0.mlp.c_fc"]


def test_hooks_removed_after_exit():
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    model, opt = setup(gpt)
    n_pre, n_post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    x, y = batch(model)
    with MemoryTracker(model, opt):
        train_step(model, opt, x, y)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (n_pre, n_post)


def test_leak_shows_as_growing_current_bytes():
    model, opt = setup(mlp)
    x, _ = batch(model)
    history_leaky, history_ok = [], []
    with MemoryTracker(model, opt) as leaky:
        for i in range(4):
            loss = model(x).pow(2).mean()
            loss.backward(retain_graph=True)  # the graph keeps its saved activations ...
            opt.step()
            opt.zero_grad()
            history_leaky.append(loss)  # ... and the history keeps every graph alive
            if i == 0:
                after_one = leaky.current_bytes
    assert leaky.current_bytes > after_one + 2 * 48 * 128 * 4
    with MemoryTracker(model, opt) as ok:
        for i in range(4):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            history_ok.append(loss.item())
            if i == 0:
                after_one = ok.current_bytes
    assert ok.current_bytes == after_one


def test_report_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    model, opt = setup(gpt)
    x, y = batch(model)
    tr = MemoryTracker(model, opt)
    with tr:
        train_step(model, opt, x, y)
    text = tr.report()
    for word in (*CATEGORIES, "peak", "forward", "backward", "optimizer", str(tr.peak_bytes)):
        assert word in text
    ax = tr.plot(title="step")
    assert ax.get_xlabel() == "op index"
    assert len(ax.collections) >= 5  # one area per category (plus phase shading)
    import matplotlib.pyplot as plt

    plt.close(ax.figure)
    with pytest.raises(ValueError, match="unit"):
        tr.plot(unit="MB")


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        MemoryTracker(model="gpt2")
    with pytest.raises(TypeError, match="optimizer"):
        MemoryTracker(optimizer=object())


# ---------------------------------------------------------------- fake tensors
@pytest.mark.parametrize("build,checkpointing", [(gpt, False), (gpt, True), (llama, False)])
def test_fake_tensor_peak_equals_real_cpu_peak(build, checkpointing):
    real = our_peaks(build, checkpointing=checkpointing)
    with FakeTensorMode():
        fake = our_peaks(build, checkpointing=checkpointing)
    assert fake == real


def test_fake_cuda_tensors_rounded_to_allocator_blocks():
    with FakeTensorMode():
        with MemoryTracker() as tr:
            a = torch.empty(3, device="cuda")  # 12 B -> one 512 B block
            b = torch.empty(200, device="cuda")  # 800 B -> 1024 B
            c = a + 1
            assert tr.current_bytes == 512 + 1024 + 512
        with MemoryTracker(device="cuda") as only_cuda:
            d = torch.empty(10, device="cuda")
            e = torch.empty(10)  # cpu: not counted
            assert only_cuda.current_bytes == 512
    del a, b, c, d, e


# ---------------------------------------------------------------- lab reference helpers
def test_live_bytes_counter():
    lb = LiveBytes()
    x = torch.zeros(256)
    lb.track(x)
    lb.track(x[:10])
    lb.track(x.view(16, 16))
    assert lb.current == 1024
    y = torch.zeros(100, dtype=torch.float64)
    lb.track(y)
    assert (lb.current, lb.peak) == (1824, 1824)
    del x
    assert lb.current == 800
    del y
    assert (lb.current, lb.peak) == (0, 1824)


def test_categorize():
    model, opt = setup(mlp)
    x, _ = batch(model)
    train_step(model, opt, x, None)
    h = model[0](x)
    loss = model(x).sum()
    loss.backward()
    p = model[0].weight
    for phase in (None, *PHASES):  # owners first, whatever the phase
        assert categorize(p, model, opt, phase) == "parameters"
        assert categorize(p[:3], model, opt, phase) == "parameters"
        assert categorize(p.detach(), None, opt, phase) == "parameters"
        assert categorize(p.grad, model, opt, phase) == "gradients"
        assert categorize(opt.state[p]["exp_avg"], model, opt, phase) == "optimizer"
        assert categorize(opt.state[p]["step"], model, opt, phase) == "optimizer"
    want = {"forward": "activations", "backward": "activations", "optimizer": "optimizer", "other": "other"}
    for phase, cat in want.items():  # else the birth phase decides, grad_fn or not
        assert categorize(h, model, opt, phase) == cat
        assert categorize(torch.zeros(3), model, opt, phase=phase) == cat
    # phase=None: the documented grad_fn guess of the two-argument call
    assert categorize(h, model, opt) == "activations"
    assert categorize(torch.zeros(3), model, opt) == "other"


def test_categorize_bad_phase():
    with pytest.raises(ValueError, match=r"phase='fwd'.*'forward', 'backward', 'optimizer', 'other'"):
        categorize(torch.zeros(3), phase="fwd")


class _Births(TorchDispatchMode):
    """Nested inside a MemoryTracker: remembers the phase each new storage was born in (the phase
    the test is running, set by hand, not read from the tracker), and after every op compares
    categorize(t, model, opt, born) with the tracker's label for every storage alive (after
    every third op, to keep the test fast)."""

    def __init__(self, tracker, model, opt):
        super().__init__()
        self.tracker, self.model, self.opt = tracker, model, opt
        self.phase = "other"
        self.born = {}  # storage key -> (weakref to the storage, phase)
        self.compared, self.bad, self.seen, self.ops = 0, [], set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor):
                st = o.untyped_storage()
                b = self.born.get(st._cdata)
                if b is None or b[0]() is not st:  # new, or an old address reused
                    self.born[st._cdata] = (weakref.ref(st), self.phase)
        self.ops += 1
        if self.ops % 3 == 0:  # every third op keeps the test fast; each phase still has hundreds
            with _disable_current_modes():
                self.compare(f"after op {self.ops} ({func})")
        return out

    def compare(self, where):
        for key, st, n, cat in self.tracker.live_storages():
            b = self.born.get(key)
            born = b[1] if b is not None and b[0]() is st else "other"  # tracked at __enter__
            t = torch.empty(0, dtype=torch.uint8).set_(st)  # a tensor on that storage, nothing more
            got = categorize(t, self.model, self.opt, born)
            self.compared += 1
            self.seen.add((born, cat))
            if got != cat:
                self.bad.append((where, born, got, cat, n))


def test_categorize_agrees_with_the_tracker_on_every_live_storage():
    """A TinyGPT step with dropout (masks have no grad_fn), two steps so the second accumulates
    into existing state: categorize(t, model, opt, birth phase) equals the tracker's category for
    every storage alive, after every third op and at the end of each step."""
    model, opt = setup(lambda: gpt(dropout=0.1, n_layer=1))
    tracker = MemoryTracker(model, opt)
    probe = _Births(tracker, model, opt)
    for _ in range(2):
        with tracker, probe:
            probe.phase = "other"
            g = torch.Generator().manual_seed(1)
            x = torch.randint(0, 256, (2, 16), generator=g)  # the batch, born in "other"
            y = torch.randint(0, 256, (2, 16), generator=g)
            probe.phase = "forward"
            loss = lm_loss(model, x, y)
            probe.phase = "backward"
            loss.backward()
            probe.phase = "optimizer"
            opt.step()
            probe.phase = "other"
            opt.zero_grad()
            del loss
        with _disable_current_modes():
            probe.compare("after exit")
    assert probe.bad == [], probe.bad[:5]
    assert probe.compared > 5_000
    # every rule was exercised: each owner, and each birth phase of a storage nobody owns
    for pair in [("other", "parameters"), ("backward", "gradients"), ("optimizer", "optimizer"),
                 ("forward", "activations"), ("backward", "activations"), ("other", "other")]:
        assert pair in probe.seen, (pair, sorted(probe.seen))


def test_phase_peaks_function():
    tl = [(0, "other", {"parameters": 10}), (1, "forward", {"parameters": 10, "activations": 5}),
          (2, "forward", {"parameters": 10, "activations": 9}), (3, "backward", {"parameters": 10, "gradients": 3})]
    assert phase_peaks(tl) == {"other": 10, "forward": 19, "backward": 13}


def test_add_transient_raises_the_peak_for_one_moment():
    x = torch.zeros(256)  # 1 KiB, alive before and after
    with MemoryTracker() as tr:
        y = x * 2  # 1 KiB more
        before = tr.current_bytes
        tr.add_transient(10_000)
        assert tr.current_bytes == before  # gone again
        assert tr.peak_bytes == before + 10_000
        assert tr.breakdown(at="peak")["activations"] - tr.breakdown(at="end")["activations"] <= 10_000
        tr.add_transient(0)
        with pytest.raises(ValueError, match="nbytes=-1"):
            tr.add_transient(-1)
        with pytest.raises(ValueError, match="category='weights'"):
            tr.add_transient(5, category="weights")
    del y


def test_kernel_scratch_at_peak_reads_a_snapshot():
    fr = lambda name: [{"name": name, "filename": "x.cpp", "line": 1}]  # noqa: E731
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": fr("at::native::empty_cuda")},
        {"action": "alloc", "addr": 2, "size": 40, "frames": fr("at::native::structured_softmax_backward_cuda_out::impl(...)")},
        {"action": "alloc", "addr": 3, "size": 10, "frames": fr("at::native::structured_softmax_backward_cuda_out_functional::set_output")},
        {"action": "free_completed", "addr": 2, "size": 40},
        {"action": "alloc", "addr": 4, "size": 30, "frames": fr("at::native::structured_softmax_backward_cuda_out::impl(...)")},
    ]
    # the peak (150 B) is the 3rd event: block 2 is scratch there; block 3 is an op's output; block 4
    # comes after the peak
    assert kernel_scratch_at_peak({"device_traces": [trace]}) == 40
    assert kernel_scratch_at_peak({"device_traces": [trace]}, frames=("empty_cuda",)) == 100
    with pytest.raises(ValueError, match="device=1"):
        kernel_scratch_at_peak({"device_traces": [trace]}, device=1)


# ---------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("build", [gpt, llama])
def test_cuda_peak_matches_max_memory_allocated(build):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):  # large enough that ops' internal scratch buffers are a small share
        model = gpt(n_layer=4, n_embd=256, block_size=128) if build is gpt else tiny_llama(
            hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (t.to(dev) for t in batch(model, b=8, t=128))
    train_step(model, opt, x, y)  # optimizer state, cuBLAS workspace and caches exist from here on
    torch.cuda.synchronize()
    for _ in range(2):
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        tr = MemoryTracker(model, opt, device="cuda")
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        with tr:
            start = tr.current_bytes  # what the tracker counts of `before` (params, optimizer state)
            train_step(model, opt, x, y)
        torch.cuda.synchronize()
        scratch = kernel_scratch_at_peak(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        # bytes the tracker does not see (input batch, cuBLAS workspace) sit under both peaks;
        # scratch inside kernels (softmax backward's copy) only under the allocator's
        measured = torch.cuda.max_memory_allocated() - (before - start)
        # The tracker never over-counts. What it misses beyond the attributed scratch stays under 5%:
        # on an H100 (torch 2.11) the 4-layer TinyGPT below shows 5.0 MiB of 120.7 MiB (4.1%) that no
        # op returns and no known kernel frame names; the Llama and larger models are within 0.3%.
        assert tr.peak_bytes + scratch <= measured, (tr.peak_bytes, scratch, measured)
        assert measured - (tr.peak_bytes + scratch) <= 0.05 * measured, (tr.peak_bytes, scratch, measured)


# ---------------------------------------------------------------- storages born before tracking
def _allocator_events(fn):
    """Run ``fn`` under torch.profiler(profile_memory=True) (CPU): (peak of the allocator's live
    bytes above the start, live bytes at the end above the start), from its allocation events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = top = 0
    for n in sorted((n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns):
        cur += n.extra_fields.alloc_size
        top = max(top, cur)
    return top, cur


VIEWS = {
    "slice": lambda x: x[:10],
    "transpose": lambda x: x.transpose(0, 1),
    "t": lambda x: x.t(),
    "view": lambda x: x.view(-1),
    "reshape (a view)": lambda x: x.reshape(1024, 256),
    "as_strided": lambda x: x.as_strided((16, 16), (1, 16)),
    "expand": lambda x: x[:1].expand(8, -1),
    "unsqueeze": lambda x: x.unsqueeze(0),
    "narrow": lambda x: x.narrow(1, 3, 100),
    "select": lambda x: x.select(0, 5),
    "detach": lambda x: x.detach(),
    "split": lambda x: x.split(64),
    "in-place (returns its input)": lambda x: x.abs_(),
    "in-place on a slice": lambda x: x[:10].zero_(),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_a_view_of_a_storage_made_before_tracking_costs_nothing(name):
    """The tracker used to charge a storage born before tracking (1 MiB here) as soon as an op
    returned a view of it; the allocator allocates nothing for a view."""
    x = torch.randn(256, 1024)  # 1 MiB, made before the tracker
    keep = []
    with MemoryTracker() as tr:
        keep.append(VIEWS[name](x))
    assert (tr.peak_bytes, tr.current_bytes) == (0, 0), f"{name} of a 1 MiB tensor made before tracking"
    assert _allocator_events(lambda: keep.append(VIEWS[name](x)))[0] == 0  # the allocator agrees


def test_a_reduction_of_an_old_storage_costs_its_output_only():
    x = torch.randn(256, 1024)
    with MemoryTracker() as tr:
        s = x.t().sum(1)  # a view, then a new (1024,) tensor
        m = x[:, :512].amax(0)  # (512,)
    assert tr.peak_bytes == tr.current_bytes == 1024 * 4 + 512 * 4
    assert tr.breakdown("end")["other"] == 1024 * 4 + 512 * 4
    keep = []
    assert _allocator_events(lambda: keep.extend([x.t().sum(1), x[:, :512].amax(0)])) == (6144, 6144)
    del s, m


def test_growth_of_an_old_storage_is_charged():
    """An out= or in-place op that resizes a storage born before tracking: only the growth costs."""
    a = torch.randn(1000)
    out = torch.empty(0)
    small = torch.empty(10)  # 40 B, grown to 4000 B
    with MemoryTracker() as tr:
        torch.mul(a, 2.0, out=out)
        small.resize_(1000)
    assert tr.current_bytes == 4000 + 3960, tr.current_bytes
    assert out.untyped_storage().nbytes() == 4000
    del out, small
    assert tr.current_bytes == 0


def test_tensors_made_inside_are_charged_even_through_an_alias_op():
    """torch.tensor() builds its tensor outside the dispatcher and returns lift_fresh's alias of it:
    born inside the block all the same (AdamW's step counters are made this way)."""
    with MemoryTracker() as tr:
        t = torch.tensor([1.0, 2.0, 3.0, 4.0])
        v = t[:2]
    assert tr.current_bytes == 16
    del t, v


def test_a_batch_made_before_a_step_is_not_charged():
    model, opt = setup(gpt)
    x, y = batch(model)
    train_step(model, opt, x, y)  # AdamW's state exists
    with MemoryTracker(model, opt) as before:
        train_step(model, opt, x, y)
    with MemoryTracker(model, opt) as inside:
        train_step(model, opt, x.clone(), y.clone())
    # the copies are charged where the step first meets them; the originals never are
    assert inside.peak_bytes - before.peak_bytes == x.nbytes + y.nbytes, (before.peak_bytes, inside.peak_bytes)
    assert before.timeline[0].total == inside.timeline[0].total


# ---------------------------------------------------------------- the extension API
def test_rounding_policy_is_one_parameter():
    from memlab.profiler import CUDA_BLOCK_BYTES, DEFAULT_BLOCK_BYTES, allocator_bytes

    assert CUDA_BLOCK_BYTES == 512 and DEFAULT_BLOCK_BYTES == {"cuda": 512}
    assert [allocator_bytes(n, "cuda") for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    assert allocator_bytes(513, torch.device("cpu")) == 513
    assert allocator_bytes(100, "cpu", {"cpu": 64}) == 128
    with MemoryTracker(block_bytes={"cpu": 64}) as tr:
        a = torch.zeros(25)  # 100 B -> 128
        b = torch.zeros(16)  # 64 B -> 64
    assert tr.current_bytes == 192 and tr.allocated_bytes(100, "cpu") == 128
    assert MemoryTracker().allocated_bytes(100, "cuda") == 512
    for bad in ({"cpu": 0}, {"cpu": 1.5}, 512, {"cpu": True}):
        with pytest.raises(ValueError, match="block_bytes"):
            MemoryTracker(block_bytes=bad)
    del a, b


def test_after_op_hook_sees_each_total_and_can_leave_it_out():
    seen = []

    class Capped(MemoryTracker):
        def after_op(self):
            seen.append(self.current_bytes)
            return self.current_bytes <= 4000  # False: not a peak candidate, not an event

    with Capped() as tr:
        a = torch.zeros(1000)
        b = torch.zeros(1000)
        del b
    assert seen[:3] == [0, 4000, 8000]
    assert tr.peak_bytes == 4000 and max(e.total for e in tr.timeline) == 4000
    del a


def test_live_storages_and_sync_sizes():
    from memlab.profiler import LiveStorage

    with MemoryTracker() as tr:
        a = torch.zeros(100)
        (rec,) = tr.live_storages()
        assert isinstance(rec, LiveStorage) and rec.storage is a.untyped_storage()
        assert (rec.key, rec.nbytes, rec.category) == (a.untyped_storage()._cdata, 400, "other")
        a.untyped_storage().resize_(40)  # a storage method: no op, so nothing sees it ...
        assert tr.current_bytes == 400
        assert tr.sync_sizes(a) == -360 and tr.current_bytes == 40  # ... until the sizes are re-read
        a.untyped_storage().resize_(400)
        assert tr.sync_sizes() == 360 and tr.current_bytes == 400
    del a


def test_resizes_watches_storage_resize():
    """resizes=True (FSDP2 regrows and frees storages with UntypedStorage.resize_, no op): a storage
    born before tracking at 0 B and grown inside is charged its growth, its free subtracted."""
    shell = torch.empty(0)
    orig = torch.UntypedStorage.resize_
    with MemoryTracker(resizes=True) as tr:
        shell.untyped_storage().resize_(4096)
        grown = tr.current_bytes
        torch.zeros(1)  # an op: an event
        shell.untyped_storage().resize_(0)
        torch.zeros(1)
    assert grown == 4096 and tr.peak_bytes == 4096 + 4 and tr.current_bytes == 0  # + the 4-byte zeros(1)
    assert torch.UntypedStorage.resize_ is orig
    with MemoryTracker() as plain:  # without resizes, a storage method is invisible
        shell.untyped_storage().resize_(4096)
    assert plain.peak_bytes == 0


def test_the_lab_references_live_in_the_course_and_the_profiler_does_not_import_it():
    """Chapter 01's lab answers live in memlab.course.reference.ch01 only: the course imports the
    profiler, never the other way round, and the profiler re-exports none of them."""
    import subprocess
    import sys

    import memlab.profiler as prof
    from memlab.course.reference import ch01

    for name in ("LiveBytes", "categorize", "fake_activation_bytes", "train_losses"):
        assert hasattr(ch01, name) and not hasattr(prof, name), name
    assert ch01.phase_peaks is prof.phase_peaks  # the tracker's own, used by MemoryTracker.phase_peaks
    code = "import sys, memlab.profiler; print('memlab.course.reference.ch01' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_peak_beside_allocator_counts_both_in_one_run_and_refuses_bad_input():
    """The chapters' habit: the tracker's rise and the allocator's, same run, plus an untracked run."""
    from memlab.profiler import peak_beside_allocator

    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(32, 64)

    def step():
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists before the measured steps
    c = peak_beside_allocator(step, m, opt)
    if abs(c.gap) > 64:
        # once in four full-suite runs (2 workers, 2 cores) torch.profiler's allocator events read 4,076 B below
        # both the tracker and the untracked run; never alone or in this module's run. Cause not found: measured
        # once more, and the second reading must agree (a tracker that is off is off both times)
        c = peak_beside_allocator(step, m, opt)
    grads = sum(p.numel() * 4 for p in m.parameters())
    assert c.tracker >= grads + 32 * 256 * 4  # the gradients and at least one hidden activation
    assert abs(c.gap) <= 64 and c.untracked is not None and abs(c.untracked - c.allocator) <= 64
    assert "tracker" in str(c) and "allocator" in str(c)
    with pytest.raises(ValueError, match="device='meta'"):
        peak_beside_allocator(step, device="meta")
    with pytest.raises(ValueError, match="step="):
        peak_beside_allocator(3)


def test_peak_beside_allocator_measures_where_the_model_lives(monkeypatch):
    # no device given: the model's (else the optimizer's) device; with neither, CUDA once it is initialised. A fixed
    # "cpu" default counted CPU allocations beside a CUDA model on an H200 (4 B tracked).
    from memlab.profiler import compare

    meta = torch.nn.Linear(2, 2, device="meta")
    assert compare._device_of(meta, None) == "meta"
    assert compare._device_of(torch.nn.Module(), torch.optim.SGD(meta.parameters(), lr=0.1)) == "meta"
    assert compare._device_of(torch.nn.Linear(2, 2), None) == "cpu"
    with pytest.raises(ValueError, match="device='meta'"):  # named as it was found
        compare.peak_beside_allocator(lambda: None, meta)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert compare._device_of(None, None) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert compare._device_of(None, None) == "cpu"


def test_allocator_peak_keeps_the_profilers_unknown_block_note_out_of_stderr_but_not_the_steps_own(capfd):
    """Freeing a block made before the profiler started makes PyTorch log a C++ note on stderr; it
    is a documented limit of allocator_peak, not the learner's business. The step's own stderr stays."""
    import os

    from memlab.profiler import allocator_peak

    old = [torch.ones(1000)]

    def step():
        old.pop()  # a block allocated before the profiler: its free is not seen (and PyTorch says so)
        os.write(2, b"the step's own line\n")
        return torch.ones(10)

    peak, _ = allocator_peak(step)
    err = capfd.readouterr().err
    assert peak == 40 and "the step's own line" in err
    assert "allocated before the profiling started" not in err


def test_peak_beside_allocator_warms_up_the_profiler_for_a_step_that_frees_the_last_steps_gradients():
    """zero_grad(set_to_none=True) at the start of a step frees gradients made outside any profiler:
    torch.profiler drops frees of blocks it never saw allocated, so a first profiled run counts the
    new gradients without the old ones leaving. The warm-up run makes both counters agree."""
    from memlab.profiler import peak_beside_allocator

    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(32, 64)

    def step():
        opt.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        opt.step()

    step()
    grads = sum(p.numel() * 4 for p in m.parameters())
    cold = peak_beside_allocator(step, m, opt, warmup=False)
    assert cold.gap >= grads  # the old gradients' free went unseen
    step()  # gradients made outside a profiler again
    warm = peak_beside_allocator(step, m, opt)
    assert abs(warm.gap) <= 64 and abs(warm.untracked - warm.allocator) <= 64


@pytest.mark.parametrize("build", [gpt, llama], ids=["tinygpt", "llama"])
def test_peak_only_mode_answers_as_the_timeline_mode(build):
    # timeline=False records no events, yet its peak, categories, phase peaks and module peaks are the
    # timeline mode's (Llama's attention modules return several tensors: the first gradient frames them)
    results = []
    for timeline in (True, False):
        model, opt = setup(build)
        x, y = batch(model)
        if y is None or build is gpt:
            step = lambda: train_step(model, opt, x, y)  # noqa: E731
        else:
            step = lambda: (model(input_ids=x, labels=y).loss.backward(), opt.step(), opt.zero_grad())  # noqa: E731
        tr = MemoryTracker(model, opt, timeline=timeline)
        with tr:
            step()
            step()
        if timeline:
            assert tr.phase_peaks() == phase_peaks(tr.timeline) and len(tr.timeline) > 10
        else:
            assert tr.timeline == []
        results.append((tr.peak_bytes, tr.breakdown("peak"), tr.breakdown("end"), tr.peak_phase, tr.peak_module,
                        tr.phase_peaks(), tr.module_peaks, tr.peak_event))
    assert results[0] == results[1]
    assert set(results[1][5]) >= {"forward", "backward", "optimizer"}
    assert any(name.endswith("self_attn") for name in results[1][6]) or build is gpt


def test_a_compiled_function_in_the_block_runs_and_is_counted():
    # the hook is not wrapped in torch._disable_dynamo (a per-op cost): torch.compile inside the block still works
    f = torch.compile(lambda x: (x * 2).sin() + 1, backend="eager")
    x = torch.randn(1000)
    with MemoryTracker() as tr:
        y = f(x)
    assert torch.allclose(y, (x * 2).sin() + 1)
    assert tr.peak_bytes >= 2 * 4000 and tr.current_bytes >= 4000  # x * 2 (freed after sin), then y alive


def test_no_collection_runs_inside_allocator_peak():
    """A model from an earlier measurement, kept by a reference cycle, holds blocks the allocator saw made
    under that earlier profiler. Collected inside the next window, its free is reported and that peak falls
    below what the step itself allocated (so a chapter 09 test once read 882,896 B for a step whose peak is
    1,474,768 B). No collection runs inside ``fn``, however much cyclic garbage it makes."""
    import gc

    from memlab.profiler import allocator_peak

    starts, inside = [], []

    def count(phase, info):
        if phase == "start":
            starts.append(info["generation"])

    def step():
        before = len(starts)
        for _ in range(2000):  # cyclic garbage: with the collector on, these thresholds collect every time
            a = []
            a.append(a)
        inside.append(len(starts) - before)

    old = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(1, 1, 1)
    try:
        step()  # the collector on: it runs
        allocator_peak(step)
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(count)
    assert inside[0] > 0 and inside[1] == 0, inside


def test_allocator_peak_turns_the_collector_off_inside_and_back_as_it_was():
    import gc

    from memlab.profiler import allocator_peak

    seen = []
    for before in (True, False):
        (gc.enable if before else gc.disable)()
        try:
            allocator_peak(lambda: seen.append(gc.isenabled()))
            assert gc.isenabled() is before
            with pytest.raises(ZeroDivisionError):
                allocator_peak(lambda: 1 / 0)
            assert gc.isenabled() is before
        finally:
            gc.enable()
    assert seen == [False, False]


def test_timeline_read_while_tracking_grows_and_each_copy_is_the_callers():
    # the timeline is built once per length of the event record: a read after more ops has their moments, and a
    # list handed out is the caller's own (appending to it changes no later read)
    with MemoryTracker() as tr:
        a = torch.ones(64)
        first = tr.timeline
        first.append("mine")
        b = a * 2
        second = tr.timeline
    assert "mine" not in second and len(second) > len(first) - 1
    assert tr.timeline[-1].bytes == {k: v for k, v in tr.breakdown(at="end").items()} and b.numel() == 64
    assert tr.timeline == tr.timeline and tr.timeline is not tr.timeline
