"""Checks for chapter 04, CPU-offload AdamW.

04.adamw_update          one AdamW step, bitwise equal to torch.optim.AdamW(foreach=False) over many steps
04.bias_correction       (1 - beta1**t, 1 - beta2**t) and what they do to the first step
04.pack_flat             tensors packed in one flat float32 buffer, with views that share its storage
04.chunked_step          the step over flat buffers in slices of `chunk` elements (no full-size temporaries)
04.grad_hook             post-accumulate-grad hooks that add each finished grad into its fp32 slot and free it
04.predict_device_bytes  predict the device bytes of a model's states under AdamW / offload; graded on the error

Production references: torch.optim.AdamW (its single-tensor for-loop), torch's autograd
post-accumulate-grad hooks, and the tensors counted after a real training step.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memlab import offload
from memlab.accounting import optimizer_state_bytes, unique_bytes
from memlab.checks import expect, expect_close, expect_type, register

HPARAMS = [
    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2),
    dict(lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0),
    dict(lr=1e-3, beta1=0.3, beta2=0.9, eps=1e-8, weight_decay=0.1),  # 1 - beta1 >= 0.5: lerp's other branch
]


def _hp_str(hp: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in hp.items())


# ----------------------------------------------------------------------------- 04.adamw_update
@register("04.adamw_update", reference=lambda: offload.adamw_step_, title="AdamW update, bitwise vs torch")
def check_adamw_update(fn) -> None:
    expect(callable(fn), f"adamw_step_: expected a function, got {type(fn).__name__}")
    for hp in HPARAMS:
        for shape in ((7,), (33, 5)):
            gen = torch.Generator().manual_seed(4)
            p0 = torch.randn(shape, generator=gen)
            ref = nn.Parameter(p0.clone())
            opt = torch.optim.AdamW([ref], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                    weight_decay=hp["weight_decay"], foreach=False)
            p, m, v = p0.clone(), torch.zeros(shape), torch.zeros(shape)
            for step in range(1, 9):
                g = torch.randn(shape, generator=gen) * (10.0 if step == 4 else 1.0)
                ref.grad = g.clone()
                opt.step()
                out = fn(p, g.clone(), m, v, step, **hp)
                expect(out is None or out is p, "adamw_step_: update param, exp_avg and exp_avg_sq in place (return None)")
                where = f"({_hp_str(hp)}, shape {shape}, step {step})"
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


# ----------------------------------------------------------------------------- 04.bias_correction
@register("04.bias_correction", reference=lambda: offload.bias_corrections, title="bias corrections")
def check_bias_correction(fn) -> None:
    expect(callable(fn), f"bias_corrections: expected a function, got {type(fn).__name__}")
    for beta1, beta2 in ((0.9, 0.999), (0.8, 0.95), (0.0, 0.5)):
        for step in (1, 2, 3, 10, 100, 5000):
            got = fn(step, beta1, beta2)
            expect(isinstance(got, (tuple, list)) and len(got) == 2,
                   f"bias_corrections({step}, {beta1}, {beta2}): expected a pair (bc1, bc2), got {got!r:.80}")
            want = (1 - beta1**step, 1 - beta2**step)
            for name, g, w in zip(("bc1", "bc2"), got, want):
                expect_close(f"bias_corrections(step={step}, beta1={beta1}, beta2={beta2}) {name}", g, w, rtol=1e-12)
    # what the corrections are for: with zero-initialised moments, the first corrected step is lr*g/(|g|+eps)
    g = torch.tensor([0.5, -2.0, 1e-3])
    bc1, bc2 = fn(1, 0.9, 0.999)
    m_hat, v_hat = (0.1 * g) / bc1, (0.001 * g * g) / bc2
    expect(torch.allclose(m_hat / v_hat.sqrt(), g.sign(), rtol=1e-5),
           "bias_corrections: after step 1, m/bc1 / sqrt(v/bc2) must be sign(g) (zero-initialised moments, de-biased)")


# ----------------------------------------------------------------------------- 04.pack_flat
def _pack_reference(tensors):
    buf = offload.pack(tensors)
    return buf.flat, buf.views


@register("04.pack_flat", reference=lambda: _pack_reference, title="flat buffer with views")
def check_pack_flat(fn) -> None:
    expect(callable(fn), f"pack: expected a function, got {type(fn).__name__}")
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("three fp32 tensors", [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen), torch.randn(2, 2, 2, generator=gen)]),
        ("bf16 tensors (cast to float32)", [torch.randn(6, generator=gen).bfloat16(), torch.randn(4, 3, generator=gen).bfloat16()]),
        ("a 0-d tensor between two others", [torch.randn(2, generator=gen), torch.tensor(3.5), torch.randn(1, 3, generator=gen)]),
        ("one tensor", [torch.randn(10, generator=gen)]),
    ]
    for name, ts in cases:
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
            offset += t.numel()
        for t, o in zip(ts, originals):
            expect(torch.equal(t, o), f"pack ({name}): the input tensors must not change")
        flat.mul_(2)
        for i, (v, t) in enumerate(zip(views, originals)):
            expect(torch.equal(v, t.float() * 2), f"pack ({name}): writing flat did not change views[{i}]")


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


@register("04.chunked_step", reference=lambda: offload.adamw_step_eager_chunked_, title="chunked step on flat buffers")
def check_chunked_step(fn) -> None:
    expect(callable(fn), f"adamw_step_chunked_: expected a function, got {type(fn).__name__}")
    for n, chunk in ((1000, 128), (1003, 100), (64, 64), (50, 1000), (9, 1)):
        for hp in HPARAMS[:2]:
            gen = torch.Generator().manual_seed(n)
            p0 = torch.randn(n, generator=gen)
            want = [p0.clone(), torch.zeros(n), torch.zeros(n)]
            got = [p0.clone(), torch.zeros(n), torch.zeros(n)]
            log = _AllocLog()
            for step in range(1, 5):
                g = torch.randn(n, generator=gen)
                offload.adamw_step_(want[0], g, want[1], want[2], step, **hp)
                g_in = g.clone()
                with log:
                    fn(got[0], g_in, got[1], got[2], step, chunk=chunk, **hp)
                where = f"(n={n}, chunk={chunk}, {_hp_str(hp)}, step {step})"
                for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
                    if not torch.allclose(a, b, rtol=1e-6, atol=1e-7):
                        bad = (~torch.isclose(a, b, rtol=1e-6, atol=1e-7)).nonzero().flatten()
                        expect(False, f"adamw_step_chunked_ {where}: {name} is wrong at {bad.numel()} element(s), first at index "
                               f"{bad[0].item()}; every element must get exactly one AdamW update with this step number")
            expect(log.largest <= chunk,
                   f"adamw_step_chunked_ (n={n}, chunk={chunk}): an op allocated a temporary of {log.largest} elements; "
                   f"work on slices of at most chunk={chunk} elements so temporaries stay in cache")


# ----------------------------------------------------------------------------- 04.grad_hook
def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


@register("04.grad_hook", reference=lambda: offload.install_grad_hooks, title="gradient-staging hooks")
def check_grad_hook(fn) -> None:
    expect(callable(fn), f"install_grad_hooks: expected a function, got {type(fn).__name__}")
    for dtype in (torch.float32, torch.bfloat16):
        ref, mine = _net(dtype), _net(dtype)
        unused = nn.Parameter(torch.ones(4, dtype=dtype))  # gets no gradient: its slot must stay zero
        params = list(mine.parameters()) + [unused]
        slots = [torch.zeros(p.shape) for p in params]
        seen_during_backward: list[int] = []

        def spy(grad):  # runs when the first layer's input grad is computed: late in backward
            seen_during_backward.append(sum(p.grad is not None for p in mine[2:].parameters()))
            return grad

        handles = fn(params, slots)
        expect(isinstance(handles, (list, tuple)) and len(handles) >= len(list(mine.parameters())),
               f"install_grad_hooks ({dtype}): return the list of hook handles (one per parameter), got {handles!r:.80}")
        gen = torch.Generator().manual_seed(1)
        for micro in range(3):
            x = torch.randn(8, 6, generator=gen).to(dtype)
            y = torch.randn(8, 3, generator=gen).to(dtype)
            (ref(x).float() - y.float()).pow(2).mean().backward()
            def watch(mod, inp, out):
                out.register_hook(spy)

            h = mine[0].register_forward_hook(watch)
            (mine(x).float() - y.float()).pow(2).mean().backward()
            h.remove()
            for i, p in enumerate(mine.parameters()):
                expect(p.grad is None, f"install_grad_hooks ({dtype}, micro-batch {micro}): parameter {i} still holds .grad "
                       "after backward; set param.grad = None in the hook so the device memory is freed")
            expect(seen_during_backward[-1] == 0, f"install_grad_hooks ({dtype}): the later layers' grads were still on the "
                   "model while backward went on; stage and free each one as soon as it is final (post-accumulate-grad hook)")
            for i, (p, s) in enumerate(zip(ref.parameters(), slots)):
                expect(s.dtype == torch.float32, f"install_grad_hooks ({dtype}): slot {i} became {s.dtype}; keep slots float32")
                want = p.grad.float()
                if not torch.allclose(s, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4):
                    expect(False, f"install_grad_hooks ({dtype}, after {micro + 1} micro-batch(es)): slot {i} is off from the "
                           f"accumulated gradient by {(s - want).abs().max().item():.3g}; add each micro-batch's grad into the "
                           "slot (slot += grad), never overwrite it")
        expect(torch.count_nonzero(slots[-1]).item() == 0, f"install_grad_hooks ({dtype}): a parameter without a gradient changed its slot")
        for hnd in handles:
            hnd.remove()
        before = [s.clone() for s in slots]
        (mine(torch.randn(2, 6).to(dtype)).float().sum()).backward()
        expect(all(torch.equal(a, b) for a, b in zip(slots, before)),
               f"install_grad_hooks ({dtype}): removing the returned handles must stop the staging")


# ----------------------------------------------------------------------------- 04.predict_device_bytes
def _measure_device_bytes(model: nn.Module, recipe: str) -> int:
    """Train one step under ``recipe`` and count what stays on the device (storages once)."""
    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if recipe == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    else:
        opt = offload.OffloadedAdamW(trainable, lr=1e-3, offload_gradients=recipe == "offload grads")
    x = _input_for(model)
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    opt.step()  # states exist; grads are still there (no zero_grad)
    weights = unique_bytes(list(model.parameters()) + list(model.buffers()))
    grads = unique_bytes(p.grad for p in model.parameters())
    states = optimizer_state_bytes(opt) if recipe == "adamw" else 0  # OffloadedAdamW's state lives on the host
    return weights + grads + states


def _input_for(model: nn.Module) -> torch.Tensor:
    from memlab.models import TinyGPT

    if isinstance(model, TinyGPT):
        return torch.randint(0, model.config.vocab_size, (2, 8))
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return torch.randn(4, first.in_features, dtype=first.weight.dtype)


def _models() -> list[tuple[str, nn.Module]]:
    from memlab.models import TinyGPT, TinyGPTConfig

    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    frozen[0].requires_grad_(False)
    return [
        ("fp32 MLP", nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))),
        ("bf16 MLP", nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).bfloat16()),
        ("MLP with a frozen first layer", frozen),
        ("TinyGPT (tied embedding and lm_head)", TinyGPT(TinyGPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=256))),
        ("bf16 TinyGPT", TinyGPT(TinyGPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=256)).bfloat16()),
    ]


@register("04.predict_device_bytes", reference=lambda: offload.predict_device_bytes, title="predict device bytes, then measure", timeout=120)
def check_predict_device_bytes(fn) -> None:
    expect(callable(fn), f"predict_device_bytes: expected a function, got {type(fn).__name__}")
    for name, model in _models():
        for recipe in offload.DEVICE_RECIPES:
            measured = _measure_device_bytes(model, recipe)
            predicted = fn(copy.deepcopy(model), recipe)
            expect(type(predicted) in (int, float) and math.isfinite(predicted),
                   f"predict_device_bytes({name}, {recipe!r}): expected a number of bytes, got {predicted!r:.80}")
            err = abs(predicted - measured) / measured
            expect(err <= 0.02, f"predict_device_bytes({name}, {recipe!r}): predicted {int(predicted):,} bytes, measured "
                   f"{measured:,} after a real step ({err:.1%} off; allowed 2%)")
