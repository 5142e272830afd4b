"""memlab.checkpoint: gradients bit-equal with and without checkpointing, RNG replay, memory model."""
from __future__ import annotations

import math

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memlab.accounting
from memlab.checkpoint import (
    MATMUL_OPS,
    RNGState,
    activation_memory_model,
    checkpoint,
    checkpoint_reentrant,
    checkpoint_sequential,
    count_saved_tensors,
    offload_activations,
    saved_activation_bytes,
    segments_for_budget,
    selective_checkpoint,
    split_segments,
    sqrt_segments,
)
from memlab.models import TinyGPT, TinyGPTConfig
from memlab.profiler import MemoryTracker


def activation_peak(tracker: MemoryTracker) -> int:
    """Peak bytes that are not the model's parameters (which are constant through the step)."""
    return tracker.peak_bytes - tracker.breakdown("peak")["parameters"]


def tiny(n_layer=3, dropout=0.1, n_embd=32, block_size=16, seed=0, attention="manual") -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(TinyGPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=block_size,
                                 dropout=dropout, attention=attention))


def batch(b=2, t=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def step_grads(model, x, y, seed=123):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(ref, got):
    loss0, g0 = ref
    loss1, g1 = got
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), f"{name}: max diff {(g0[name] - g1[name]).abs().max()}"


# ----------------------------------------------------------------------------- gradients equal
@pytest.mark.parametrize("ckpt", [checkpoint, selective_checkpoint, checkpoint_reentrant],
                         ids=["checkpoint", "selective", "reentrant"])
def test_tinygpt_gradients_bit_equal_with_dropout(ckpt):
    model = tiny(dropout=0.2)
    x, y = batch()
    ref = step_grads(model, x, y)
    model.gradient_checkpointing_enable(ckpt)
    assert_same(ref, step_grads(model, x, y))


def test_autocast_and_nested_checkpoints():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)

    def run(fn):
        net.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        return out.detach(), {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in net.named_parameters()}}

    ref = run(lambda t: net(t) * 2)
    assert_same(ref, run(lambda t: checkpoint(net, t) * 2))
    assert_same(ref, run(lambda t: selective_checkpoint(net, t) * 2))
    assert_same(ref, run(lambda t: checkpoint(lambda u: checkpoint(net, u) * 2, t)))  # nested


def test_same_as_torch_utils_checkpoint():
    model = tiny(dropout=0.2)
    x, y = batch()
    model.gradient_checkpointing_enable()  # torch.utils.checkpoint, non-reentrant
    ref = step_grads(model, x, y)
    model.gradient_checkpointing_enable(checkpoint)
    assert_same(ref, step_grads(model, x, y))


def test_checkpoint_sequential_gradients_bit_equal():
    model = tiny(n_layer=5, dropout=0.2)
    x, y = batch()
    h = torch.randn(2, 16, 32, requires_grad=True)

    def run(k):
        model.zero_grad(set_to_none=True)
        h.grad = None
        torch.manual_seed(7)
        out = checkpoint_sequential(model.blocks, k, h) if k else nn.Sequential(*model.blocks)(h)
        out.pow(2).sum().backward()
        return out.detach(), {"h": h.grad.clone(), **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}

    ref = run(0)
    for k in (1, 2, 3, 5):
        assert_same(ref, run(k))


def test_kwargs_non_tensor_args_and_tuple_outputs():
    lin = nn.Linear(8, 8)
    drop = nn.Dropout(0.5)

    def fn(x, scale, *, bias=None, mode="tanh"):
        h = drop(lin(x)) * scale
        h = torch.tanh(h) if mode == "tanh" else torch.relu(h)
        return h + bias, (h.sum(), "a string")

    x = torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)

    def run(wrap):
        for t in (x, bias, lin.weight, lin.bias):
            t.grad = None
        torch.manual_seed(3)
        a, (s, word) = wrap(fn, x, 1.5, bias=bias, mode="tanh")
        assert word == "a string"
        (a.square().sum() + s).backward()
        return a.detach(), {"x": x.grad.clone(), "bias": bias.grad.clone(), "w": lin.weight.grad.clone(),
                            "b": lin.bias.grad.clone()}

    ref = run(lambda f, *a, **k: f(*a, **k))
    assert_same(ref, run(checkpoint))
    assert_same(ref, run(selective_checkpoint))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_frozen_inputs_trainable_parameters_lora_case():
    """No input requires grad, parameters inside fn do: non-reentrant works, reentrant drops them."""
    model = tiny(n_layer=2, dropout=0.1)
    block = model.blocks[0]
    h = torch.randn(2, 16, 32)  # the output of a frozen embedding: requires_grad=False

    def run(wrap):
        block.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        wrap(block, h).sum().backward()
        return {n: p.grad for n, p in block.named_parameters()}

    ref = run(lambda f, x: f(x))
    got = run(checkpoint)
    assert all(got[n] is not None and torch.equal(ref[n], got[n]) for n in ref)

    # the pitfall, ours and torch's: the output does not require grad, backward fails
    with pytest.raises(RuntimeError, match="does not require grad"):
        run(checkpoint_reentrant)
    with pytest.raises(RuntimeError, match="does not require grad"):
        run(lambda f, x: tuc.checkpoint(f, x, use_reentrant=True))
    # ... and when something else carries the loss, the block's parameters silently get nothing
    block.zero_grad(set_to_none=True)
    other = torch.ones(1, requires_grad=True)
    (checkpoint_reentrant(block, h).sum() + other.sum()).backward()
    assert all(p.grad is None for p in block.parameters())


# ----------------------------------------------------------------------------- RNG
def test_rng_replay_makes_dropout_recompute_identically():
    model = tiny(dropout=0.3)
    x, y = batch()
    ref = step_grads(model, x, y)
    model.gradient_checkpointing_enable(lambda f, h: checkpoint(f, h, preserve_rng_state=False))
    loss, grads = step_grads(model, x, y)
    assert torch.equal(loss, ref[0])  # the forward is the same ...
    assert any(not torch.equal(grads[n], ref[1][n]) for n in grads)  # ... backward used other masks


def test_rng_stream_after_step_is_untouched():
    model = tiny(dropout=0.3)
    x, y = batch()
    step_grads(model, x, y, seed=9)
    after_plain = torch.rand(4)
    model.gradient_checkpointing_enable(checkpoint)
    step_grads(model, x, y, seed=9)
    assert torch.equal(torch.rand(4), after_plain)


def test_rng_state_snapshot_replay():
    torch.manual_seed(0)
    snap = RNGState()
    a = torch.rand(5)
    b = torch.rand(5)
    with snap.replay():
        assert torch.equal(torch.rand(5), a)
    assert not torch.equal(torch.rand(5), b)  # the stream continued after b, not after a
    torch.manual_seed(0)
    snap = RNGState()
    torch.rand(5)
    with snap.replay():
        torch.rand(100)
    assert torch.equal(torch.rand(5), b)  # replay did not move the global stream


# ----------------------------------------------------------------------------- no_grad, errors
def test_no_grad_just_runs_fn():
    calls = []
    lin = nn.Linear(4, 4)

    def fn(x):
        calls.append(torch.is_grad_enabled())
        return lin(x)

    x = torch.randn(2, 4, requires_grad=True)
    with torch.no_grad():
        out = checkpoint(fn, x)
        out2 = checkpoint_reentrant(fn, x)
    assert calls == [False, False] and not out.requires_grad and not out2.requires_grad
    assert torch.equal(out, lin(x).detach())
    calls.clear()
    checkpoint(fn, x).sum().backward()
    assert calls == [True, True]  # forward, then the recomputation in backward


def test_nothing_saved_by_checkpoint_and_retain_graph():
    block = tiny(n_layer=1, dropout=0.0).blocks[0]
    h = torch.randn(2, 16, 32, requires_grad=True)
    assert saved_activation_bytes(block, h) > 0
    assert saved_activation_bytes(lambda t: checkpoint(block, t), h) == 0
    out = checkpoint(block, h).sum()
    g1 = torch.autograd.grad(out, h, retain_graph=True)[0]
    g2 = torch.autograd.grad(out, h)[0]  # a second backward recomputes again
    assert torch.equal(g1, g2)


def test_nondeterministic_structure_is_reported():
    state = {"n": 0}
    lin = nn.Linear(4, 4)

    def fn(x):
        state["n"] += 1
        return lin(x).tanh() if state["n"] == 1 else lin(x)

    with pytest.raises(RuntimeError, match="same operations"):
        checkpoint(fn, torch.randn(2, 4, requires_grad=True)).sum().backward()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="fn=3"):
        checkpoint(3, torch.ones(1))
    with pytest.raises(ValueError, match="segments=0"):
        checkpoint_sequential([nn.Identity()], 0, torch.ones(1))
    with pytest.raises(ValueError, match="segments=3"):
        checkpoint_sequential([nn.Identity(), nn.Identity()], 3, torch.ones(1))
    with pytest.raises(ValueError, match="n_layers=0"):
        sqrt_segments(0)
    with pytest.raises(ValueError, match="keep_ops"):
        selective_checkpoint(nn.Identity(), torch.ones(1), keep_ops=())


# ----------------------------------------------------------------------------- segments and the model
def test_sqrt_segments_and_split():
    assert [sqrt_segments(n) for n in (1, 4, 9, 16, 64, 100)] == [1, 2, 3, 4, 8, 10]
    for n in range(1, 50):
        k = sqrt_segments(n)
        assert abs(k - math.sqrt(n)) < 1.0
        assert all(activation_memory_model(n, k) <= activation_memory_model(n, j) for j in range(1, n + 1))
    assert split_segments(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_segments(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_activation_memory_model_values():
    assert activation_memory_model(16, 4) == 8  # n/k + k
    assert activation_memory_model(16, 1) == 17  # input + every layer
    assert activation_memory_model(10, 3, layer_bytes=100, boundary_bytes=5) == 3 * 5 + 4 * 100


def test_segments_for_budget_picks_fewest_segments_that_fit():
    n, layer, bnd = 16, 100.0, 10.0
    for budget in (1700.0, 900.0, 500.0, 440.0):
        k = segments_for_budget(n, budget, layer, bnd)
        assert activation_memory_model(n, k, layer, bnd) <= budget
        assert all(activation_memory_model(n, j, layer, bnd) > budget for j in range(1, k))
    with pytest.raises(ValueError, match="budget_bytes"):
        segments_for_budget(n, 50.0, layer, bnd)


def test_checkpoint_sequential_recomputes_all_but_last_segment():
    calls = [0] * 6
    mods = []
    for i in range(6):
        lin = nn.Linear(4, 4)
        lin.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        mods.append(lin)
    x = torch.randn(2, 4, requires_grad=True)
    checkpoint_sequential(mods, 3, x).sum().backward()
    assert calls == [2, 2, 2, 2, 1, 1]


def test_peak_memory_falls_as_the_model_predicts():
    """16 blocks of TinyGPT: measured peak within 15% of k*boundary + ceil(n/k)*layer at k = sqrt(n).

    The model leaves out backward's working set (one layer's gradients in flight), which
    matters more as the modelled peak shrinks, hence the looser bound for k = 8."""
    n = 16
    model = tiny(n_layer=n, dropout=0.1, n_embd=64, block_size=32)
    model.requires_grad_(False)  # activations only: no parameter gradients in the count
    blocks = list(model.blocks)
    h = torch.randn(2, 32, 64, requires_grad=True)
    layer = saved_activation_bytes(blocks[0], h)
    boundary = h.numel() * h.element_size()
    peaks = {}
    for k in (1, 2, 4, 8):
        with MemoryTracker(model, timeline=False) as tracker:
            out = checkpoint_sequential(blocks, k, h)
            out.backward(torch.ones_like(out))
        del out
        peaks[k] = activation_peak(tracker)
        predicted = activation_memory_model(n, k, layer, boundary)
        assert predicted <= peaks[k] <= (1.15 if k <= 4 else 1.25) * predicted, (k, peaks[k], predicted)
    assert peaks[1] > peaks[2] > peaks[4] > peaks[8]
    assert peaks[4] < 0.35 * peaks[1]


def test_same_peak_as_torch_checkpoint():
    model = tiny(n_layer=8, dropout=0.1, n_embd=64, block_size=32)
    x, y = batch(t=32)

    def peak(ckpt):
        model.gradient_checkpointing_enable(ckpt)
        model.zero_grad(set_to_none=True)
        with MemoryTracker(model, timeline=False) as tracker:
            _, loss = model(x, y)
            loss.backward()
        return tracker.peak_bytes

    ours, theirs = peak(checkpoint), peak(None)
    assert abs(ours - theirs) <= 0.02 * theirs


# ----------------------------------------------------------------------------- selective
def test_selective_keeps_matmuls_and_recomputes_the_rest():
    model = tiny(n_layer=1, dropout=0.1, n_embd=64, block_size=32)
    block = model.blocks[0]
    h = torch.randn(2, 32, 64, requires_grad=True)

    class CountMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket in MATMUL_OPS
            return func(*args, **(kwargs or {}))

    counts = {}
    for name, wrap in [("none", lambda f, x: f(x)), ("full", checkpoint), ("selective", selective_checkpoint)]:
        torch.manual_seed(0)
        out = wrap(block, h)
        with CountMM() as c:
            out.backward(torch.ones_like(out))
        counts[name] = c.n
    # full recomputation reruns the 6 matmuls of the block (4 Linear + 2 attention bmm) ...
    assert counts["full"] == counts["none"] + 6
    # ... selective reruns none of them
    assert counts["selective"] == counts["none"]
    live = {}
    for name, wrap in [("none", lambda f, x: f(x)), ("full", checkpoint), ("selective", selective_checkpoint)]:
        with MemoryTracker(block, timeline=False) as tracker:
            out = wrap(block, h)
            live[name] = tracker.current_bytes - tracker.breakdown("end")["parameters"]
        del out
    live_none, live_full, live_sel = live["none"], live["full"], live["selective"]
    assert live_full < live_sel < live_none  # memory kept after forward: in between


# ----------------------------------------------------------------------------- offloading and counting
def test_offload_activations_round_trip_on_cpu():
    model = tiny(dropout=0.2)
    x, y = batch()
    ref = step_grads(model, x, y)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with offload_activations(include_cpu=True) as stats:
        _, loss = model(x, y)
    loss.backward()
    got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert_same(ref, got)
    assert stats.offloaded_tensors > 0 and stats.kept_tensors > 0  # parameters stay put
    torch.manual_seed(123)
    assert stats.offloaded_bytes >= saved_activation_bytes(lambda: model(x, y), exclude=model.parameters())
    with offload_activations() as stats:  # default: CPU tensors are not copied
        model(x, y)
    assert stats.offloaded_tensors == 0


@pytest.mark.cuda
def test_offload_moves_activations_off_the_gpu():
    dev = torch.device("cuda")
    model = tiny(n_layer=4, dropout=0.1, n_embd=256, block_size=128).to(dev)
    x = torch.randint(0, 256, (8, 128), device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    _, loss = model(x, x)
    plain = torch.cuda.memory_allocated() - base
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated()
    with offload_activations() as stats:
        _, loss = model(x, x)
    offloaded = torch.cuda.memory_allocated() - base
    loss.backward()
    assert stats.offloaded_bytes > 0.5 * plain
    assert offloaded < 0.5 * plain


@pytest.mark.cuda
def test_cuda_rng_replay_gradients_equal():
    """On CUDA the dropout masks come from the CUDA generator: it must be replayed too. (Some CUDA
    backward kernels accumulate with atomics, so compare with a tight tolerance, not bit for bit;
    without the replay the error is of the order of the gradients themselves.)"""
    dev = torch.device("cuda")
    model = tiny(dropout=0.3).to(dev)
    x, y = (t.to(dev) for t in batch())
    loss0, g0 = step_grads(model, x, y)
    model.gradient_checkpointing_enable(checkpoint)
    loss1, g1 = step_grads(model, x, y)
    assert torch.equal(loss0, loss1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7)
    model.gradient_checkpointing_enable(lambda f, h: checkpoint(f, h, preserve_rng_state=False))
    _, g2 = step_grads(model, x, y)
    assert any(not torch.allclose(g2[n], g0[n], rtol=1e-3, atol=1e-5) for n in g0)


def test_saved_activation_bytes_is_chapter_00s_and_count_agrees():
    assert saved_activation_bytes is memlab.accounting.saved_activation_bytes
    block = tiny(n_layer=1, dropout=0.1).blocks[0]
    h = torch.randn(2, 16, 32, requires_grad=True)
    n, nbytes = count_saved_tensors(block, h)
    assert nbytes == saved_activation_bytes(block, h) > 0
    assert 10 <= n <= 30


def test_bench_checkpoint_runs(capsys):
    from memlab.bench import checkpoint as bench

    assert bench.main(["--layers", "4", "--width", "32", "--seq", "16", "--batch", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "memlab, 2 segments" in out and "torch, every block" in out and "targets" in out
    assert "memory within 2% of torch.utils.checkpoint (k=2 segments)" in out


# ----------------------------------------------------------------------------- predict, then measure
PEAK_CASES = [(7, 64, 4, 2, 32, 3), (20, 32, 2, 4, 16, 10), (4, 128, 4, 1, 16, 2), (6, 32, 4, 2, 64, 1),
              (9, 48, 4, 2, 48, 3), (6, 64, 4, 2, 32, 6), (5, 32, 2, 4, 64, 2)]


@pytest.mark.parametrize("n,h,a,b,s,k", PEAK_CASES)
def test_sequential_activation_peak_within_2_percent_of_measured(n, h, a, b, s, k):
    from memlab.checkpoint import measure_sequential_activation_peak, sequential_activation_peak

    cfg = TinyGPTConfig(n_layer=n, n_embd=h, n_head=a, block_size=s, dropout=0.1)
    predicted = sequential_activation_peak(cfg, b, s, k)
    measured = measure_sequential_activation_peak(cfg, b, s, k)
    assert abs(predicted / measured - 1) <= 0.02, (predicted, measured)


def test_measured_sequential_peak_falls_with_segments_and_matches_the_formula_terms():
    """k = 1 holds every layer; k = sqrt(n) far less; the difference is (n - ceil(n/k)) layers minus boundaries."""
    from memlab.accounting import activation_bytes_per_layer
    from memlab.checkpoint import measure_sequential_activation_peak

    cfg = TinyGPTConfig(n_layer=9, n_embd=32, n_head=4, block_size=32, dropout=0.1)
    plain = measure_sequential_activation_peak(cfg, 2, 32, 1)
    three = measure_sequential_activation_peak(cfg, 2, 32, 3)
    layer = activation_bytes_per_layer(32, 2, 32, 4, act_bytes=4, mask_bytes=4, layernorm_stats_bytes=4)
    boundary = 4 * 2 * 32 * 32
    assert plain - three == pytest.approx(6 * layer - 2 * boundary, rel=0.01)


def test_measured_sequential_peak_same_for_torch_checkpoint():
    """memlab's checkpoint and torch's non-reentrant one keep the same bytes: the measurement is not memlab's artefact."""
    from memlab.checkpoint import measure_sequential_activation_peak

    cfg = TinyGPTConfig(n_layer=6, n_embd=32, n_head=4, block_size=16, dropout=0.1)
    ours = measure_sequential_activation_peak(cfg, 2, 16, 3)
    torch_ckpt = measure_sequential_activation_peak(
        cfg, 2, 16, 3, checkpoint_fn=lambda f, x: tuc.checkpoint(f, x, use_reentrant=False))
    assert ours == pytest.approx(torch_ckpt, rel=0.02)


def test_sequential_activation_peak_without_dropout_drops_the_masks():
    from memlab.checkpoint import sequential_activation_peak

    on = TinyGPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=0.1)
    off = TinyGPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=0.0)
    assert sequential_activation_peak(off, 2, 16, 2) < sequential_activation_peak(on, 2, 16, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=0), "batch_size=0"),
    (dict(seq_len=17), "seq_len=17 exceeds config.block_size=16"),
    (dict(segments=5), "segments=5"),
    (dict(config="gpt"), "config='gpt'"),
])
def test_sequential_activation_peak_bad_arguments(kwargs, match):
    from memlab.checkpoint import measure_sequential_activation_peak, sequential_activation_peak

    args = dict(config=TinyGPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=0.1),
                batch_size=2, seq_len=16, segments=2) | kwargs
    for fn in (sequential_activation_peak, measure_sequential_activation_peak):
        with pytest.raises(ValueError, match=match):
            fn(**args)


# ----------------------------------------------------------------------------- offloading: weights stay put
def _linear_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_offload_moves_activations_only_not_the_weight_views_addmm_saves():
    # addmm saves weight.t(), a view of the parameter's storage, not the nn.Parameter itself
    model, b = _linear_stack(), 5
    x = torch.randn(b, 8)
    ref_loss = model(x).square().sum()
    ref_loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with offload_activations(include_cpu=True) as stats:
        loss = model(x).square().sum()
    loss.backward()
    # saved activations, one copy per saved tensor: the input (by the first addmm), each ReLU output twice
    # (by the ReLU and by the next addmm); the last output's square saves it once more
    f32 = 4
    want = (b * 8 + 2 * b * 16 + 2 * b * 32 + b * 4) * f32
    assert stats.offloaded_bytes == want, (stats.offloaded_bytes, want)
    assert stats.offloaded_tensors == 6
    assert stats.kept_tensors == 2  # the views of the 2nd and 3rd weights (x needs no grad: the 1st is not saved)
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))


def test_offload_keeps_buffers_and_frozen_weight_views_in_place():
    class ScaledFrozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6).requires_grad_(False)   # a frozen base (LoRA-like)
            self.register_buffer("scale", torch.full((6,), 0.5))

        def forward(self, t):
            return self.lin(t) * self.scale                      # mul saves the buffer (grad w.r.t. t)

    torch.manual_seed(0)
    model = ScaledFrozen()
    x = torch.randn(3, 6, requires_grad=True)
    with offload_activations(include_cpu=True) as stats:
        out = model(x)
    out.sum().backward()
    # the linear saves only weight.t() (no weight grad needed), mul only the buffer: nothing to move
    assert stats.offloaded_bytes == 0 and stats.kept_tensors == 2, stats
    assert torch.equal(x.grad, (0.5 * torch.ones(3, 6)) @ model.lin.weight)
    with offload_activations(include_cpu=True, skip_parameters=False) as stats:
        model(x)
    assert stats.offloaded_bytes == (6 * 6 + 6) * 4 and stats.kept_tensors == 0, stats
