"""Checks for chapter 00, "where the memory goes"."""
from __future__ import annotations

import torch
from torch import nn

from memlab import accounting as ref
from memlab.checks import expect, expect_equal, expect_type, register


@register("00.model_state_bytes", reference=lambda: ref.model_state_bytes, title="bytes of weights, grads, optimizer")
def check_model_state_bytes(fn):
    for n in (0, 1, 1000, 7_000_000_000):
        for recipe in ("fp32-adamw", "fp32-sgd", "mixed-adamw"):
            got = fn(n, recipe)
            want = ref.model_state_bytes(n, recipe)
            expect_type(f"model_state_bytes({n}, {recipe!r})", got, dict)
            for key in ("weights", "gradients", "optimizer", "total"):
                expect(key in got, f"model_state_bytes({n}, {recipe!r}): the dict has no key {key!r} (keys: {sorted(got)})")
                expect_equal(f"model_state_bytes({n}, {recipe!r})[{key!r}]", got[key], want[key])
    got = fn(7_000_000_000, "fp32-adamw")["total"]
    expect(got == 112_000_000_000, f"7B parameters in fp32 with AdamW: got {got:,} bytes, expected 112,000,000,000 (112 GB)")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _stepped(opt_factory, dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    model = _model().to(dtype)
    opt = opt_factory(model.parameters())
    model(torch.randn(4, 16, dtype=dtype)).square().mean().backward()
    opt.step()
    return opt


@register("00.optimizer_state_bytes", reference=lambda: ref.optimizer_state_bytes, title="count an optimizer's state")
def check_optimizer_state_bytes(fn):
    cases = {
        "a fresh AdamW (no step yet)": _model_opt_fresh(),
        "AdamW after one step": _stepped(lambda p: torch.optim.AdamW(p, lr=1e-3)),
        "SGD with momentum after one step": _stepped(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        "Adam with amsgrad after one step": _stepped(lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True)),
    }
    # float64 moments: not 4 bytes per element
    cases["AdamW on a float64 model after one step"] = _stepped(lambda p: torch.optim.AdamW(p, lr=1e-3), torch.float64)
    # state that shares storage: a flat buffer and per-parameter views into it (as fused and offloaded
    # optimizers keep it): the buffer's bytes count once, and a view stands for its whole storage
    shared = torch.optim.SGD(_model().parameters(), lr=0.1)
    flat = torch.zeros(1000)
    params = [p for g in shared.param_groups for p in g["params"]]
    shared.state[params[0]] = {"flat": flat, "head": flat[:10], "tail": flat[500:]}
    shared.state[params[1]] = {"slice": flat[100:200], "own": torch.zeros(7, dtype=torch.float16)}
    cases["state tensors that are views of one flat buffer"] = shared
    for name, opt in cases.items():
        want = ref.optimizer_state_bytes(opt)
        got = fn(opt)
        expect(isinstance(got, int) and not isinstance(got, bool), f"{name}: expected an int number of bytes, got {type(got).__name__}")
        expect_equal(f"{name}: state bytes", got, want)


def _model_opt_fresh() -> torch.optim.Optimizer:
    return torch.optim.AdamW(_model().parameters(), lr=1e-3)


@register("00.activation_bytes", reference=lambda: ref.activation_bytes_per_layer, title="activation bytes per layer")
def check_activation_bytes(fn):
    for s, b, h, a in ((2048, 1, 4096, 32), (4096, 4, 8192, 64), (128, 8, 768, 12), (64, 2, 128, 4)):
        got = fn(s, b, h, a)
        want = ref.korthikanti_bytes_per_layer(s, b, h, a)
        expect_equal(f"activation_bytes_per_layer({s}, {b}, {h}, {a}) with 16-bit activations and 1-byte masks", got, want)
        for e, m in ((4, 4), (4, 1), (2, 2), (2, 0)):
            got = fn(s, b, h, a, act_bytes=e, mask_bytes=m)
            want = ref.activation_bytes_per_layer(s, b, h, a, act_bytes=e, mask_bytes=m)
            expect_equal(f"activation_bytes_per_layer({s}, {b}, {h}, {a}, act_bytes={e}, mask_bytes={m})", got, want)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 64)
        self.out = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))


@register("00.saved_bytes", reference=lambda: ref.saved_activation_bytes, title="measure saved activations")
def check_saved_bytes(fn):
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, requires_grad=True)
    block = _Block()
    got, want = fn(block, x), ref.saved_activation_bytes(block, x)
    expect_equal("saved bytes of a LayerNorm + MLP block (its weights are not activations)", got, want)

    w = torch.randn(32, 32, requires_grad=True)

    def shared(t: torch.Tensor) -> torch.Tensor:  # t and t.T are one storage: count it once
        return (t @ t.T).sum() + (t * 2).sum()

    got, want = fn(shared, w), ref.saved_activation_bytes(shared, w)
    expect_equal("saved bytes when a tensor and its transpose are both saved (one storage)", got, want)

    def sliced(t: torch.Tensor) -> torch.Tensor:  # saves a view of 4 rows: its whole storage is kept
        u = t[:4]
        return (u * u).sum()

    got, want = fn(sliced, w), ref.saved_activation_bytes(sliced, w)
    expect_equal("saved bytes when the saved tensor is a 4-row view of a 32-row tensor (its storage is kept)", got, want)

    with torch.no_grad():
        got = fn(block, x)
    expect_equal("saved bytes under torch.no_grad()", got, 0)


# ----------------------------------------------------------------------------- 00.predict_peak
PEAK_CASES = [  # (n_layer, n_embd, n_head, batch, seq): states-bound, activation-bound and in between
    (2, 256, 4, 1, 16),
    (4, 96, 6, 2, 96),
    (6, 64, 2, 4, 64),
    (2, 192, 6, 6, 48),
]
PEAK_TOLERANCE = 0.10


def measured_step_peak(config, batch_size: int, seq_len: int) -> tuple[int, str]:
    """(peak bytes, phase) of the second fp32 AdamW step of TinyGPT(config), tracked on the CPU."""
    from memlab.models import TinyGPT
    from memlab.profiler import MemoryTracker

    torch.manual_seed(0)
    model = TinyGPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    y = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    model(x, y)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with MemoryTracker(model, opt) as tracker:
        model(x, y)[1].backward()
        opt.step()
    return tracker.peak_bytes, tracker.peak_phase


@register("00.predict_peak", reference=lambda: ref.tinygpt_step_peak, timeout=120,
          title="predict a training step's peak, then measure it")
def check_predict_peak(fn):
    from memlab.models import TinyGPTConfig

    for n_layer, n_embd, n_head, b, s in PEAK_CASES:
        cfg = TinyGPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=s, dropout=0.1)
        got = fn(cfg, b, s)
        where = f"TinyGPT {n_layer} layers x {n_embd} wide, {n_head} heads, batch {b} x {s}"
        expect(type(got) in (int, float) and got > 0,
               f"predict_peak({where}): expected a positive number of bytes, got {type(got).__name__} {got!r:.60}")
        measured, phase = measured_step_peak(cfg, b, s)
        err = float(got) / measured - 1
        expect(abs(err) <= PEAK_TOLERANCE,
               f"predict_peak({where}): predicted {float(got):,.0f} B, measured {measured:,} B (peak in the {phase} "
               f"phase): off by {err:+.1%}, allowed +-{PEAK_TOLERANCE:.0%}. Which phase holds the peak, and what is "
               f"alive then?")
