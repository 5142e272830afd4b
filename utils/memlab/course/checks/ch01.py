"""Checks for chapter 01, "a memory profiler from scratch"."""
from __future__ import annotations

import functools
import gc
import itertools
import math
import random

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memlab.course.reference import ch01 as ref
from memlab.course.checks import BlockReuse, Space, differential, expect, expect_equal, expect_type, flags, ints, lists_of, one_of, own_copies, register


# ---------------------------------------------------------------------------- 01.live_bytes
@register("01.live_bytes", reference=lambda: ref.LiveBytes, title="a live-bytes counter with weakref finalizers")
def check_live_bytes(cls):
    """Grade exercise ``01.live_bytes``: a live-bytes counter with weakref finalizers."""
    # programs of tracks and deaths: new tensors of any size (0 too) and dtype, views at an offset and transposed,
    # temporary views of a live tensor, a tensor seen only through a view, a storage kept after its last tensor died,
    # new storages at a dead one's address, things dropped in any order
    differential(LIVE_SPACE, functools.partial(_live_bytes_program, cls), examples=15)
    lb = cls()
    expect_equal("a new counter: (current, peak)", (lb.current, lb.peak), (0, 0))
    x = torch.zeros(256)  # 1024 bytes
    lb.track(x)
    expect_equal("after track(torch.zeros(256)): current bytes", lb.current, 1024)
    lb.track(x)
    lb.track(x[:10])
    lb.track(x.view(16, 16).t())
    expect_equal("after tracking the same tensor again and two views of it (one storage): current", lb.current, 1024)
    b = torch.ones(64)
    lb.track(b[:8])  # only a temporary view is tracked: the storage lives on in b
    gc.collect()
    expect_equal("after track(b[:8]) (the view died at once, b is alive): current", lb.current, 1024 + 256)
    keep = b.untyped_storage()
    del b
    gc.collect()
    expect_equal("b deleted, but its storage object is still referenced: current", lb.current, 1024 + 256)
    del keep
    gc.collect()
    expect_equal("after the storage itself died: current", lb.current, 1024)
    y = torch.zeros(100, dtype=torch.float64)
    lb.track(y)
    expect_equal("after also tracking 100 float64: current", lb.current, 1824)
    v = x[:4]
    del x
    gc.collect()
    expect_equal("x deleted but its view x[:4] still alive (the whole storage stays): current", lb.current, 1824)
    del v
    gc.collect()
    expect_equal("after the last view of x died (a weakref callback on the storage should fire): current",
                 lb.current, 800)
    del y
    gc.collect()
    expect_equal("after every tracked tensor died: (current, peak)", (lb.current, lb.peak), (0, 1824))
    z = torch.empty(10, dtype=torch.bfloat16)
    lb.track(z)
    expect_equal("a bfloat16 tensor of 10 elements: current", lb.current, 20)
    expect_equal("peak stays the highest value seen", lb.peak, 1824)
    del z
    gc.collect()

    # views at a non-zero offset, seen before their whole buffer: one storage, all of its bytes
    # (a tensor's data_ptr() includes its offset, and the bytes from the offset on are not the storage)
    lb = cls()
    w = torch.zeros(64, 4)  # 1024 bytes
    lb.track(w[60:])
    expect_equal("track(w[60:]) of a 64 x 4 float32 w (a view at row 60): current (its whole storage)", lb.current, 1024)
    lb.track(w[10:20])
    lb.track(w)
    lb.track(w.t()[1:])
    expect_equal("then w[10:20], w itself and w.t()[1:] (the same storage): current", lb.current, 1024)
    del w
    gc.collect()
    expect_equal("after w died: current", lb.current, 0)

    # a storage dies and another one is made at its address (an allocator reuses a freed block at
    # once; here three storages on one buffer make it certain): each is a new storage to count
    mem = bytearray(512)
    for i in range(3):
        u = torch.frombuffer(mem, dtype=torch.float32)  # a new storage at the same address each time
        lb.track(u)
        expect_equal(f"storage #{i + 1} made at the address of the one that died before it: current", lb.current, 512)
        del u
        gc.collect()
        expect_equal(f"after storage #{i + 1} died: current", lb.current, 0)
    expect_equal("peak of this counter", lb.peak, 1024)
    _two_counters(cls)


def _live_bytes_program(cls, case) -> None:
    """One drawn program of 01.live_bytes, run on ``cls()`` and on the reference side by side."""
    mine, want = cls(), ref.LiveBytes()
    gen = torch.Generator().manual_seed(case.seed)
    pool = BlockReuse(64)  # an allocator's block: a new tensor takes it once the last one there died
    alive: list = []  # what the program still holds: tensors and bare storages
    for i, op in enumerate(case.ops):
        n = int(torch.randint(0, case.size + 1, (1,), generator=gen))
        pick = int(torch.randint(0, 1 << 30, (1,), generator=gen))
        tensors, base = [x for x in alive if isinstance(x, torch.Tensor) and x.dim() == 1], None
        if op == "track a view of a new tensor at an offset":
            whole = torch.zeros(n + 2, dtype=case.dtype)
            alive.append(whole)
            t = whole[1 + pick % (n + 1):]
            whole = None
        elif op == "track a new tensor where a dead one was":
            dt = case.dtype if case.dtype.is_floating_point else torch.float32
            first = pool.tensor(64 // torch.empty(0, dtype=dt).element_size(), dtype=dt)
            mine.track(first)
            want.track(first)
            first = None  # it dies; the next one is made at its address
            gc.collect()
            t = pool.tensor(64 // torch.empty(0, dtype=dt).element_size(), dtype=dt)
            alive.append(t)
        elif op == "track a new tensor" or not tensors and op != "drop something":
            t = torch.zeros(n, dtype=case.dtype)
            alive.append(t)
        elif op == "drop something":
            if alive:
                alive.pop(pick % len(alive))
            t = None
        else:
            base = tensors[pick % len(tensors)]
            k = base.numel()
            t = {"track a view at an offset": lambda: base[min(k, 1 + pick % max(k, 1)):],
                 "track a transposed view": lambda: base[: (k // 2) * 2].view(-1, 2).t() if k >= 2 else base[:0],
                 "track a temporary view": lambda: base[: k // 2],
                 "keep only the storage": lambda: base.untyped_storage()}[op]()
            if op == "keep only the storage":
                alive.append(t)
                del alive[next(j for j, x in enumerate(alive) if x is base)]
                t = None
            elif op != "track a temporary view":
                alive.append(t)
        if t is not None:
            mine.track(t)
            want.track(t)
        t = base = tensors = None  # only `alive` holds anything now
        gc.collect()
        expect_equal(f"after step {i + 1} ({op}) of {list(case.ops)} ({case}): (current, peak)",
                     (mine.current, mine.peak), (want.current, want.peak))
    alive.clear()
    gc.collect()
    expect_equal(f"after every tensor of {list(case.ops)} died ({case}): (current, peak)",
                 (mine.current, mine.peak), (want.current, want.peak))


LIVE_SPACE = Space(ops=lists_of(one_of("track a new tensor", "track a view at an offset", "track a transposed view",
                                       "track a temporary view", "keep only the storage", "drop something",
                                       "track a view of a new tensor at an offset",
                                       "track a new tensor where a dead one was"), 1, 12),
                   size=ints(0, 300), dtype=one_of(torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.bool))


def _two_counters(cls) -> None:
    """Two counters at once are independent: each counts what it tracks (state on the class would be shared)."""
    a, b = cls(), cls()
    x = torch.zeros(32)
    a.track(x)
    b.track(x)
    b.track(torch.zeros(8)[:4])
    expect_equal("two counters alive at once, both tracking x = torch.zeros(32): (a.current, b.current)",
                 (a.current, b.current), (128, 128))
    del x
    gc.collect()
    expect_equal("two counters after x died: (a.current, a.peak, b.current, b.peak)",
                 (a.current, a.peak, b.current, b.peak), (0, 128, 0, 160))


# ---------------------------------------------------------------------------- 01.categorize
def _mlp():
    """Linear, BatchNorm (buffers), LayerNorm (saves statistics), Dropout (saves a mask), one AdamW step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.LayerNorm(16), nn.Dropout(0.5), nn.ReLU(),
                          nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).square().mean().backward()
    opt.step()
    return model, opt


class _Births(TorchDispatchMode):
    """Entered inside a MemoryTracker: remembers the phase each new storage is born in (the phase
    the check is running, set by hand) and, after every op, asks ``fn(t, model, optimizer, born)``
    about every storage the tracker holds; ``self.bad`` keeps the first disagreement."""

    def __init__(self, fn, tracker, model, opt, offset_views=False):
        super().__init__()
        self.fn, self.tracker, self.model, self.opt = fn, tracker, model, opt
        self.offset_views = offset_views  # ask about a view at the storage's middle, not the whole storage
        self.phase, self.born, self.bad, self.asked = "other", {}, None, 0
        self.answered: dict = {}  # storage key -> (its weakref, the phase now, the tracker's label) last asked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor):
                st = o.untyped_storage()
                b = self.born.get(st._cdata)
                if b is None or b[0]() is not st:  # a new storage (or a dead one's address reused)
                    self.born[st._cdata] = (weakref.ref(st), self.phase, f"{func} {tuple(o.shape)}")
        if self.bad is None:
            with _disable_current_modes():
                self.compare()
        return out

    def compare(self):
        for key, st, n, cat in self.tracker.live_storages():
            b = self.born.get(key)
            if b is None or b[0]() is not st:  # held by the model or the optimizer before the step
                b = (None, "other", "the model or the optimizer before the step")
            last = self.answered.get(key)
            if last is not None and last[0]() is st and last[1:] == (self.phase, cat):
                continue  # asked already in this phase with this label: asked again when either changes
            self.answered[key] = (weakref.ref(st), self.phase, cat)
            t = torch.empty(0, dtype=torch.uint8).set_(st)  # a tensor on that storage, nothing more
            if self.offset_views and n >= 2:  # a view at an offset: its data_ptr() is not its storage's
                t = t[n // 2:]
            got = self.fn(t, self.model, self.opt, b[1])
            self.asked += 1
            if got != cat:
                self.bad = (f"a real step with MemoryTracker: a storage of {n} bytes made by {b[2]}, "
                            f"born in phase {b[1]!r}: categorize(t, model, optimizer, {b[1]!r}) got {got!r}, "
                            f"the tracker says {cat!r}")
                return


@register("01.categorize", reference=lambda: ref.categorize, title="which category a tensor belongs to")
def check_categorize(fn):
    """Grade exercise ``01.categorize``: which category a tensor belongs to."""
    differential(CATEGORIZE_SPACE, functools.partial(_categorize_drawn, fn), edges=[dict(layers=("batchnorm", "layernorm", "dropout"), width=16, batch=5,
                                                    dtype=torch.float32, optimizer="adamw", groups=1, frozen=False,
                                                    tied=False, warm=True, asked="whole storages")], examples=8)
    model, opt = _mlp()
    x = torch.randn(5, 8)  # an input batch: made outside forward, backward and the step
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = model[0](x)  # a layer's output (it has a grad_fn)
        out = model[1:](h)
    masks = [t for t in saved if t.grad_fn is None and t.shape == (5, 16) and not t.requires_grad
             and set(t.unique().tolist()) <= {0.0, 2.0}]
    stats = [t for t in saved if t.shape == (5, 1)]  # LayerNorm's mean and 1/std
    expect(len(masks) == 1 and len(stats) == 2, "internal: the dropout mask and LayerNorm statistics were not found")
    act_grads = []
    h.register_hook(lambda g: act_grads.append(g))
    out.square().mean().backward()
    w, st = model[0].weight, opt.state[model[0].weight]
    temp = st["exp_avg_sq"].sqrt().add_(1e-8)  # AdamW's denominator: a temporary of the step
    outside = model[0](x)  # a grad_fn, but made outside the three phases
    cases = [
        # owners first: the phase does not matter
        ("model[0].weight", w, "other", "parameters"),
        ("model[0].weight.detach() (another tensor, the same storage)", w.detach(), "forward", "parameters"),
        ("model[0].weight[:3] (a view)", w[:3], "backward", "parameters"),
        ("model[0].weight[5:] (a view at a non-zero offset)", w[5:], "forward", "parameters"),
        ("model[0].weight.grad[3:] (a view at a non-zero offset)", w.grad[3:], "backward", "gradients"),
        ("model[5].weight.T[1:] (a transposed view at an offset)", model[5].weight.T[1:], "optimizer", "parameters"),
        ("opt.state[weight]['exp_avg'][7:] (a view at a non-zero offset)", st["exp_avg"][7:], "forward", "optimizer"),
        ("model[1].running_mean (a buffer)", model[1].running_mean, "forward", "parameters"),
        ("model[0].weight.grad", w.grad, "backward", "gradients"),
        ("model[5].bias.grad", model[5].bias.grad, "backward", "gradients"),
        ("opt.state[weight]['exp_avg']", st["exp_avg"], "optimizer", "optimizer"),
        ("opt.state[weight]['exp_avg_sq']", st["exp_avg_sq"], "other", "optimizer"),
        ("opt.state[weight]['step']", st["step"], "other", "optimizer"),
        # else the phase it was born in
        ("model[0](x) (a layer's output)", h, "forward", "activations"),
        ("the dropout mask saved for backward (no grad_fn)", masks[0], "forward", "activations"),
        ("LayerNorm's saved mean (no grad_fn)", stats[0], "forward", "activations"),
        ("the gradient of model[0](x) (an activation gradient)", act_grads[0], "backward", "activations"),
        ("exp_avg_sq.sqrt() (a temporary of the step)", temp, "optimizer", "optimizer"),
        ("x (the input batch)", x, "other", "other"),
        ("model[0](x) made outside forward (a grad_fn, phase 'other')", outside, "other", "other"),
    ]
    cases += [(f"model[0].weight born in phase {p!r}", w, p, "parameters") for p in ref.PHASES]
    cases += [(f"model[1].running_var born in phase {p!r}", model[1].running_var, p, "parameters") for p in ref.PHASES]
    cases += [(f"torch.zeros(3) born in phase {p!r}", torch.zeros(3), p, want)
              for p, want in zip(ref.PHASES, ("activations", "activations", "optimizer", "other"))]
    for name, t, phase, want in cases:
        got = fn(t, model, opt, phase)
        expect(got in ref.CATEGORIES, f"categorize({name}, phase={phase!r}): got {got!r}, expected one of {ref.CATEGORIES}")
        expect_equal(f"categorize({name}, phase={phase!r})", got, want)
    expect_equal("categorize(model[0](x), model=None, optimizer=None, phase='forward')",
                 fn(h, None, None, "forward"), "activations")
    expect_equal("categorize(model[0].weight, model=None, optimizer=None, phase='other') (no owner given)",
                 fn(w, None, None, "other"), "other")

    # the same function against the tracker: every storage alive after every op of a real step
    # (no reference to an old .grad may survive: the tracker's labels stick, so a .grad replaced
    # while we still held it would stay "gradients" for the tracker and no longer be one here)
    del saved, masks, stats, act_grads, temp, outside, h, out, cases, w, st, t
    tracker = ref.MemoryTracker(model, opt)
    probe = _Births(fn, tracker, model, opt)
    with tracker, probe:
        xb = torch.randn(5, 8)
        probe.phase = "forward"
        loss = model(xb).square().mean()
        probe.phase = "backward"
        loss.backward()
        probe.phase = "optimizer"
        opt.step()
        probe.phase = "other"
        opt.zero_grad()
        del loss
    expect(probe.bad is None, probe.bad or "")
    expect(probe.asked > 40, f"internal: only {probe.asked} storages compared with the tracker")


def _categorize_drawn(fn, case) -> None:
    """One drawn step of 01.categorize, ``fn`` asked about every storage the tracker holds after every op."""
    # every storage alive after every op of drawn steps compared with the tracker: any stack of layers (buffers, saved statistics, masks), width and batch,
    # fp32/fp64/bf16, six optimizers (other state keys: momentum_buffer, max_exp_avg_sq, square_avg, sum), one or
    # two parameter groups, a frozen layer, a weight tied between two layers, optimizer state made before the step
    # or during it
    model, opt = _drawn_step(case)
    gen = torch.Generator().manual_seed(case.seed)
    if case.warm:
        model(torch.randn(case.batch, 5, generator=gen).to(case.dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    tracker = ref.MemoryTracker(model, opt)
    probe = _Births(fn, tracker, model, opt, offset_views=case.asked == "views at an offset")
    with tracker, probe:
        xb = torch.randn(case.batch, 5, generator=gen).to(case.dtype)
        probe.phase = "forward"
        loss = model(xb).float().square().mean()
        probe.phase = "backward"
        loss.backward()
        probe.phase = "optimizer"
        opt.step()
        probe.phase = "other"
        opt.zero_grad()
        del loss
    expect(probe.bad is None, f"{probe.bad} ({case})")


_LAYERS = {"linear": lambda w: nn.Linear(w, w), "batchnorm": lambda w: nn.BatchNorm1d(w), "layernorm": lambda w: nn.LayerNorm(w),
           "dropout": lambda w: nn.Dropout(0.5), "gelu": lambda w: nn.GELU()}
_OPTIMIZERS = {"adamw": lambda g: torch.optim.AdamW(g, lr=1e-3), "sgd": lambda g: torch.optim.SGD(g, lr=1e-3),
               "sgd momentum": lambda g: torch.optim.SGD(g, lr=1e-3, momentum=0.9),
               "adam amsgrad": lambda g: torch.optim.Adam(g, lr=1e-3, amsgrad=True),
               "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-3), "adagrad": lambda g: torch.optim.Adagrad(g, lr=1e-3)}
CATEGORIZE_SPACE = Space(layers=lists_of(one_of(*_LAYERS), 0, 3), width=ints(2, 12), batch=ints(2, 5),
                         dtype=one_of(torch.float32, torch.float64, torch.bfloat16), optimizer=one_of(*_OPTIMIZERS),
                         groups=one_of(1, 2), frozen=flags(), tied=flags(), warm=flags(),
                         asked=one_of("whole storages", "views at an offset"))


def _drawn_step(case):
    """The model and optimizer of a drawn case of 01.categorize: Linear(5, width), the drawn layers, two
    Linear(width, width) (the second's weight tied to the first's when ``case.tied``), Linear(width, 3)."""
    torch.manual_seed(case.seed)
    w = case.width
    model = nn.Sequential(nn.Linear(5, w), *(_LAYERS[n](w) for n in case.layers), nn.Linear(w, w), nn.Linear(w, w),
                          nn.Linear(w, 3)).to(case.dtype)
    if case.tied:
        model[-2].weight = model[-3].weight
    if case.frozen:
        model[0].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": params}] if case.groups == 1 else [{"params": params[::2]}, {"params": params[1::2], "lr": 1e-2}]
    return model, _OPTIMIZERS[case.optimizer](groups)


# ---------------------------------------------------------------------------- 01.phase_peaks
def _ev(i, phase, **b):
    return ref.Event(i, phase, {c: b.get(c, 0) for c in ref.CATEGORIES})


@register("01.phase_peaks", reference=lambda: ref.phase_peaks, title="per-phase peaks from a timeline")
def check_phase_peaks(fn):
    # the categories peak at different events: the answer is the peak of the totals
    """Grade exercise ``01.phase_peaks``: per-phase peaks from a timeline."""
    def run(case) -> None:
        rng = random.Random(case.seed)
        phases = [p for p in ref.PHASES if p in case.phases] or ["other"]
        timeline = [_ev(3 * i + rng.randint(0, 2), rng.choice(phases),
                        **{c: rng.choice([0, rng.randint(1, case.scale)]) for c in ref.CATEGORIES})
                    for i in range(case.events)]
        want = ref.phase_peaks(*own_copies(timeline))  # the reference first, on its own copies
        got = fn(timeline)
        expect_equal(f"phase_peaks of a timeline of {case.events} events in phases {phases} ({case})", got, want)

    # any length (one event, none), any subset of the phases (a phase that never occurs is not in the answer),
    # bytes from a few to beyond 2**31, categories that are zero
    space = Space(events=ints(0, 40), phases=lists_of(one_of(*ref.PHASES), 1, 4), scale=one_of(1000, 10, 2**40))
    differential(space, run, examples=25)
    tl = [
        _ev(0, "other", parameters=100),
        _ev(3, "forward", parameters=100, activations=50),
        _ev(7, "forward", parameters=100, activations=80, other=5),
        _ev(9, "backward", parameters=100, activations=70, gradients=10),
        _ev(12, "backward", parameters=100, activations=20, gradients=100),
        _ev(15, "optimizer", parameters=100, gradients=100, optimizer=200, other=100),
        _ev(16, "optimizer", parameters=100, gradients=100, optimizer=200),
        _ev(20, "forward", parameters=100, optimizer=200, activations=30),
    ]
    got = fn(tl)
    expect_type("phase_peaks(timeline)", got, dict)
    want = ref.phase_peaks(tl)
    expect_equal("the phases in the answer", sorted(got), sorted(want))
    for phase in want:
        expect_equal(f"peak total bytes of phase {phase!r}", got[phase], want[phase])

    # a real timeline
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)
    with ref.MemoryTracker(model, opt) as tr:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    got = fn(tr.timeline)
    want = tr.phase_peaks()
    expect_equal("phase peaks of a real MLP training step's timeline", got, want)
    expect_equal("the largest phase peak is the step's peak", max(got.values()), tr.peak_bytes)
    expect_equal("an empty timeline", fn([]), {})


# ---------------------------------------------------------------------------- 01.fake_activations
@register("01.fake_activations", timeout=90, reference=lambda: ref.fake_activation_bytes,
          title="activation bytes of a too-large model, on fake tensors")
def check_fake_activations(fn):
    """Grade exercise ``01.fake_activations``: activation bytes of a too-large model, on fake tensors."""
    from memlab.models import TinyGPTConfig

    def run(case) -> None:
        cfg = TinyGPTConfig(vocab_size=case.vocab, block_size=case.block, n_layer=case.layers, n_head=case.heads,
                            n_embd=case.heads * case.head_dim, dropout=case.dropout, bias=case.bias,
                            mlp_ratio=case.mlp_ratio, attention=case.attention, tie_weights=case.tied)
        where = f"fake_activation_bytes({cfg}, batch_size={case.batch}, seq_len={case.seq})"
        got = fn(cfg, case.batch, case.seq)
        expect(type(got) is int, f"{where}: expected an int number of bytes, got {type(got).__name__} ({got!r:.60})")
        if case.size == "runs for real":  # small enough to run: the fake count must equal the real one
            expect_equal(f"{where} (fake count vs the same forward run for real)", got, _real_saved(cfg, case.batch, case.seq))
        else:  # too large to run here (the edges: 32 layers 4096 wide, 26 GB of fp32 weights): memlab's count on fake tensors
            expect_equal(where, got, _fake_reference(repr(cfg), case.batch, case.seq))

    # small models run for real (any vocabulary, context, depth, heads, head size, MLP ratio, dropout, bias, attention
    # kernel, tied or not, and a sequence shorter than the context); models of billions of parameters on fake tensors
    small = dict(size="runs for real", vocab=256, block=32, layers=2, heads=4, head_dim=16, batch=3, seq=32, dropout=0.0,
                 bias=True, mlp_ratio=4, attention="manual", tied=True)
    big = dict(small, size="fake tensors only", vocab=32000, block=2048, layers=32, heads=32, head_dim=128, batch=1,
               seq=2048)
    differential(FAKE_SPACE, run, edges=[small, big, dict(big, batch=2, seq=1024)], examples=8)


FAKE_SPACE = Space(size=one_of("runs for real", "fake tensors only"),
                   vocab=lambda c: ints(2, 600) if c.size == "runs for real" else ints(1000, 50000),
                   block=lambda c: ints(1, 40) if c.size == "runs for real" else ints(512, 4096),
                   layers=lambda c: ints(1, 3) if c.size == "runs for real" else ints(2, 12),
                   heads=one_of(4, 1, 2, 3, 8), head_dim=lambda c: ints(1, 12) if c.size == "runs for real" else one_of(64, 80, 128),
                   batch=ints(1, 4), seq=lambda c: ints(1, c.block), dropout=one_of(0.0, 0.1), bias=flags(),
                   mlp_ratio=one_of(4, 1, 2, 3), attention=one_of("manual", "sdpa"), tied=flags())


@functools.lru_cache(maxsize=64)
def _fake_reference(config: str, batch: int, seq: int) -> int:
    """memlab's count for ``eval(config)`` (a TinyGPTConfig's repr; an int comes back, nothing shared): a 32-layer
    model costs a second on fake tensors, and the edges run on each pass."""
    from memlab.models import TinyGPTConfig

    return ref.fake_activation_bytes(eval(config, {"TinyGPTConfig": TinyGPTConfig}), batch, seq)


def _real_saved(cfg, batch: int, seq: int) -> int:
    """Bytes one real training forward of TinyGPT(cfg) (logits and loss) saves for backward."""
    from memlab.accounting import saved_activation_bytes
    from memlab.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    y = torch.randint(0, cfg.vocab_size, (batch, seq))
    return saved_activation_bytes(lambda: model(x, y)[1], exclude=list(model.parameters()) + list(model.buffers()))


# ---------------------------------------------------------------------------- 01.fix_the_leak
class _Sentinel:
    """Stands for one step's autograd graph: it lives exactly as long as the graph node holding it."""


class _GraphProbe(torch.autograd.Function):
    """The identity, as a node of the graph that holds a sentinel: while some tensor still reaches
    this node (a loss kept, a running total with a grad_fn), the sentinel is alive. Autograd frees
    saved tensors after backward but not the nodes, so bytes alone cannot see such a graph."""

    @staticmethod
    def forward(ctx, x, sentinel):
        ctx.sentinel = sentinel
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _probe_graphs(model):
    """A forward hook on the final LayerNorm: every forward's graph gets a sentinel; returns the
    list of weak references to them and the hook handle."""
    refs, stale = [], []

    def hook(module, args, out):
        # at the start of a step's forward, the graph of the step before may still be alive (`loss` is
        # rebound only after this forward), but none older
        gc.collect()
        stale.append(sum(r() is not None for r in refs[:-1]))
        s = _Sentinel()
        refs.append(weakref.ref(s))
        return _GraphProbe.apply(out, s)

    return refs, stale, model.ln_f.register_forward_hook(hook)


@register("01.fix_the_leak", timeout=90, mutates=("model", "optimizer", "batches"), reference=lambda: ref.train_losses, title="find and fix the leak")
def check_fix_the_leak(train):
    """Grade exercise ``01.fix_the_leak``: find and fix the leak."""

    def run(case) -> None:
        where = f"train(model, optimizer, batches, {case.steps}) ({case})"
        model, opt, batches = _leak_setup(case)
        current_one = _train_tracked(train, model, opt, batches, 1, where)[1]
        model, opt, batches = _leak_setup(case)
        history, current = _train_tracked(train, model, opt, batches, case.steps, where)
        expect_type(f"{where}: return value", history, list)
        expect_equal(f"{where}: len(history)", len(history), case.steps)
        for i, h in enumerate(history):
            expect(type(h) is float, f"{where}: history[{i}]: expected a Python float (loss.item()), got "
                                     f"{type(h).__name__}; a tensor keeps its graph alive")
        model, opt, batches = _leak_setup(case)
        want = ref.train_losses(model, opt, batches, case.steps)
        for i, (g, w) in enumerate(zip(history, want)):
            expect(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6),
                   f"{where}: loss at step {i}: got {g:.6f}, expected {w:.6f} (forward, backward, optimizer.step, "
                   f"zero_grad each step)")
        growth = current - current_one
        expect(growth == 0, f"{where}: live bytes after {case.steps} steps minus after 1 step: {growth:,} bytes; memory "
                            f"must stay flat (something from each step is still alive: a loss tensor, its graph, a "
                            f"retained graph?)")

    # any number of steps, batches as a list, a generator or one batch repeated (its storage counts once), any batch
    # and sequence length, three optimizers, one or two layers
    differential(LEAK_SPACE, run, edges=[dict(steps=3, batches="one batch repeated", batch=4, seq=16, layers=1,
                                              optimizer="adamw")], examples=6)


LEAK_SPACE = Space(steps=ints(1, 5), batches=one_of("one batch repeated", "a list", "a generator"), batch=ints(1, 4),
                   seq=ints(1, 16), layers=ints(1, 2), optimizer=one_of("adamw", "sgd momentum", "adam"))


def _leak_setup(case):
    """A TinyGPT, its optimizer and the batches of a case of 01.fix_the_leak (the same ones for the same case)."""
    from memlab.models import TinyGPT, TinyGPTConfig

    cfg = TinyGPTConfig(block_size=16, n_layer=case.layers, n_head=2, n_embd=32)
    torch.manual_seed(case.seed)
    model = TinyGPT(cfg)
    opt = {"adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-2),
           "sgd momentum": lambda: torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
           "adam": lambda: torch.optim.Adam(model.parameters(), lr=1e-2)}[case.optimizer]()
    g = torch.Generator().manual_seed(case.seed + 1)
    pairs = [(torch.randint(0, cfg.vocab_size, (case.batch, case.seq), generator=g),
              torch.randint(0, cfg.vocab_size, (case.batch, case.seq), generator=g)) for _ in range(case.steps)]
    if case.batches == "one batch repeated":
        batches = itertools.repeat(pairs[0])
    elif case.batches == "a list":
        batches = pairs
    else:
        batches = (p for p in pairs)
    return model, opt, batches


def _train_tracked(train, model, opt, batches, steps: int, where: str) -> tuple:
    """(what ``train`` returned, live bytes after it returned): every step's autograd graph watched by a sentinel."""
    tracker = ref.MemoryTracker(model, opt)
    graphs, stale, handle = _probe_graphs(model)
    with tracker:
        history = train(model, opt, batches, steps)
    handle.remove()
    gc.collect()
    current = tracker.current_bytes  # the history is still alive here
    alive = sum(r() is not None for r in graphs)
    expect(len(graphs) == steps, f"{where}: ran {len(graphs)} forward passes for {steps} step(s)")
    expect(max(stale, default=0) == 0,
           f"{where}: at the forward of step {stale.index(max(stale)) + 1 if stale else 0}, {max(stale, default=0)} "
           f"graph(s) of steps before the previous one were still alive: something refers to old losses with their "
           f"grad_fn (a running `total = total + loss`, a list of loss tensors); backward frees the saved tensors but "
           f"not the graph's nodes")
    expect(alive == 0, f"{where}: after it returned, {alive} of its {steps} autograd graphs are still alive (the history "
                       f"returned is held): something still refers to a loss with a grad_fn (a tensor kept, `total = "
                       f"total + loss`, a retained graph); backward frees the saved tensors but not the graph's nodes. "
                       f"Keep loss.item()")
    return history, current
