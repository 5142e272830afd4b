"""memlab.loss against F.cross_entropy on materialised logits, transformers' own causal-LM loss and the
production fused losses: values, gradients, options, what autograd keeps, the allocator's peak, errors."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton on CPU tensors runs in its interpreter, chosen at triton's import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

import memlab.loss as ml  # noqa: E402
from memlab.loss import peers  # noqa: E402


def reference(h, w, t, *, bias=None, ignore_index=-100, softcap=None, z_loss=0.0):
    """The plain loss, written here from F.cross_entropy: all logits, upcast like transformers, then the mean."""
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    z = F.linear(h.reshape(-1, h.shape[-1]), w, bias).to(acc)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    t = t.reshape(-1)
    valid = t != ignore_index
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, reduction="sum")
    if z_loss:
        loss = loss + z_loss * (torch.logsumexp(z, -1) ** 2 * valid).sum()
    return loss / valid.sum().clamp(min=1)


def _inputs(n=37, hdim=16, v=101, dtype=torch.float64, seed=0, bias=False, ignored=5, batch=None):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, n) if batch else (n,)
    h = torch.randn(*shape, hdim, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    w = (torch.randn(v, hdim, generator=g, dtype=torch.float64) / hdim ** 0.25).to(dtype).requires_grad_(True)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True) if bias else None
    t = torch.randint(0, v, shape, generator=g)
    if ignored:
        t.view(-1)[::ignored] = -100
    return h, w, b, t


def _value_and_grads(fn, h, w, b, t, **kw):
    loss = fn(h, w, t, bias=b, **kw)
    wrt = [x for x in (h, w, b) if x is not None]
    return [loss] + list(torch.autograd.grad(loss, wrt))


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-300)).item()


FUSED = {
    "fused": lambda h, w, t, **kw: ml.fused_linear_cross_entropy(h, w, t, chunk_size=8, **kw),
    "fused-1": lambda h, w, t, **kw: ml.fused_linear_cross_entropy(h, w, t, chunk_size=1, **kw),
    "fused-big": lambda h, w, t, **kw: ml.fused_linear_cross_entropy(h, w, t, chunk_size=4096, **kw),
}
OPTIONS = [dict(), dict(softcap=3.0), dict(z_loss=1e-2), dict(softcap=2.0, z_loss=1e-3)]


# ----------------------------------------------------------------------------- values and gradients
@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp64_fused_equals_materialised_cross_entropy(name, opts, bias):
    h, w, b, t = _inputs(bias=bias, batch=2)  # (2, 37, 16), V = 101: no chunk size divides it
    want = _value_and_grads(reference, h, w, b, t, **opts)
    got = _value_and_grads(FUSED[name], h, w, b, t, **opts)
    for what, g_, w_ in zip(["loss", "dh", "dW", "db"], got, want):
        assert g_.dtype == w_.dtype and g_.shape == w_.shape, what
        assert _rel(g_, w_) <= 1e-12, (what, _rel(g_, w_))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1024])
def test_fp64_chunked_equals_materialised_cross_entropy(chunk):
    h, w, b, t = _inputs(bias=True, batch=3)
    want = _value_and_grads(reference, h, w, b, t)
    got = _value_and_grads(lambda *a, **kw: ml.chunked_cross_entropy(*a, chunk_size=chunk, **kw), h, w, b, t)
    for what, g_, w_ in zip(["loss", "dh", "dW", "db"], got, want):
        assert _rel(g_, w_) <= 1e-12, (what, _rel(g_, w_))


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_fp32_fused_close_to_materialised(opts):
    h, w, b, t = _inputs(n=300, hdim=32, v=1000, dtype=torch.float32, bias=True, seed=1)
    want = _value_and_grads(reference, h, w, b, t, **opts)
    got = _value_and_grads(lambda *a, **kw: ml.fused_linear_cross_entropy(*a, chunk_size=64, **kw), h, w, b, t, **opts)
    for what, g_, w_ in zip(["loss", "dh", "dW", "db"], got, want):
        assert g_.dtype == torch.float32
        assert _rel(g_, w_) <= 1e-5, (what, _rel(g_, w_))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_within_twice_the_materialised_loss_error(dtype):
    """bf16/fp16 inputs: the fused loss's error against the fp64 truth is at most twice the plain loss's
    (the same inputs, F.cross_entropy on upcast logits, as transformers computes it) plus a small floor."""
    h, w, b, t = _inputs(n=200, hdim=64, v=777, dtype=dtype, bias=True, seed=2)
    truth = _value_and_grads(reference, *(x.detach().double().requires_grad_(True) for x in (h, w, b)), t)
    plain = _value_and_grads(reference, h, w, b, t)
    got = _value_and_grads(lambda *a, **kw: ml.fused_linear_cross_entropy(*a, chunk_size=48, **kw), h, w, b, t)
    assert got[0].dtype == torch.float32 and [g.dtype for g in got[1:]] == [dtype] * 3
    for what, g_, p_, t_ in zip(["loss", "dh", "dW", "db"], got, plain, truth):
        err, ref_err = _rel(g_, t_), _rel(p_, t_)
        assert err <= 2 * ref_err + 1e-3, (what, err, ref_err)


def test_ignore_index_all_ignored_and_custom_index():
    h, w, b, t = _inputs(ignored=0)
    t_all = torch.full_like(t, -100)
    for fn in (ml.fused_linear_cross_entropy, ml.chunked_cross_entropy):
        loss, dh, dw = _value_and_grads(fn, h, w, None, t_all)
        assert loss.item() == 0.0 and not loss.isnan() and dh.abs().max() == 0 and dw.abs().max() == 0
    # a real class as ignore_index: its tokens drop out, the others count
    t7 = t.clone()
    t7[::3] = 7
    want = _value_and_grads(reference, h, w, None, t7, ignore_index=7)
    got = _value_and_grads(lambda *a, **kw: ml.fused_linear_cross_entropy(*a, chunk_size=5, **kw), h, w, None, t7,
                           ignore_index=7)
    for g_, w_ in zip(got, want):
        assert _rel(g_, w_) <= 1e-12
    assert abs(got[0].item() - reference(h, w, t7).item()) > 1e-3  # ignoring 7 changed the loss


def test_incoming_gradient_scales_and_frozen_inputs_get_none():
    h, w, b, t = _inputs(bias=True)
    loss = ml.fused_linear_cross_entropy(h, w, t, bias=b, chunk_size=6)
    dh, dw, db = torch.autograd.grad(3.5 * loss, (h, w, b))
    rh, rw, rb = torch.autograd.grad(3.5 * reference(h, w, t, bias=b), (h, w, b))
    assert max(_rel(dh, rh), _rel(dw, rw), _rel(db, rb)) <= 1e-12
    w_frozen = w.detach()
    loss = ml.fused_linear_cross_entropy(h, w_frozen, t, chunk_size=6)
    (dh2,) = torch.autograd.grad(loss, (h,))
    assert _rel(dh2, torch.autograd.grad(reference(h, w_frozen, t), (h,))[0]) <= 1e-12


def test_negative_and_zero_incoming_gradients():
    h, w, b, t = _inputs(bias=True, seed=8)
    for scale in (-2.0, 0.0):
        got = torch.autograd.grad(scale * ml.fused_linear_cross_entropy(h, w, t, bias=b, chunk_size=6, softcap=4.0,
                                                                        z_loss=1e-2), (h, w, b))
        want = torch.autograd.grad(scale * reference(h, w, t, bias=b, softcap=4.0, z_loss=1e-2), (h, w, b))
        for g_, w_ in zip(got, want):
            assert not g_.isnan().any() and (g_ - w_).abs().max() <= 1e-12 * max(1.0, w_.abs().max().item())


def test_tied_embedding_gradients_accumulate():
    g = torch.Generator().manual_seed(3)
    emb = torch.nn.Embedding(50, 8).double()
    ids = torch.randint(0, 50, (2, 9), generator=g)
    targets = torch.randint(0, 50, (2, 9), generator=g)

    def step(loss_fn):
        emb.zero_grad()
        hid = torch.tanh(emb(ids))
        loss_fn(hid, emb.weight, targets).backward()
        return emb.weight.grad.clone()

    want = step(reference)
    got = step(lambda h, w, t: ml.fused_linear_cross_entropy(h, w, t, chunk_size=4))
    assert _rel(got, want) <= 1e-12


def test_non_contiguous_hidden_and_3d_shapes():
    h, w, _, t = _inputs(batch=3, n=11)
    ht = h.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)  # same values, other strides
    assert not ht.is_contiguous()
    got = _value_and_grads(lambda *a, **kw: ml.fused_linear_cross_entropy(*a, chunk_size=4, **kw), ht, w, None, t)
    want = _value_and_grads(reference, h, w, None, t)
    assert got[1].shape == (3, 11, 16)
    assert all(_rel(g_, w_) <= 1e-12 for g_, w_ in zip(got, want))


def test_autocast_bf16_matches_the_plain_loss_under_autocast():
    h, w, b, t = _inputs(n=64, hdim=32, v=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _value_and_grads(reference, h, w, None, t)
        got = _value_and_grads(lambda *a, **kw: ml.fused_linear_cross_entropy(*a, chunk_size=16, **kw), h, w, None, t)
    for what, g_, p_ in zip(["loss", "dh", "dW"], got, plain):
        assert _rel(g_, p_) <= 2e-2, (what, _rel(g_, p_))  # bf16 logits both ways; gradients summed in another order


# ----------------------------------------------------------------------------- what autograd keeps
def _saved(fn):
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return shapes


def test_fused_saves_no_tokens_by_vocabulary_tensor_chunked_saves_them_all():
    n, hdim, v = 200, 16, 1009
    h, w, _, t = _inputs(n=n, hdim=hdim, v=v, dtype=torch.float32)
    fused = _saved(lambda: ml.fused_linear_cross_entropy(h, w, t, chunk_size=32))
    plain = _saved(lambda: reference(h, w, t))
    chunked = _saved(lambda: ml.chunked_cross_entropy(h, w, t, chunk_size=32))
    big = lambda shapes: [s for s in shapes if v in s and s != (v, hdim)]  # noqa: E731 - a vocabulary dim, not W
    assert big(fused) == [], fused
    assert sum(s[0] for s in big(plain) if len(s) == 2) >= n  # the log-softmax (n, V)
    assert sum(s[0] for s in big(chunked) if len(s) == 2) >= n  # every chunk's: n rows in all
    from memlab.accounting import saved_activation_bytes

    kept = saved_activation_bytes(lambda hh: ml.fused_linear_cross_entropy(hh, w, t, chunk_size=32), h, exclude=[h, w])
    assert kept <= n * (8 + 4) + 64, kept  # targets (int64) and the fp32 logsumexp: per token, nothing per class
    kept_plain = saved_activation_bytes(lambda hh: reference(hh, w, t), h, exclude=[h, w])
    kept_chunked = saved_activation_bytes(lambda hh: ml.chunked_cross_entropy(hh, w, t, chunk_size=32), h,
                                          exclude=[h, w])
    assert kept_plain >= n * v * 4 and abs(kept_chunked - kept_plain) <= n * 64, (kept_chunked, kept_plain)


def test_allocator_peak_fused_far_below_materialised():
    """The point of the technique, by the allocator's own events: forward + backward of 2048 tokens x 32k
    classes x H=64 in fp32. The plain loss holds several 256 MiB (N, V) tensors at once; the fused one
    a few (256, V) chunks and the head's gradient."""
    from memlab.profiler import allocator_peak

    n, hdim, v = 2048, 64, 32_000
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    w = (torch.randn(v, hdim, generator=g) * 0.1).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g)

    def run(fn):
        def step():
            loss = fn()
            dh, dw = torch.autograd.grad(loss, (h, w))
            del loss, dh, dw
        return allocator_peak(step)[0]

    plain = run(lambda: F.cross_entropy(h @ w.T, t))
    chunked = run(lambda: ml.chunked_cross_entropy(h, w, t, chunk_size=256))
    fused = run(lambda: ml.fused_linear_cross_entropy(h, w, t, chunk_size=256))
    logits = n * v * 4
    assert plain >= 2 * logits, (plain, logits)
    assert logits <= chunked <= plain, (chunked, logits, plain)  # it keeps all (N, V) log-probabilities
    assert fused <= 0.25 * plain, (fused, plain)
    assert fused <= 2 * v * hdim * 4 + 3 * 256 * v * 4 + n * hdim * 8, fused  # dW (+ its fp32 copy), chunks, dh


def test_bf16_head_gradient_accumulates_in_fp32_without_a_parameter_sized_temporary():
    """bf16: the fp32 (V, H) accumulator and, at the end, its bf16 cast are the only head-sized tensors; a
    per-chunk (V, H) product cast to fp32 would add 1.5x the accumulator on top."""
    from memlab.profiler import allocator_peak

    n, v, hdim, chunk = 512, 32_000, 256, 64
    g = torch.Generator().manual_seed(9)
    h = torch.randn(n, hdim, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(v, hdim, generator=g) * 0.05).bfloat16().requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g)

    def step():
        dh, dw = torch.autograd.grad(ml.fused_linear_cross_entropy(h, w, t, chunk_size=chunk), (h, w))
        assert dw.dtype == torch.bfloat16
        del dh, dw

    peak = allocator_peak(step)[0]
    assert peak <= v * hdim * (4 + 2) + chunk * v * (4 + 2) + n * hdim * 8, peak

# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fn", [ml.fused_linear_cross_entropy, ml.chunked_cross_entropy,
                                ml.triton_fused_linear_cross_entropy], ids=lambda f: f.__name__)
def test_bad_arguments_name_the_argument(fn):
    h, w, _, t = _inputs(dtype=torch.float32)
    cases = [
        (dict(hidden=h, weight=w[:, :5], targets=t), "weight.shape"),
        (dict(hidden=h, weight=w.double(), targets=t), "weight.dtype"),
        (dict(hidden=h, weight=w, targets=t.float()), "targets.dtype"),
        (dict(hidden=h, weight=w, targets=t[:-1]), "targets.shape"),
        (dict(hidden=h, weight=w, targets=torch.full_like(t, 101)), "targets=101"),
        (dict(hidden=h, weight=w, targets=t, chunk_size=0), "chunk_size=0"),
        (dict(hidden=h, weight=w, targets=t, bias=torch.zeros(3)), "bias"),
        (dict(hidden=h.int(), weight=w, targets=t), "hidden"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(".", r"\.")):
            fn(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets"), **kwargs)
    if fn is not ml.chunked_cross_entropy:
        with pytest.raises(ValueError, match="softcap=-1"):
            fn(h, w, t, softcap=-1.0)
        with pytest.raises(ValueError, match="z_loss=-0.1"):
            fn(h, w, t, z_loss=-0.1)


# ----------------------------------------------------------------------------- Triton (interpreter on CPU)
def _interpreter_ok() -> bool:
    return "triton" not in sys.modules or ml.triton_interpreted()


needs_triton = pytest.mark.skipif(not ml.triton_available() or not _interpreter_ok(),
                                  reason="triton missing, or imported without TRITON_INTERPRET=1 in this process")


@needs_triton
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_triton_matches_materialised_under_interpreter(opts, bias):
    h, w, b, t = _inputs(n=45, hdim=40, v=101, dtype=torch.float32, bias=bias, seed=4)  # tails in every block dim
    want = _value_and_grads(reference, h, w, b, t, **opts)
    got = _value_and_grads(lambda *a, **kw: ml.triton_fused_linear_cross_entropy(*a, chunk_size=40, **kw),
                           h, w, b, t, **opts)
    for what, g_, w_ in zip(["loss", "dh", "dW", "db"], got, want):
        assert g_.dtype == w_.dtype and g_.shape == w_.shape, what
        assert _rel(g_, w_) <= 1e-5, (what, _rel(g_, w_))


@needs_triton
def test_triton_bf16_frozen_head_and_all_ignored():
    h, w, b, t = _inputs(n=40, hdim=32, v=90, dtype=torch.bfloat16, seed=5)
    truth = _value_and_grads(reference, *(x.detach().double().requires_grad_(True) for x in (h, w)), None, t)
    plain = _value_and_grads(reference, h, w, None, t)
    got = _value_and_grads(ml.triton_fused_linear_cross_entropy, h, w, None, t)
    assert [g.dtype for g in got] == [torch.float32, torch.bfloat16, torch.bfloat16]
    for what, g_, p_, t_ in zip(["loss", "dh", "dW"], got, plain, truth):
        assert _rel(g_, t_) <= 2 * _rel(p_, t_) + 1e-3, what
    (dh,) = torch.autograd.grad(ml.triton_fused_linear_cross_entropy(h, w.detach(), t), (h,))
    assert _rel(dh, got[1]) == 0.0
    loss = ml.triton_fused_linear_cross_entropy(h, w, torch.full_like(t, -100))
    assert loss.item() == 0.0 and torch.autograd.grad(loss, (h,))[0].abs().max() == 0
    with pytest.raises(ValueError, match="float64"):
        ml.triton_fused_linear_cross_entropy(h.double(), w.double(), t)


@needs_triton
def test_triton_kernels_live_at_module_level():
    from memlab.loss import triton_kernels as tk

    assert ml.load_triton_kernels() is tk
    for name in ("lce_fwd", "lce_bwd", "logits_tile", "tanh"):
        fn = getattr(tk, name).fn
        assert fn.__module__ == "memlab.loss.triton_kernels" and fn.__qualname__ == name


# ----------------------------------------------------------------------------- transformers
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
SMALL = dict(vocab_size=307, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _model(kind, dtype=torch.float32, **extra):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed(0)
    if kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(**SMALL, **extra))
    elif kind == "llama-tied":
        m = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True, **extra))
    elif kind == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**SMALL, **extra))
    else:  # Gemma 2: tied head, final_logit_softcapping=30 by default
        m = Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=8, **extra))
    return m.to(dtype).train()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 13), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt the loss skips
    return ids, labels


def _loss_and_grads(model, **kw):
    out = model(**kw)
    return out, [out.loss] + list(torch.autograd.grad(out.loss, [p for p in model.parameters()]))


MODELS = ["llama", "llama-tied", "qwen2", "gemma2"]


@needs_hf
@pytest.mark.parametrize("kind", MODELS)
def test_enable_equals_the_models_own_loss_fp32(kind):
    model = _model(kind)
    if kind in ("gemma2", "llama-tied"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if kind == "gemma2":
        assert model.config.final_logit_softcapping == 30.0
    ids, labels = _batch()
    own, want = _loss_and_grads(model, input_ids=ids, labels=labels)
    assert ml.enable(model, chunk_size=7) is model and ml.is_enabled(model) == dict(chunk_size=7, impl="torch")
    out, got = _loss_and_grads(model, input_ids=ids, labels=labels)
    assert out.logits is None and own.logits.shape == (2, 13, SMALL["vocab_size"])
    assert got[0].dtype == torch.float32
    for i, (g_, w_) in enumerate(zip(got, want)):
        assert _rel(g_, w_) <= 1e-5, (i, _rel(g_, w_))
    ml.disable(model)
    assert "forward" not in model.__dict__ and ml.is_enabled(model) is None
    assert model(input_ids=ids, labels=labels).logits is not None


@needs_hf
@pytest.mark.parametrize("kind", MODELS)
def test_enable_fp64_equals_f_cross_entropy_on_the_models_logits(kind):
    """In fp64 the model's own loss upcasts its logits to fp32 (``logits.float()``); the fused loss stays fp64,
    so it is compared with F.cross_entropy on the model's own fp64 logits, shifted as transformers shifts."""
    model = _model(kind, torch.float64)
    ids, labels = _batch(1)
    logits = model(input_ids=ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    want = [ref] + list(torch.autograd.grad(ref, list(model.parameters())))
    ml.enable(model, chunk_size=5)
    _, got = _loss_and_grads(model, input_ids=ids, labels=labels)
    for i, (g_, w_) in enumerate(zip(got, want)):
        assert g_.dtype == torch.float64 and _rel(g_, w_) <= 1e-12, (i, _rel(g_, w_))


@needs_hf
def test_enable_num_items_in_batch_shift_labels_return_dict_and_eval():
    model = _model("qwen2")
    ids, labels = _batch(2)
    own = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    own_shift = model(input_ids=ids, labels=labels, shift_labels=labels).loss
    ml.enable(model)
    assert _rel(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss, own) <= 1e-6
    assert _rel(model(input_ids=ids, labels=labels, shift_labels=labels).loss, own_shift) <= 1e-6
    tup = model(ids, None, None, None, None, labels, return_dict=False)  # labels positional, a tuple back
    assert isinstance(tup, tuple) and _rel(tup[0], model(input_ids=ids, labels=labels).loss) == 0.0
    model.eval()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and _rel(out.loss, model.__class__.forward(model, input_ids=ids, labels=labels).loss) == 0
    model.train()
    assert model(input_ids=ids).logits is not None  # no labels: the model's own forward


@needs_hf
def test_enabled_model_never_makes_a_tokens_by_vocabulary_tensor():
    """Every tensor any op makes in forward + backward, seen by a dispatch mode: with the fused loss none
    with a vocabulary dimension is larger than one chunk's logits (the model's own makes all 26 x V)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    v = SMALL["vocab_size"]

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == v \
                        and tuple(t.shape) != (SMALL["hidden_size"], v):  # not the head's transpose
                    self.rows = max(self.rows, t.numel() // v)
            return out

    ids, labels = _batch(5)
    model = _model("llama")
    rows = {}
    for name in ("own", "fused"):
        if name == "fused":
            ml.enable(model, chunk_size=4)
        with Largest() as mode:
            model(input_ids=ids, labels=labels).loss.backward()
        rows[name] = mode.rows
    assert rows["own"] >= 26 and rows["fused"] <= 4, rows


@needs_hf
def test_enable_survives_deepcopy_and_keeps_the_signature():
    import copy
    import inspect

    model = ml.enable(_model("llama"), chunk_size=3)
    assert list(inspect.signature(model.forward).parameters)[:2] == ["input_ids", "attention_mask"]
    twin = copy.deepcopy(model)
    ids, labels = _batch(4)
    assert ml.is_enabled(twin) == dict(chunk_size=3, impl="torch")
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)  # the copy computes with its own head, not the original's
    a, b = model(input_ids=ids, labels=labels), twin(input_ids=ids, labels=labels)
    assert a.logits is None and b.logits is None and abs(a.loss.item() - b.loss.item()) > 1e-3
    ml.disable(twin)
    assert ml.is_enabled(twin) is None and ml.is_enabled(model) is not None


@needs_hf
@needs_triton
def test_enable_triton_impl_on_gemma2():
    model = _model("gemma2")
    ids, labels = _batch(3)
    _, want = _loss_and_grads(model, input_ids=ids, labels=labels)
    ml.enable(model, impl="triton")
    _, got = _loss_and_grads(model, input_ids=ids, labels=labels)
    for i, (g_, w_) in enumerate(zip(got, want)):
        assert _rel(g_, w_) <= 1e-5, (i, _rel(g_, w_))


@needs_hf
def test_enable_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="impl='jax'"):
        ml.enable(_model("llama"), impl="jax")
    with pytest.raises(ValueError, match="chunk_size=0"):
        ml.enable(_model("llama"), chunk_size=0)
    with pytest.raises(ValueError, match="model="):
        ml.enable(torch.nn.Linear(2, 2))
    from transformers import CohereConfig, CohereForCausalLM

    cohere = CohereForCausalLM(CohereConfig(**SMALL))  # multiplies its logits by logit_scale: not the plain head
    with pytest.raises(ValueError, match="model_type='cohere'"):
        ml.enable(cohere)
    assert ml.disable(cohere) is cohere  # never enabled: returned as it is


# ----------------------------------------------------------------------------- production peers
def test_torchtune_chunked_loss_equals_ours():
    """torchtune's loss takes the head's output as 8 chunks along the sequence and upcasts each to fp32
    (``logits.float()``, fp64 included): compared in fp32."""
    tt = peers.torchtune_chunked_loss()
    if tt is None:
        pytest.skip("torchtune is not installed (pip install --no-deps torchtune: its loss module is loaded alone)")
    h, w, _, t = _inputs(batch=2, n=24, dtype=torch.float32)
    loss_fn = tt(num_output_chunks=8)
    want = _value_and_grads(lambda hh, ww, tt_, bias=None: loss_fn([F.linear(c, ww) for c in hh.chunk(8, dim=1)], tt_),
                            h, w, None, t)
    for fn in (ml.chunked_cross_entropy, ml.fused_linear_cross_entropy):
        got = _value_and_grads(lambda *a, **kw: fn(*a, chunk_size=3, **kw), h, w, None, t)
        for what, g_, w_ in zip(["loss", "dh", "dW"], got, want):
            assert _rel(g_, w_) <= 1e-5, (fn.__name__, what, _rel(g_, w_))


@pytest.mark.skipif(not _interpreter_ok(), reason="triton imported without TRITON_INTERPRET=1 in this process")
@pytest.mark.parametrize("opts", [o for o in OPTIONS if "softcap" not in o or torch.cuda.is_available()],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_liger_fused_linear_cross_entropy_equals_ours(opts):
    liger = peers.liger_fused_loss()
    if liger is None:
        pytest.skip("liger-kernel is not installed, or cannot run here")
    h, w, _, t = _inputs(n=64, hdim=32, v=500, dtype=torch.float32, seed=6)
    loss_fn = liger(ignore_index=-100, lse_square_scale=opts.get("z_loss", 0.0), softcap=opts.get("softcap"))
    want = _value_and_grads(lambda hh, ww, tt_, bias=None: loss_fn(ww, hh, tt_), h, w, None, t)
    got = _value_and_grads(lambda *a, **kw: ml.fused_linear_cross_entropy(*a, chunk_size=16, **kw), h, w, None, t,
                           **opts)
    for what, g_, w_ in zip(["loss", "dh", "dW"], got, want):
        assert _rel(g_, w_) <= 1e-5, (what, _rel(g_, w_))


@pytest.mark.slow
def test_cut_cross_entropy_torch_compile_equals_ours():
    cce = peers.cce_linear_cross_entropy()
    if cce is None:
        pytest.skip("cut-cross-entropy is not installed")
    h, w, _, t = _inputs(n=64, hdim=32, v=500, dtype=torch.float32, seed=7)
    for softcap in (None, 5.0):
        want = _value_and_grads(lambda hh, ww, tt_, bias=None: cce(hh, ww, tt_, softcap=softcap, impl="torch_compile"),
                                h, w, None, t)
        got = _value_and_grads(lambda *a, **kw: ml.fused_linear_cross_entropy(*a, chunk_size=16, softcap=softcap, **kw),
                               h, w, None, t)
        for what, g_, w_ in zip(["loss", "dh", "dW"], got, want):
            assert _rel(g_, w_) <= 1e-5, (softcap, what, _rel(g_, w_))


# ----------------------------------------------------------------------------- the bench
def test_bench_runs_at_tiny_sizes(capsys):
    from memlab.bench import loss as bench

    rc = bench.main(["--tokens", "64,128", "--vocabs", "500", "--hidden", "16", "--repeat", "1", "--chunk", "32"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["materialized"], ["chunked"], ["fused"])]
    assert len(rows) == 6 and {r[1] for r in rows} == {"64", "128"}, out
    assert "device: CPU" in out or "device:" in out
    assert "targets: none measured" in out  # V = 500: the targets apply at 128k


def test_bench_targets_hold_or_are_missed():
    from memlab.bench import loss as bench

    results = {("materialized", 1024, 128256): (1.0, 1000), ("fused", 1024, 128256): (1.2, 90),
               ("materialized", 4096, 128256): (1.0, 1000), ("fused", 4096, 128256): (1.6, 200),
               ("materialized", 4096, 32000): (1.0, 1000), ("fused", 4096, 32000): (9.0, 900)}
    checks = bench._targets(results)
    assert [(round(r, 3), ok) for _, r, ok in checks] == [(0.09, True), (1.2, True), (0.2, False), (1.6, False)]


def test_bench_rejects_bad_arguments():
    from memlab.bench import loss as bench

    with pytest.raises(SystemExit):
        bench.main(["--tokens", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--only", "nope"])

