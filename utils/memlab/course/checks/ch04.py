"""Checks for chapter 04, CPU-offload AdamW.

04.adamw_update        one AdamW step, bitwise equal to torch.optim.AdamW(foreach=False) over many steps,
                       in place on non-contiguous and channels_last parameters too
04.pack_flat           tensors (any layout) packed in one flat float32 buffer, with views that share its storage
                       and never alias the inputs
04.chunked_step        the step over flat buffers in slices of `chunk` elements: every element bitwise one
                       AdamW update, no full-size temporaries
04.grad_hook           post-accumulate-grad hooks that add each finished grad into its fp32 slot (bitwise) and free
                       it, with a frozen parameter beside trainable ones of the same shape
04.offload_optimizer   the learner's own offload optimizer from their pieces: bitwise vs torch.optim.AdamW with
                       gradient accumulation and a frozen parameter (fp32), vs fp32-master AdamW (bf16)
04.predict_traffic     predict the bytes that cross host <-> device per optimizer step; graded on the error
                       against the copies counted in a real step

Production references: torch.optim.AdamW (its single-tensor for-loop), torch's autograd
post-accumulate-grad hooks, and the copies counted (TorchDispatchMode) in a real OffloadedAdamW step.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memlab import offload
from memlab.course.checks import (
    Space, differential, expect, expect_type, flags, floats, ints, layouts, lists_of, make_tensor, one_of, register,
)

HPARAMS = [
    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2),
    dict(lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0),
    dict(lr=1e-3, beta1=0.3, beta2=0.9, eps=1e-8, weight_decay=0.1),  # 1 - beta1 >= 0.5: lerp's other branch
]


def _hp_str(hp: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in hp.items())


def _layouts(shape_kind: str, gen: torch.Generator) -> torch.Tensor:
    """A fresh tensor in one of the layouts real parameters have."""
    if shape_kind == "odd":
        return torch.randn(7, generator=gen)
    if shape_kind == "matrix":
        return torch.randn(33, 5, generator=gen)
    if shape_kind == "transposed":  # non-contiguous: a transposed view (tied / transposed weights)
        return torch.randn(5, 33, generator=gen).t()
    if shape_kind == "channels_last":  # a conv weight in channels_last
        return torch.randn(4, 3, 3, 3, generator=gen).contiguous(memory_format=torch.channels_last)
    raise ValueError(shape_kind)


LAYOUTS = ("odd", "matrix", "transposed", "channels_last")


# ----------------------------------------------------------------------------- 04.adamw_update
@register("04.adamw_update", reference=lambda: offload.adamw_step_, mutates=("param", "exp_avg", "exp_avg_sq"), title="AdamW update, bitwise vs torch")
def check_adamw_update(fn) -> None:
    """Grade exercise ``04.adamw_update``: AdamW update, bitwise vs torch."""
    expect(callable(fn), f"adamw_step_: expected a function, got {type(fn).__name__}")
    def run(case) -> None:
        hp = case.hp
        gen = torch.Generator().manual_seed(4 + case.seed)
        p = _layouts(case.kind, gen) if case.kind in LAYOUTS else \
            make_tensor(case.shape, torch.float32, case.kind, case.seed)
        shape = tuple(p.shape)
        ref = nn.Parameter(p.detach().clone())
        opt = torch.optim.AdamW([ref], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                weight_decay=hp["weight_decay"], foreach=False)
        m, v = torch.zeros(shape), torch.zeros(shape)
        ptr, strides = p.data_ptr(), p.stride()
        for step in range(1, case.steps + 1):
            g = torch.randn(shape, generator=gen) * (10.0 if step == case.spike else 1.0)
            ref.grad = g.clone()
            opt.step()
            out = fn(p, g.clone(), m, v, step, **hp)
            expect(out is None or out is p, "adamw_step_: update param, exp_avg and exp_avg_sq in place (return None)")
            where = f"({_hp_str(hp)}, {case.kind} param of shape {shape}, step {step})"
            expect(p.data_ptr() == ptr and p.stride() == strides,
                   f"adamw_step_ {where}: param must be updated in place in its own memory and layout")
            for name, got, want in (("exp_avg", m, opt.state[ref]["exp_avg"]), ("exp_avg_sq", v, opt.state[ref]["exp_avg_sq"]),
                                    ("param", p, ref.data)):
                if not torch.equal(got, want):
                    d = (got - want).abs().max().item()
                    hint = {
                        "exp_avg": "exp_avg.lerp_(grad, 1 - beta1)",
                        "exp_avg_sq": "exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)",
                        "param": "param.mul_(1 - lr*weight_decay) first; then denom = (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps) "
                                 "and param.addcdiv_(exp_avg, denom, value=-lr/bc1)",
                    }[name]
                    expect(False, f"adamw_step_ {where}: {name} differs from torch AdamW by {d:.3g}; "
                           f"torch's op order is {hint}")

    edges = [dict(hp=hp, kind=kind, shape=(), steps=8, spike=4) for hp in HPARAMS for kind in LAYOUTS]
    differential(ADAMW_SPACE, run, edges=edges, examples=12)


# any hyper-parameters (beta1 at or above 0.5 and below: lerp's two branches; no decay; tiny and large eps), a
# parameter in any layout (a view into a larger buffer, every other element, transposed), any shape, 1-8 steps
ADAMW_SPACE = Space(
    hp=one_of(*HPARAMS, dict(lr=1e-1, beta1=0.0, beta2=0.5, eps=1e-12, weight_decay=0.5),
              dict(lr=2e-5, beta1=0.99, beta2=0.9999, eps=1e-3, weight_decay=1e-4)),
    kind=one_of("strided", "offset", "transposed", "contiguous", "odd", "channels_last"),
    shape=one_of((7,), (33, 5), (1,), (4, 3, 3, 3), (2, 17)), steps=ints(1, 8), spike=ints(1, 8))


# ----------------------------------------------------------------------------- 04.pack_flat
def _pack_reference(tensors):
    buf = offload.pack(tensors)
    return buf.flat, buf.views


@register("04.pack_flat", reference=lambda: _pack_reference, title="flat buffer with views")
def check_pack_flat(fn) -> None:
    """Grade exercise ``04.pack_flat``: flat buffer with views."""
    expect(callable(fn), f"pack: expected a function, got {type(fn).__name__}")
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("three fp32 tensors", [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen), torch.randn(2, 2, 2, generator=gen)]),
        ("bf16 tensors (cast to float32)", [torch.randn(6, generator=gen).bfloat16(), torch.randn(4, 3, generator=gen).bfloat16()]),
        ("a 0-d tensor between two others", [torch.randn(2, generator=gen), torch.tensor(3.5), torch.randn(1, 3, generator=gen)]),
        ("one fp32 tensor", [torch.randn(10, generator=gen)]),
        ("a transposed (non-contiguous) tensor", [torch.randn(3, generator=gen), torch.randn(4, 6, generator=gen).t()]),
        ("a channels_last conv weight", [torch.randn(4, 3, 3, 3, generator=gen).contiguous(memory_format=torch.channels_last),
                                         torch.randn(4, generator=gen)]),
    ]

    def run(case) -> None:
        if hasattr(case, "edge"):
            name, ts = case.edge, dict(cases)[case.edge]
        else:
            ts = [make_tensor(shape, dtype, layout, case.seed + i)
                  for i, (shape, dtype, layout) in enumerate(zip(case.shapes, case.dtypes, case.layouts_))]
            name = f"drawn ({case})"
        originals = [t.clone() for t in ts]
        got = fn(ts)
        expect(isinstance(got, (tuple, list)) and len(got) == 2, f"pack ({name}): expected (flat, views), got {got!r:.80}")
        flat, views = got
        expect_type(f"pack ({name}) flat", flat, torch.Tensor)
        total = sum(t.numel() for t in ts)
        expect(flat.dtype == torch.float32, f"pack ({name}): flat is {flat.dtype}; the master buffer must be float32")
        expect(flat.dim() == 1 and flat.numel() == total, f"pack ({name}): flat has shape {tuple(flat.shape)}, expected ({total},)")
        expect(flat.is_contiguous(), f"pack ({name}): flat must be contiguous")
        expect(len(views) == len(ts), f"pack ({name}): {len(views)} views for {len(ts)} tensors")
        offset = 0
        for i, (v, t) in enumerate(zip(views, originals)):
            expect_type(f"pack ({name}) views[{i}]", v, torch.Tensor)
            expect(v.shape == t.shape, f"pack ({name}): views[{i}] has shape {tuple(v.shape)}, expected {tuple(t.shape)}")
            expect(torch.equal(v, t.float()), f"pack ({name}): views[{i}] does not hold tensor {i}'s values (in order, float32)")
            expect(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(),
                   f"pack ({name}): views[{i}] does not share flat's storage; slice flat and .view() it, never copy")
            expect(v.storage_offset() - flat.storage_offset() == offset,
                   f"pack ({name}): views[{i}] starts at element {v.storage_offset() - flat.storage_offset()} of flat, expected {offset}")
            expect(v.is_contiguous() and torch.equal(flat[offset:offset + t.numel()], t.reshape(-1).float()),
                   f"pack ({name}): flat[{offset}:{offset + t.numel()}] must hold tensor {i} in row-major order (views[{i}] "
                   "contiguous, whatever the input's strides): every flat buffer of the optimizer must line up element for element")
            offset += t.numel()
        for t, o in zip(ts, originals):
            expect(torch.equal(t, o), f"pack ({name}): the input tensors must not change")
        flat.mul_(2)
        for i, (v, t) in enumerate(zip(views, originals)):
            expect(torch.equal(v, t.float() * 2), f"pack ({name}): writing flat did not change views[{i}]")
        for i, (t, o) in enumerate(zip(ts, originals)):
            expect(torch.equal(t, o), f"pack ({name}): writing flat changed input tensor {i}: flat aliases it. The master "
                   "copy must be a copy (the parameter keeps its own memory on the device)")

    # any number of tensors of any shape (0-d, empty), fp32/bf16/fp16/fp64, in any layout
    space = Space(shapes=lists_of(one_of((3, 4), (5,), (), (0,), (2, 2, 2), (4, 3, 3, 3), (1, 7)), 1, 5),
                  dtypes=lists_of(one_of(torch.float32, torch.bfloat16, torch.float16, torch.float64), 5, 5),
                  layouts_=lists_of(layouts("contiguous", "transposed", "strided", "offset", "channels_last"), 5, 5))
    differential(space, run, edges=[{"edge": name} for name, _ in cases], examples=15)


# ----------------------------------------------------------------------------- 04.chunked_step
class _AllocLog(TorchDispatchMode):
    """Records the largest tensor an op allocates (outputs that alias no input)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, torch.Tensor):
                inputs.add(a.untyped_storage().data_ptr())
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs and o.dim() > 0:
                self.largest = max(self.largest, o.numel())
        return out


def _one_update_each(before, hp, step):
    """The allowed results of one AdamW update of every element: torch's op order with torch's sqrt, or with a
    correctly rounded sqrt (the C++ kernel, torch's fused CPU AdamW). Both bitwise; nothing in between."""
    outs = []
    fns = [lambda *a, **k: offload.adamw_step_(*a, **k), offload.adamw_step_eager_chunked_]
    if offload.kernel_name().startswith("C++"):
        fns.append(offload.adamw_step_flat_)
    for f in fns:
        t = [x.clone() for x in before]
        f(t[0], t[1], t[2], t[3], step, **hp)
        outs.append(t)
    return outs


@register("04.chunked_step", reference=lambda: offload.adamw_step_eager_chunked_,
          mutates=("param", "exp_avg", "exp_avg_sq"), title="chunked step on flat buffers")
def check_chunked_step(fn) -> None:
    """Grade exercise ``04.chunked_step``: chunked step on flat buffers."""
    expect(callable(fn), f"adamw_step_chunked_: expected a function, got {type(fn).__name__}")
    def run(case) -> None:
        n, chunk, hp = case.n, case.chunk, case.hp
        gen = torch.Generator().manual_seed(n + case.seed)
        got = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), torch.zeros(n)]
        log = _AllocLog()
        for step in range(1, case.steps + 1):
            got[1] = torch.randn(n, generator=gen) * (100.0 if step == 2 else 1.0)
            before = [t.clone() for t in got]
            allowed = _one_update_each(before, hp, step)
            with log:
                fn(got[0], got[1], got[2], got[3], step, chunk=chunk, **hp)
            where = f"(n={n}, chunk={chunk}, {_hp_str(hp)}, step {step})"
            expect(torch.equal(got[1], before[1]), f"adamw_step_chunked_ {where}: the gradient must not change")
            for k, name in ((2, "exp_avg"), (3, "exp_avg_sq"), (0, "param")):
                ok = torch.zeros(n, dtype=torch.bool)
                for a in allowed:
                    ok |= got[k] == a[k]
                if not bool(ok.all()):
                    bad = (~ok).nonzero().flatten()
                    d = (got[k] - allowed[0][k]).abs().max().item()
                    expect(False, f"adamw_step_chunked_ {where}: {name} differs from one AdamW update at {bad.numel()} "
                           f"element(s), first at index {bad[0].item()} (max diff {d:.3g}); every element must get "
                           "exactly one update with this step number, bitwise: torch's op order, bias corrections "
                           "as Python floats (double)")
        expect(log.largest <= chunk,
               f"adamw_step_chunked_ (n={n}, chunk={chunk}): an op allocated a temporary of {log.largest} elements; "
               f"work on slices of at most chunk={chunk} elements so temporaries stay in cache")

    edges = [dict(n=n, chunk=c, hp=hp, steps=4) for n, c in ((1000, 128), (1003, 100), (64, 64), (50, 1000), (9, 1))
             for hp in HPARAMS]
    # any length and chunk (1, a divisor, uneven tails, larger than the buffer), any hyper-parameters, 1-4 steps
    space = Space(n=ints(1, 2500), chunk=lambda c: ints(1, c.n + 64), hp=one_of(*HPARAMS), steps=ints(1, 4))
    differential(space, run, edges=edges, examples=10)


# ----------------------------------------------------------------------------- 04.grad_hook
def _net(dtype: torch.dtype, depth: int = 2, width: int = 16, frozen: bool = True, tied: bool = False) -> nn.Module:
    """Linear(6, width), ``depth`` Linear(width, width) (the first frozen when ``frozen``: a frozen layer beside
    trainable ones of its shape; the last sharing the first's weight when ``tied``), Linear(width, 3); Tanh between."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, width), nn.Tanh()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(width, 3)).to(dtype)
    if tied and depth >= 2:
        net[2 * depth].weight = net[2].weight
    if frozen and depth >= 1:
        net[2].requires_grad_(False)
    return net


def _conv_net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).to(dtype)
    return net.to(memory_format=torch.channels_last)


def _micro_grads(ref: nn.Module, batches, conv: bool) -> list[list[torch.Tensor | None]]:
    """Each micro-batch's own gradient, per parameter (None: no gradient)."""
    out = []
    for x, y in batches:
        ref.zero_grad(set_to_none=True)
        (ref(x).float() - y.float()).pow(2).mean().backward()
        out.append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
    return out


# MLPs of any depth and width (a frozen layer or not, a weight tied between two layers or not) and a channels_last
# conv net, in four dtypes, 1-4 micro-batches, a trainable parameter that gets no gradient or not, the parameters
# handed over in the model's order, reversed or shuffled (slot i belongs to params[i], whatever its shape)
GRAD_HOOK_SPACE = Space(net=one_of("mlp", "conv"), dtype=one_of(torch.float32, torch.bfloat16, torch.float16, torch.float64),
                        depth=ints(0, 3), width=ints(1, 16), frozen=flags(), tied=flags(), micro=ints(1, 4),
                        unused=flags(), order=one_of("model order", "reversed", "shuffled"))


@register("04.grad_hook", reference=lambda: offload.install_grad_hooks, title="gradient-staging hooks")
def check_grad_hook(fn) -> None:
    """Grade exercise ``04.grad_hook``: gradient-staging hooks."""
    expect(callable(fn), f"install_grad_hooks: expected a function, got {type(fn).__name__}")

    def run(case) -> None:
        dtype, conv = case.dtype, case.net == "conv"
        make = (lambda: _conv_net(dtype)) if conv else (lambda: _net(dtype, case.depth, case.width, case.frozen, case.tied))
        ref, mine = make(), make()
        what = f"{case}: {'a channels_last conv net' if conv else 'an MLP'}"
        model_params = list(mine.parameters())
        # trainable, but gets no gradient: its slot must stay zero
        extra = [nn.Parameter(torch.ones(4, dtype=dtype))] if case.unused else []
        order = list(range(len(model_params) + len(extra)))
        if case.order == "reversed":
            order.reverse()
        elif case.order == "shuffled":
            order = torch.randperm(len(order), generator=torch.Generator().manual_seed(case.seed)).tolist()
        everything = model_params + extra
        params = [everything[i] for i in order]
        slots = [torch.zeros(p.shape) for p in params]
        trainable = [p for p in model_params if p.requires_grad]
        seen_during_backward: list[int] = []
        first = mine[0]

        def spy(grad):  # runs when the first layer's output grad is computed: late in backward
            seen_during_backward.append(sum(p.grad is not None for p in trainable if p is not first.weight
                                            and p is not first.bias))
            return grad

        handles = fn(params, slots)
        expect(isinstance(handles, (list, tuple)) and len(handles) >= len(trainable),
               f"install_grad_hooks ({what}): return the list of hook handles (one per trainable parameter), "
               f"got {handles!r:.80}")
        gen = torch.Generator().manual_seed(case.seed + 1)
        shape_in = (8, 3, 6, 6) if conv else (8, 6)
        batches = [(torch.randn(*shape_in, generator=gen).to(dtype), torch.randn(8, 3, generator=gen).to(dtype))
                   for _ in range(case.micro)]
        if conv:
            batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
        per_micro = _micro_grads(ref, batches, conv)
        sums = [torch.zeros(p.shape) for p in everything]
        for micro, (x, y) in enumerate(batches):
            h = first.register_forward_hook(lambda mod, inp, out: out.register_hook(spy) and None)
            (mine(x).float() - y.float()).pow(2).mean().backward()
            h.remove()
            for i, p in enumerate(mine.parameters()):
                expect(p.grad is None, f"install_grad_hooks ({what}, micro-batch {micro}): parameter {i} still holds "
                       ".grad after backward; set param.grad = None in the hook so the device memory is freed")
            expect(seen_during_backward[-1] == 0, f"install_grad_hooks ({what}): the later layers' grads were still "
                   "on the model while backward went on; stage and free each one as soon as it is final "
                   "(post-accumulate-grad hook)")
            for i, g in enumerate(per_micro[micro]):
                if g is not None:
                    sums[i].add_(g)  # fp32 slot += this micro-batch's grad, in order
            for j, (s, i) in enumerate(zip(slots, order)):
                expect(s.dtype == torch.float32, f"install_grad_hooks ({what}): slot {j} became {s.dtype}; keep slots float32")
                if not torch.equal(s, sums[i]):
                    frozen = "" if params[j].requires_grad else " (a frozen parameter: it gets no gradient, its slot stays 0)"
                    expect(False, f"install_grad_hooks ({what}, after {micro + 1} micro-batch(es)): slot {j}{frozen} is "
                           f"off from the fp32 sum of the micro-batch gradients of params[{j}] by "
                           f"{(s - sums[i]).abs().max().item():.3g}; add each micro-batch's grad into its own parameter's "
                           "slot in float32 (slot.add_(grad)), never overwrite it or sum in the gradient's dtype")
        for hnd in handles:
            hnd.remove()
        before = [s.clone() for s in slots]
        (mine(batches[0][0]).float().sum()).backward()
        expect(all(torch.equal(a, b) for a, b in zip(slots, before)),
               f"install_grad_hooks ({what}): removing the returned handles must stop the staging")

    edges = [dict(net=net, dtype=dtype, depth=2, width=16, frozen=True, tied=False, micro=3, unused=True, order="model order")
             for dtype in (torch.float32, torch.bfloat16) for net in ("mlp", "conv")]
    differential(GRAD_HOOK_SPACE, run, edges=edges, examples=12)


# ----------------------------------------------------------------------------- 04.offload_optimizer
def _opt_batches(dtype, n, gen):
    return [(torch.randn(8, 6, generator=gen).to(dtype), torch.randn(8, 3, generator=gen).to(dtype)) for _ in range(n)]


def _loss(model, x, y, k):
    return (model(x).float() - y.float()).pow(2).mean() / k


@register("04.offload_optimizer", reference=lambda: _ReferenceOffload, title="your offload optimizer, bitwise", timeout=120)
def check_offload_optimizer(cls) -> None:
    """Grade exercise ``04.offload_optimizer``: your offload optimizer, bitwise."""
    expect(callable(cls), f"OffloadAdamW: expected a class, got {type(cls).__name__}")

    def run(case) -> None:
        dtype, k, steps = case.dtype, case.micro, case.steps
        hp = dict(lr=case.lr, beta1=case.beta1, beta2=case.beta2, eps=case.eps, weight_decay=case.weight_decay)
        ref, mine = (_net(dtype, case.depth, case.width, case.frozen) for _ in range(2))
        what = f"{dtype} MLP ({case}), {k} micro-batches per step"
        frozen_layer = [p for p in mine.parameters() if not p.requires_grad]
        frozen_before = [p.detach().clone() for p in frozen_layer]
        trainable_ref = [p for p in ref.parameters() if p.requires_grad]
        if dtype == torch.float32:
            masters = trainable_ref
        else:  # the reference for 16-bit weights: AdamW on fp32 masters, gradients summed in fp32
            masters = [nn.Parameter(p.detach().float()) for p in trainable_ref]
        ref_opt = torch.optim.AdamW(masters, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                    weight_decay=hp["weight_decay"], foreach=False)
        opt = cls(list(mine.parameters()), lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                  weight_decay=hp["weight_decay"])
        for name in ("step", "zero_grad"):
            expect(callable(getattr(opt, name, None)), f"OffloadAdamW: the optimizer needs a {name}() method")
        gen = torch.Generator().manual_seed(2 + case.seed)
        for step in range(steps):
            batches = _opt_batches(dtype, k, gen)
            sums = [torch.zeros(p.shape) for p in trainable_ref]
            for x, y in batches:
                ref.zero_grad(set_to_none=True)
                _loss(ref, x, y, k).backward()
                for s, p in zip(sums, trainable_ref):
                    s.add_(p.grad)
                _loss(mine, x, y, k).backward()
                expect(all(p.grad is None for p in mine.parameters()),
                       f"OffloadAdamW ({what}): a parameter still holds .grad after backward; the gradients must "
                       "leave for the host slots as backward produces them (your install_grad_hooks)")
            for mp, s in zip(masters, sums):
                mp.grad = s if dtype == torch.float32 else s.clone()
            ref_opt.step()
            if dtype != torch.float32:
                with torch.no_grad():
                    for mp, p in zip(masters, trainable_ref):
                        p.copy_(mp)
            opt.step()
            opt.zero_grad()
            for i, (p, q) in enumerate(zip(ref.parameters(), mine.parameters())):
                expect(q.dtype == dtype, f"OffloadAdamW ({what}): parameter {i} became {q.dtype}; keep the model's dtype")
                if not torch.equal(p, q):
                    expect(False, f"OffloadAdamW ({what}, step {step + 1}): parameter {i} differs from torch AdamW "
                           f"{'on fp32 master weights ' if dtype != torch.float32 else ''}by "
                           f"{(p.float() - q.float()).abs().max().item():.3g}; step every trainable parameter once per "
                           "optimizer step on its fp32 master with the gradient summed over the micro-batches, then "
                           "copy the master into the parameter, and clear the slots in zero_grad()")
        for p, b in zip(frozen_layer, frozen_before):
            expect(torch.equal(p, b), f"OffloadAdamW ({what}): the frozen layer changed; a parameter with "
                   "requires_grad=False gets no update (and no weight decay)")

    # the constructor's hyper-parameters drawn (beta1 0 to 0.99, eps 1e-12 to 1e-3, decay or none), fp32 and 16-bit
    # weights, MLPs of any depth and width with a frozen layer or not, 1-4 micro-batches, 1-3 steps
    edges = [dict(dtype=dtype, micro=3, steps=3, depth=2, width=16, frozen=True, lr=hp["lr"], beta1=hp["beta1"],
                  beta2=hp["beta2"], eps=hp["eps"], weight_decay=hp["weight_decay"])
             for dtype in (torch.float32, torch.bfloat16) for hp in (HPARAMS[0], HPARAMS[2])]
    differential(OFFLOAD_SPACE, run, edges=edges, examples=8)


OFFLOAD_SPACE = Space(dtype=one_of(torch.float32, torch.bfloat16, torch.float16), micro=ints(1, 4), steps=ints(1, 3),
                      depth=ints(0, 3), width=ints(1, 16), frozen=flags(), lr=floats(1e-4, 1e-1, log=True),
                      beta1=one_of(0.9, 0.0, 0.3, 0.8, 0.99), beta2=one_of(0.999, 0.9, 0.95), eps=one_of(1e-8, 1e-12, 1e-6, 1e-3),
                      weight_decay=one_of(1e-2, 0.0, 0.1))


class _ReferenceOffload:
    """memlab's answer to 04.offload_optimizer, composed of memlab.offload's pieces."""

    def __init__(self, params, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        self.params = [p for p in params if p.requires_grad]
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.master = offload.pack(self.params)
        shapes = [p.shape for p in self.params]
        self.grad, self.m, self.v = (offload.FlatBuffer(shapes) for _ in range(3))
        self.handles = offload.install_grad_hooks(self.params, self.grad.views)
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for i, p in enumerate(self.params):
            offload.adamw_step_(self.master.views[i], self.grad.views[i], self.m.views[i], self.v.views[i], self.t, **self.hp)
            p.copy_(self.master.views[i])

    def zero_grad(self):
        self.grad.flat.zero_()


# ----------------------------------------------------------------------------- 04.predict_traffic
class _CopyCounter(TorchDispatchMode):
    """Bytes that cross between the optimizer's host buffers and the model's tensors, counted op by op.

    An op that writes a host buffer from a model tensor moves the model tensor's bytes to the host; an op
    that writes a model tensor (a parameter) from a host buffer moves the written bytes to the device."""

    def __init__(self, host: set[int], params: set[int]) -> None:
        super().__init__()
        self.host, self.params = host, params
        self.to_host = self.to_device = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.add_.Tensor) and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                d, s = dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()
                if d in self.host and s not in self.host:
                    self.to_host += src.numel() * src.element_size()
                elif s in self.host and d in self.params:
                    self.to_device += dst.numel() * dst.element_size()
        return out


def _measure_traffic(model: nn.Module, micro_batches: int, offload_gradients: bool) -> tuple[int, int]:
    """One optimizer step of memlab's OffloadedAdamW (after one warm-up step), copies counted."""
    model = copy.deepcopy(model)
    opt = offload.OffloadedAdamW(model.parameters(), lr=1e-3, offload_gradients=offload_gradients,
                                 accumulation_steps=micro_batches)
    host = {b.flat.untyped_storage().data_ptr() for bufs in opt._flats for key, b in bufs.items() if key != "staging"}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counter = _CopyCounter(host, params)
    for step in range(2):
        opt.zero_grad()
        for _ in range(micro_batches):
            out = model(_input_for(model))
            out = out[0] if isinstance(out, tuple) else out
            if step == 1:
                with counter:
                    (out.float().pow(2).mean() / micro_batches).backward()
            else:
                (out.float().pow(2).mean() / micro_batches).backward()
        if step == 1:
            with counter:
                opt.step()
        else:
            opt.step()
    return counter.to_host, counter.to_device


def _input_for(model: nn.Module) -> torch.Tensor:
    from memlab.models import TinyGPT

    if isinstance(model, TinyGPT):
        return torch.randint(0, model.config.vocab_size, (2, 8))
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return torch.randn(4, first.in_features, dtype=first.weight.dtype)


def _traffic_models() -> list[tuple[str, nn.Module]]:
    from memlab.models import TinyGPT, TinyGPTConfig

    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                           nn.Linear(64, 8)).bfloat16()
    frozen[2].requires_grad_(False)  # frozen, beside a trainable layer of the same shape
    return [
        ("fp32 MLP", nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))),
        ("bf16 MLP with a frozen middle layer", frozen),
        ("bf16 TinyGPT (tied embedding and lm_head)",
         TinyGPT(TinyGPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=256)).bfloat16()),
    ]


def _predict_traffic_reference(model: nn.Module, micro_batches: int, offload_gradients: bool) -> tuple[int, int]:
    trained = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    nbytes = sum(p.numel() * p.element_size() for p in trained)
    return (micro_batches if offload_gradients else 1) * nbytes, nbytes


# MLPs of any depth and width in three dtypes (a frozen layer beside trainable ones of its shape, a weight tied between
# two layers) and TinyGPTs of any vocabulary and width (tied embedding or not), 1-5 micro-batches, gradients offloaded
# per micro-batch or once per step
TRAFFIC_SPACE = Space(model=one_of("mlp", "tinygpt"), dtype=one_of(torch.float32, torch.bfloat16, torch.float16),
                      depth=ints(1, 3), width=ints(1, 64), frozen=flags(), tied=flags(), vocab=ints(2, 300),
                      micro=ints(1, 5), offload_gradients=flags())


def _traffic_model(case) -> tuple[str, nn.Module]:
    from memlab.models import TinyGPT, TinyGPTConfig

    if case.model == "mlp":
        return f"{case.dtype} MLP", _net(case.dtype, case.depth, case.width, case.frozen, case.tied)
    torch.manual_seed(case.seed)
    heads = 1 + case.width % 4
    model = TinyGPT(TinyGPTConfig(n_layer=1 + case.depth % 2, n_embd=8 * heads, n_head=heads, block_size=8,
                                  vocab_size=case.vocab, tie_weights=case.tied)).to(case.dtype)
    if case.frozen:  # the first block's attention frozen, beside the trainable MLP
        model.blocks[0].attn.requires_grad_(False)
    return f"{case.dtype} TinyGPT", model


@register("04.predict_traffic", reference=lambda: _predict_traffic_reference, title="predict bytes moved, then measure",
          timeout=120)
def check_predict_traffic(fn) -> None:
    """Grade exercise ``04.predict_traffic``: predict bytes moved, then measure."""
    expect(callable(fn), f"predict_traffic: expected a function, got {type(fn).__name__}")
    models = _traffic_models()

    def run(case) -> None:
        if hasattr(case, "edge"):
            name, model = models[case.edge]
            micro_batches, offload_gradients = case.micro, case.offload_gradients
        else:
            name, model = _traffic_model(case)
            name = f"{name} ({case})"
            micro_batches, offload_gradients = case.micro, case.offload_gradients
        where = f"predict_traffic({name}, micro_batches={micro_batches}, offload_gradients={offload_gradients})"
        measured = _measure_traffic(model, micro_batches, offload_gradients)
        predicted = fn(copy.deepcopy(model), micro_batches, offload_gradients)
        expect(isinstance(predicted, (tuple, list)) and len(predicted) == 2
               and all(type(v) is int for v in predicted),
               f"{where}: expected a pair of ints (bytes to the host, bytes to the device), got {predicted!r:.80}")
        for direction, got, want in zip(("to the host", "to the device"), predicted, measured):
            # exact: the count is exact, and the smallest plausible omission (one bias of 8 bf16 values) is 16 bytes
            expect(got == want, f"{where}: predicted {got:,} bytes {direction} per optimizer step, measured {want:,} "
                   f"in a real step ({got - want:+,} bytes, {abs(got - want) / max(want, 1):.1%} off; allowed: 0 bytes)")

    edges = [dict(edge=i, micro=m, offload_gradients=o) for i in range(len(models)) for m, o in ((1, False), (4, False), (4, True))]
    differential(TRAFFIC_SPACE, run, edges=edges, examples=12)
