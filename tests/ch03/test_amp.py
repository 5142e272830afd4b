"""memlab.amp against PyTorch: formats, the scaler's kernels, lockstep with torch.amp.GradScaler,
the misuse errors, and fp32 master weights."""
from __future__ import annotations

import copy
import random
import struct

import pytest
import torch
from torch import nn

from memlab.amp import (
    DynamicLossScaler,
    MasterWeights,
    bit_fields,
    format_info,
    format_table_str,
    overflow_fraction,
    record_op_dtypes,
    round_trip,
    summarize_op_dtypes,
    underflow_fraction,
    unscale_grads_,
    update_scale_,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


# ----------------------------------------------------------------------------- formats
def test_format_info_matches_ieee_facts():
    fp16, bf16, fp32 = format_info("fp16"), format_info(torch.bfloat16), format_info(torch.float32)
    assert (fp16["exponent_bits"], fp16["mantissa_bits"]) == (5, 10)
    assert (bf16["exponent_bits"], bf16["mantissa_bits"]) == (8, 7)
    assert (fp32["exponent_bits"], fp32["mantissa_bits"]) == (8, 23)
    assert fp16["max"] == 65504.0
    assert fp16["smallest_normal"] == 2.0**-14 and fp16["smallest_subnormal"] == 2.0**-24
    assert bf16["smallest_subnormal"] == 2.0**-133 and fp32["smallest_subnormal"] == 2.0**-149
    # the smallest subnormal really is representable and half of it is not
    assert torch.tensor(2.0**-24).half().item() == 2.0**-24
    assert torch.tensor(2.0**-133).bfloat16().item() == 2.0**-133
    assert "fp16" in format_table_str() and "bf16" in format_table_str()
    with pytest.raises(ValueError, match="dtype="):
        format_info(torch.int8)


def test_bit_fields():
    assert bit_fields(1.0, torch.float16) == ("0", "01111", "0000000000")
    assert bit_fields(-2.0, "fp16") == ("1", "10000", "0000000000")
    assert bit_fields(65504.0, "fp16") == ("0", "11110", "1111111111")
    assert bit_fields(2.0**-24, "fp16") == ("0", "00000", "0000000001")
    for x in (1.0, -3.25, 1e-3, 123456.789, 2.0**-140):
        raw = struct.unpack(">I", struct.pack(">f", x))[0]
        s = format(raw, "032b")
        assert "".join(bit_fields(x, torch.float32)) == s
        # bf16 is the top half of fp32 (after rounding): for values exact in bf16 the bits agree
        xb = torch.tensor(x).bfloat16().float().item()
        rawb = format(struct.unpack(">I", struct.pack(">f", xb))[0], "032b")[:16]
        assert "".join(bit_fields(xb, torch.bfloat16)) == rawb


def test_underflow_fraction_counts_flushes_to_zero():
    t = torch.tensor([2.0**-26, 2.0**-25, 2.0**-24, 1.0, 0.0, 0.0, 1e-30, -1e-9])
    # fp16: 2**-26, 2**-25 (a tie, rounds to even = 0), 1e-30 and -1e-9 flush; 2**-24 and 1.0 survive
    assert underflow_fraction(t) == 4 / 6
    assert underflow_fraction(t, torch.bfloat16) == 0.0
    assert underflow_fraction(t.double(), torch.float32) == 0.0
    assert underflow_fraction(torch.zeros(5)) == 0.0
    assert underflow_fraction(torch.tensor([float("inf"), float("nan"), 1e-10])) == 1.0
    # scaling moves values out of the underflow zone
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e-7
    assert underflow_fraction(g) > 0.1
    assert underflow_fraction(g * 2.0**16) == 0.0
    # agrees with the round trip definition
    rt = round_trip(g, torch.float16)
    assert underflow_fraction(g) == ((rt == 0) & (g != 0)).sum().item() / (g != 0).sum().item()
    assert overflow_fraction(torch.tensor([7e4, 1.0, -1e5, 6e4])) == 0.5
    with pytest.raises(ValueError):
        underflow_fraction([1.0, 2.0])  # type: ignore[arg-type]


def test_record_op_dtypes_under_cpu_autocast():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, records = record_op_dtypes(lambda: torch.nn.functional.cross_entropy(lin(x), torch.arange(4)))
    summary = summarize_op_dtypes(records)
    assert summary["addmm"] == {"bfloat16": 1}  # the matmul ran in 16 bits
    assert summary["_log_softmax"] == {"float32": 1}  # cross_entropy is on CPU autocast's fp32 list
    assert any(r.name == "_to_copy" and r.output_dtype == torch.bfloat16 for r in records)  # casts are visible
    assert out.dtype == torch.float32
    _, plain = record_op_dtypes(lambda: lin(x))
    assert summarize_op_dtypes(plain)["addmm"] == {"float32": 1}


# ----------------------------------------------------------------------------- kernels vs torch's
@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_matches_torch_kernel(device):
    rng = random.Random(0)
    for growth, backoff, interval in [(2.0, 0.5, 3), (1.7, 0.3, 2), (1.0001, 0.999, 1), (3.0, 0.25, 5)]:
        a_s = torch.full((), 1234.5678, device=device)
        a_t = torch.zeros((), dtype=torch.int32, device=device)
        b_s, b_t = a_s.clone(), a_t.clone()
        for step in range(400):
            found = torch.full((), float(rng.random() < 0.3), device=device)
            torch._amp_update_scale_(a_s, a_t, found, growth, backoff, interval)
            update_scale_(b_s, b_t, found, growth, backoff, interval)
            assert a_s.item() == b_s.item() and a_t.item() == b_t.item(), (growth, backoff, step)
    # never grows past fp32 to inf
    s = torch.full((), 3e38, device=device)
    t = torch.zeros((), dtype=torch.int32, device=device)
    update_scale_(s, t, torch.zeros((), device=device), 2.0, 0.5, 1)
    assert s.item() == pytest.approx(3e38) and t.item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_unscale_grads_matches_torch_kernel(device, dtype):
    gen = torch.Generator().manual_seed(1)
    for inv in (1.0, 2.0**-16, 1 / 3, 0.7):
        for bad in (None, float("inf"), float("nan"), -float("inf")):
            grads = [(torch.randn(n, generator=gen) * 100).to(device=device, dtype=dtype) for n in (7, 130, 1)]
            if bad is not None:
                grads[1][5] = bad
            ref = [g.clone() for g in grads]
            inv_t = torch.full((), inv, device=device)
            f_ref = torch.zeros((), device=device)
            f_me = torch.zeros((), device=device)
            if device == "cuda" and dtype == torch.bfloat16:
                # torch's CUDA kernel has no bf16 implementation (its CPU kernel does): it raises, so
                # the reference is the CPU kernel on the same values
                with pytest.raises(NotImplementedError):
                    torch._amp_foreach_non_finite_check_and_unscale_(ref, f_ref, inv_t)
                ref = [r.cpu() for r in ref]
                f_cpu = torch.zeros(())
                torch._amp_foreach_non_finite_check_and_unscale_(ref, f_cpu, inv_t.cpu())
                f_ref.fill_(f_cpu.item())
            else:
                torch._amp_foreach_non_finite_check_and_unscale_(ref, f_ref, inv_t)
            unscale_grads_(grads, f_me, inv_t)
            assert f_me.item() == f_ref.item() == (0.0 if bad is None else 1.0)
            for g, r in zip(grads, ref):
                g, r = g.cpu(), r.cpu()
                assert torch.equal(g.nan_to_num(), r.nan_to_num()), (inv, bad)
                assert torch.equal(torch.isnan(g), torch.isnan(r))


# ----------------------------------------------------------------------------- lockstep with GradScaler
def _mlp(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(device)


def _lockstep(
    device: str,
    *,
    steps: int,
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    fused: bool = False,
    seed: int = 0,
    model_dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """Train two identical models, one with GradScaler and one with DynamicLossScaler, injecting
    inf/NaN gradients at random steps; assert bitwise agreement after every step."""
    kw = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval)
    ref_model = _mlp(device).to(model_dtype)
    my_model = copy.deepcopy(ref_model)

    def optimizers(m: nn.Module) -> list[torch.optim.Optimizer]:  # two optimizers: found_inf is combined over both
        extra = {"fused": True} if fused else {}
        return [
            torch.optim.AdamW(m[0].parameters(), lr=1e-3, **extra),
            torch.optim.SGD(list(m[2].parameters()) + list(m[4].parameters()), lr=1e-3, momentum=0.9),
        ]

    ref_opts, my_opts = optimizers(ref_model), optimizers(my_model)
    ref = torch.amp.GradScaler(device, **kw)
    mine = DynamicLossScaler(**kw)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    copy_grads = device == "cuda"  # two backward passes on a GPU need not agree bitwise; the scaler's part must
    stats = {"skipped": 0, "grown": 0, "injected": 0}
    autocast_dtype = torch.float16 if model_dtype == torch.float32 else model_dtype
    for step in range(steps):
        x = (torch.randn(32, 16, generator=gen) * rng.choice([1.0, 10.0, 100.0])).to(device, model_dtype)
        losses = []
        for model, opts, scaler in ((ref_model, ref_opts, ref), (my_model, my_opts, mine)):
            for o in opts:
                o.zero_grad()
            with torch.autocast(device, dtype=autocast_dtype, enabled=model_dtype == torch.float32):
                loss = model(x).float().pow(2).mean()
            scaled = scaler.scale(loss)
            losses.append(scaled.detach())
            scaled.backward()
        if not copy_grads:
            assert torch.equal(losses[0], losses[1]), f"step {step}: scale(loss) differs"
        else:
            assert torch.allclose(losses[0], losses[1]), f"step {step}: scale(loss) differs"
        if copy_grads:
            for p, q in zip(ref_model.parameters(), my_model.parameters()):
                q.grad.copy_(p.grad)
        if rng.random() < 0.15:  # inject inf / -inf / NaN at a random element of a random gradient
            stats["injected"] += 1
            idx = rng.randrange(len(list(ref_model.parameters())))
            val = rng.choice([float("inf"), -float("inf"), float("nan")])
            for m in (ref_model, my_model):
                g = list(m.parameters())[idx].grad
                g.view(-1)[step % g.numel()] = val
        clip = step % 4 == 1
        stepped_ref, stepped_me = [], []
        for scaler, opts, model, out in ((ref, ref_opts, ref_model, stepped_ref), (mine, my_opts, my_model, stepped_me)):
            if clip:
                for o in opts:  # clip each optimizer's own gradients (a NaN elsewhere must not leak in)
                    scaler.unscale_(o)
                    torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 1.0)
            for o in opts:
                r = scaler.step(o)
                if scaler is ref:
                    out.append(not sum(v.item() for v in ref._found_inf_per_device(o).values()))
                else:
                    out.append(r)
        assert stepped_ref == stepped_me, f"step {step}: GradScaler stepped {stepped_ref}, mine {stepped_me}"
        before = mine.get_scale()
        ref.update()
        mine.update()
        stats["skipped"] += not all(stepped_me)
        stats["grown"] += mine.get_scale() > before
        assert ref.get_scale() == mine.get_scale(), f"step {step}: scale {ref.get_scale()} vs {mine.get_scale()}"
        assert ref._get_growth_tracker() == mine.get_growth_tracker(), f"step {step}: growth tracker"
        for (n, p), q in zip(ref_model.named_parameters(), my_model.parameters()):
            assert torch.isfinite(p).all(), f"step {step}: parameter {n} diverged (test set-up, not the scaler)"
            assert torch.equal(p, q), f"step {step}: parameter {n} differs, max diff {(p - q).abs().max().item()}"
        if step == steps // 2:  # checkpoint both scalers mid-run and resume from the state dicts
            sd_ref, sd_me = ref.state_dict(), mine.state_dict()
            assert sd_ref == sd_me
            ref = torch.amp.GradScaler(device)
            ref.load_state_dict(sd_ref)
            mine = DynamicLossScaler()
            mine.load_state_dict(sd_ref)  # GradScaler's checkpoint loads into DynamicLossScaler
    return stats


@pytest.mark.parametrize("device", DEVICES)
def test_lockstep_with_gradscaler(device):
    stats = _lockstep(device, steps=200, init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    # the run really exercised every branch: natural overflow and injected infs, growth, skips
    assert stats["skipped"] > stats["injected"] > 10
    assert stats["grown"] > 10


@pytest.mark.parametrize("device", DEVICES)
def test_lockstep_odd_factors_and_fused_optimizer(device):
    # factors that are not powers of two: the scale and 1/scale need exact fp64->fp32 rounding
    stats = _lockstep(device, steps=100, init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2, fused=True, seed=1)
    assert stats["skipped"] > 5 and stats["grown"] > 5


@pytest.mark.parametrize("device", DEVICES)
def test_lockstep_bf16_gradients(device):
    # a pure-bf16 model: the gradients themselves are 16-bit (unscaled in fp32, rounded back)
    if device == "cuda":
        # torch's GradScaler cannot unscale bf16 gradients on CUDA (no bf16 CUDA kernel; measured on
        # an H100 with torch 2.11): there is no CUDA reference to run in lockstep with
        with pytest.raises(NotImplementedError):
            torch._amp_foreach_non_finite_check_and_unscale_(
                [torch.ones(3, device="cuda", dtype=torch.bfloat16)], torch.zeros((), device="cuda"), torch.ones((), device="cuda"))
        pytest.skip("torch's GradScaler has no bf16 CUDA kernel; bf16 lockstep runs on cpu")
    stats = _lockstep(device, steps=100, init_scale=777.0, growth_factor=1.5, backoff_factor=0.6, growth_interval=2, seed=2, model_dtype=torch.bfloat16)
    assert stats["skipped"] > 3


def test_lockstep_tinygpt():
    from memlab.models.corpus import batches, stdlib_corpus
    from memlab.models import TinyGPT, TinyGPTConfig

    torch.manual_seed(0)
    ref_model = TinyGPT(TinyGPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32))
    my_model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3)
    my_opt = torch.optim.AdamW(my_model.parameters(), lr=3e-3)
    ref, mine = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2), DynamicLossScaler(init_scale=2.0**20, growth_interval=2)
    data = batches(stdlib_corpus(max_bytes=200_000), 2, 32, seed=0)
    skipped = 0
    for step in range(15):
        x, y = next(data)
        for model, opt, scaler in ((ref_model, ref_opt, ref), (my_model, my_opt, mine)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(x, y)
            scaler.scale(loss).backward()
        ref.step(ref_opt)
        skipped += not mine.step(my_opt)
        ref.update()
        mine.update()
        assert ref.get_scale() == mine.get_scale()
        for p, q in zip(ref_model.parameters(), my_model.parameters()):
            assert torch.equal(p, q)
    assert skipped >= 1  # 2**20 overflows fp16 at first: the scaler had to back off


# ----------------------------------------------------------------------------- misuse: same errors
def _setup(make_scaler):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return make_scaler(), model, opt


def _run(scenario, make_scaler):
    scaler, model, opt = _setup(make_scaler)
    loss = model(torch.randn(3, 4)).sum()
    try:
        scenario(scaler, model, opt, loss)
    except Exception as exc:  # noqa: BLE001 - we compare what was raised
        return type(exc), str(exc)
    return None


def _scale_backward(s, m, o, loss):
    s.scale(loss).backward()


SCENARIOS = {
    "unscale_twice": lambda s, m, o, l: (_scale_backward(s, m, o, l), s.unscale_(o), s.unscale_(o)),
    "unscale_after_step": lambda s, m, o, l: (_scale_backward(s, m, o, l), s.step(o), s.unscale_(o)),
    "step_twice": lambda s, m, o, l: (_scale_backward(s, m, o, l), s.step(o), s.step(o)),
    "step_before_scale": lambda s, m, o, l: (l.backward(), s.step(o)),
    "unscale_before_scale": lambda s, m, o, l: (l.backward(), s.unscale_(o)),
    "update_before_scale": lambda s, m, o, l: s.update(),
    "update_without_step": lambda s, m, o, l: (_scale_backward(s, m, o, l), s.update()),
    "step_without_grads": lambda s, m, o, l: (s.scale(l), s.step(o)),
    "step_with_closure": lambda s, m, o, l: (_scale_backward(s, m, o, l), s.step(o, closure=lambda: l)),
    "fp16_grads": lambda s, m, o, l: (s.scale(l), [setattr(p, "grad", torch.ones_like(p, dtype=torch.float16)) for p in m.parameters()], s.step(o)),
    "load_empty_state": lambda s, m, o, l: s.load_state_dict({}),
    "scale_not_a_tensor": lambda s, m, o, l: s.scale([l, 3]),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_misuse_raises_like_gradscaler(name):
    want = _run(SCENARIOS[name], lambda: torch.amp.GradScaler("cpu"))
    got = _run(SCENARIOS[name], DynamicLossScaler)
    assert want is not None, f"{name}: GradScaler raised nothing (scenario is wrong)"
    assert got == want


def test_valid_sequences_and_state():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    assert s.get_scale() == 8.0 and s.state_dict()["_growth_tracker"] == 0
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w0 = model.weight.detach().clone()
    for i in range(4):
        opt.zero_grad()
        s.scale(model(torch.ones(1, 3)).sum()).backward()
        assert torch.allclose(model.weight.grad, torch.full_like(model.weight, 8.0 * 2 ** (i // 2)))
        assert s.step(opt) is True
        s.update()
    assert s.get_scale() == 32.0 and not torch.equal(model.weight, w0)
    # a manual scale; a disabled scaler is a pass-through
    s.update(new_scale=5.0)
    assert s.get_scale() == 5.0
    off = DynamicLossScaler(enabled=False)
    t = torch.ones(2)
    assert off.scale(t) is t and off.get_scale() == 1.0 and off.state_dict() == {}
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    assert off.step(opt) is True
    # nested outputs are scaled like GradScaler does
    a, (b, c) = s.scale([torch.ones(1), (torch.ones(1) * 2, torch.ones(1) * 3)])
    assert (a.item(), b.item(), c.item()) == (5.0, 10.0, 15.0)
    assert "scale=5" in repr(s)


@pytest.mark.parametrize("kw", [dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(backoff_factor=0.0), dict(growth_interval=0), dict(init_scale=-1.0), dict(growth_interval=2.5)])
def test_bad_arguments_name_the_argument(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kw)


# ----------------------------------------------------------------------------- master weights
def _fp16_exact_grads(params, gen):
    return [(torch.randn(p.shape, generator=gen) * 1e-2).half().float() for p in params]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_master_weights_follow_an_fp32_optimizer(dtype):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    mw = MasterWeights(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        grads = _fp16_exact_grads(list(ref.parameters()), gen)
        if dtype == torch.bfloat16:
            grads = [g.bfloat16().float() for g in grads]
        for p, q, g in zip(ref.parameters(), model.parameters(), grads):
            p.grad = g.clone()
            q.grad = g.to(dtype)  # the same gradient, held in 16 bits (exactly representable)
        ref_opt.step()
        assert mw.step() is True
        for p, q, m in zip(ref.parameters(), model.parameters(), mw.master_params):
            assert torch.equal(m, p)  # the master follows the fp32 optimizer exactly
            assert torch.equal(q, p.to(dtype))  # the model is it rounded to 16 bits
            # i.e. within half an ulp of the fp32 weights
            ulp = torch.finfo(dtype).eps * p.abs().clamp_min(torch.finfo(dtype).smallest_normal)
            assert ((q.float() - p).abs() <= ulp / 2 * 1.0001).all()
        mw.zero_grad()


def test_master_weights_keep_small_updates_that_fp16_loses():
    w = torch.ones(1000)
    lr, g = 1e-4, torch.full((1000,), 1.0)
    # pure fp16: 1 - 1e-4 rounds back to 1 (fp16 spacing just below 1 is 2**-11 ~ 4.9e-4)
    p16 = nn.Parameter(w.half())
    opt16 = torch.optim.SGD([p16], lr=lr)
    model = nn.Linear(1000, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    mw = MasterWeights(model, lambda ps: torch.optim.SGD(ps, lr=lr))
    for _ in range(10):
        p16.grad = g.half()
        opt16.step()
        model.weight.grad = g.half().view(1, -1)
        mw.step()
    assert torch.equal(p16.float(), w)  # ten updates, all lost
    assert torch.allclose(mw.master_params[0], torch.full((1, 1000), 1 - 10 * lr), atol=1e-6)
    assert (model.weight.float() < 1).all()  # the accumulated update shows in fp16


def test_master_weights_with_scalers_skip_on_overflow():
    for make in (lambda: DynamicLossScaler(init_scale=2.0**10), lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10)):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        mw = MasterWeights(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
        scaler = make()
        x = torch.randn(3, 4).half()
        w0 = model.weight.detach().clone()
        scaler.scale(model(x).float().sum()).backward()
        model.weight.grad[0, 0] = float("inf")
        mw.step(scaler)
        scaler.update()
        assert torch.equal(model.weight, w0) and scaler.get_scale() == 2.0**9
        mw.zero_grad()
        scaler.scale(model(x).float().sum()).backward()
        assert mw.step(scaler) is True
        scaler.update()
        assert not torch.equal(model.weight, w0)
    # fp16 gradients cannot be unscaled: that is why the master copy holds fp32 ones
    model = nn.Linear(4, 2).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = DynamicLossScaler()
    s.scale(model(torch.randn(3, 4).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        s.step(opt)


def test_master_weights_bytes_are_not_half():
    from memlab.accounting import model_state_bytes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    n = sum(p.numel() for p in model.parameters())
    mw = MasterWeights(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    model(torch.randn(2, 64).half()).float().sum().backward()
    after_backward = mw.memory_bytes()
    mw.step()
    after_step = mw.memory_bytes()
    assert after_backward["model weights (16-bit)"] == 2 * n == after_backward["model grads (16-bit)"]
    assert after_backward["master weights (fp32)"] == 4 * n and after_backward["master grads (fp32)"] == 0
    assert after_step["model grads (16-bit)"] == 0 and after_step["master grads (fp32)"] == 4 * n
    adam = after_step["optimizer state"]
    assert 8 * n <= adam <= 8 * n + 4 * 16  # m and v, plus a scalar step count per tensor
    # 2 + 2 + 4 + 8 = 16 bytes per parameter once Adam has state: the same as fp32 training
    steady = after_step["total"] - after_step["master grads (fp32)"] + 2 * n
    fp32 = model_state_bytes(n, "fp32-adamw")["total"]
    assert abs(steady - fp32) <= 4 * 16
    assert model_state_bytes(n, "mixed-adamw")["total"] == fp32


def test_master_weights_arguments_and_state_dict():
    with pytest.raises(ValueError, match="dtype="):
        MasterWeights(nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), dtype=torch.float32)
    with pytest.raises(ValueError, match="make_optimizer"):
        MasterWeights(nn.Linear(2, 2), lambda ps: None)  # type: ignore[arg-type,return-value]
    m = nn.Linear(2, 2)
    mw = MasterWeights(m, lambda ps: torch.optim.SGD(ps, lr=0.1), dtype="bf16")
    sd = mw.state_dict()
    with torch.no_grad():
        mw.master_params[0].add_(1.0)
    mw.load_state_dict(sd)
    assert torch.equal(m.weight, sd["master"][0].bfloat16())
    assert "MasterWeights(6 params" in repr(mw)


# ----------------------------------------------------------------------------- predict, then measure an update
def _update_models():
    from memlab.models import TinyGPT, TinyGPTConfig

    return [lambda: TinyGPT(TinyGPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)),
            lambda: TinyGPT(TinyGPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16, vocab_size=1024)),
            lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
            lambda: nn.Sequential(*[nn.Linear(48, 48) for _ in range(8)])]


@pytest.mark.parametrize("recipe", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("i", range(4))
def test_update_peak_bytes_within_1_percent_of_measured(i, recipe):
    from memlab.amp import measure_update_peak, update_peak_bytes

    make = _update_models()[i]
    torch.manual_seed(0)
    predicted = update_peak_bytes(make(), recipe)
    torch.manual_seed(0)
    measured = measure_update_peak(make(), recipe)
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


def test_master_weights_update_peaks_above_fp32():
    """fp32 master weights cost 18 bytes per parameter in the update, fp32 training 16: measured, 2 bytes apart."""
    from memlab.amp import measure_update_peak

    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

    n = sum(p.numel() for p in make().parameters())
    fp32, fp16, bf16 = (measure_update_peak(make(), r) for r in ("fp32", "fp16", "bf16"))
    assert fp16 == bf16
    assert fp16 - fp32 == pytest.approx(2 * n, rel=0.01)


def test_measure_update_peak_counts_what_memory_bytes_reports():
    """The tracker's peak is at least the states MasterWeights.memory_bytes() reports after the step."""
    from memlab.amp import measure_update_peak

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Linear(128, 32))
    peak = measure_update_peak(model, "fp16")
    n = sum(p.numel() for p in model.parameters())
    assert peak >= 18 * n


@pytest.mark.parametrize("model,recipe,match", [
    ("mlp", "fp8", "recipe='fp8' is invalid; allowed: 'fp32', 'fp16' or 'fp16-mixed'"),
    ("mlp", "bf16-pure", "recipe='bf16-pure' is invalid"),  # no master copy: not an update recipe here
    ("frozen", "fp32", r"(?s)model=.* is invalid; allowed: .*every parameter training.*frozen here: \['0.weight'\]"),
    ("none", "fp32", "model='a model' is invalid; allowed: an nn.Module"),
])
def test_update_peak_bad_arguments(model, recipe, match):
    from memlab.amp import measure_update_peak, update_peak_bytes

    m = {"mlp": nn.Linear(4, 4), "none": "a model"}.get(model)
    if model == "frozen":
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        m[0].weight.requires_grad_(False)
    for fn in (update_peak_bytes, measure_update_peak):
        with pytest.raises(ValueError, match=match):
            fn(m, recipe)


def test_update_recipes_accept_the_shared_vocabulary():
    """"fp16"/"bf16" are fp16-mixed/bf16-mixed (memlab.core.vocab): every spelling predicts and measures the same."""
    from memlab.amp import UPDATE_RECIPES, measure_update_peak, update_peak_bytes, update_recipe_dtype
    from memlab.core.vocab import Recipe

    assert list(UPDATE_RECIPES) == ["fp32", "fp16", "bf16"]  # chapter 03's lab iterates these keys
    spellings = {"fp32": ["fp32", Recipe.FP32], "fp16": ["fp16", "fp16-mixed", Recipe.FP16_MIXED],
                 "bf16": ["bf16", "BF16-Mixed", Recipe.BF16_MIXED]}
    for short, names in spellings.items():
        make = lambda: nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32))  # noqa: E731
        torch.manual_seed(0)
        want = (update_peak_bytes(make(), short), measure_update_peak(make(), short))
        for name in names:
            assert update_recipe_dtype(name) is UPDATE_RECIPES[short]
            torch.manual_seed(0)
            assert (update_peak_bytes(make(), name), measure_update_peak(make(), name)) == want, name
