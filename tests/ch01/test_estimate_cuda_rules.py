"""memlab.estimate.cuda_rules: a CPU trace answers for a CUDA card (dropout's mask, CUDA autocast's op lists), op by op."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memlab.estimate import cuda_rules as R
from memlab import estimate as E
from memlab.estimate.recipes import cublas_workspace


def _saved_dtypes(t: torch.Tensor) -> set[torch.dtype]:
    fn, out = t.grad_fn, set()
    for name in dir(fn):
        if name.startswith("_saved_"):
            v = getattr(fn, name)
            if isinstance(v, torch.Tensor):
                out.add(v.dtype)
    return out


def test_dropout_keeps_a_bool_mask_as_cuda_does():
    x = torch.randn(64, 32, requires_grad=True)
    cpu = F.dropout(x, 0.1, training=True)
    assert _saved_dtypes(cpu) == {torch.float32}  # CPU: the noise tensor in the input's dtype
    with R.cuda_semantics() as mode:
        cuda = F.dropout(x, 0.1, training=True)
        same = F.dropout(x, 0.1, training=False)
    assert _saved_dtypes(cuda) == {torch.bool}  # native_dropout: 1 byte per element
    assert same is x and mode.counts["dropout"] == 1
    cuda.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("op", [lambda t: F.layer_norm(t, (32,)), lambda t: F.softmax(t, -1),
                                lambda t: F.log_softmax(t, -1), lambda t: t.softmax(-1), lambda t: t.sum(),
                                lambda t: torch.pow(t, 3), lambda t: t ** 2, lambda t: torch.exp(t),
                                lambda t: torch.rsqrt(t.abs() + 1), lambda t: F.group_norm(t.view(4, 8, 4), 2)])
def test_cuda_float32_list_under_autocast(op):
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x.to(torch.bfloat16)
        assert op(h).dtype == torch.bfloat16  # CPU autocast runs it in 16 bits
        with R.cuda_semantics() as mode:
            out = op(h)
    assert out.dtype == torch.float32 and mode.counts["fp32"] == 1  # CUDA autocast: fp32
    if out.grad_fn is not None and _saved_dtypes(out):
        assert torch.bfloat16 not in _saved_dtypes(out)  # what backward keeps is fp32 too


def test_rules_leave_fp32_and_explicit_dtype_alone():
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), R.cuda_semantics() as mode:
        assert F.softmax(x, -1).dtype == torch.float32
        assert x.to(torch.bfloat16).sum(dtype=torch.bfloat16).dtype == torch.bfloat16
    assert mode.counts["fp32"] == 0
    with R.cuda_semantics() as mode:  # no autocast: nothing changes
        assert F.layer_norm(x.to(torch.bfloat16), (32,)).dtype == torch.bfloat16
    assert mode.counts["fp32"] == 0


def test_cuda_lower_precision_list():
    a, v = torch.randn(8, 4), torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mv(a, v).dtype == torch.float32  # CPU autocast leaves mv in fp32
        with R.cuda_semantics():
            assert torch.mv(a, v).dtype == torch.bfloat16  # CUDA's list lowers it


def test_gpt2_estimate_states_the_rules():
    est = E.estimate_training_memory("gpt2", config_overrides=dict(n_layer=1, n_embd=64, n_head=2),
                                     batch_size=2, seq_len=32, dtype="bf16", extrapolate=False)
    rules = [n for n in est.notes if n.startswith("CUDA rule")]
    assert any("1-byte bool mask" in n for n in rules) and any("float32 list" in n for n in rules)
    cpu = E.estimate_training_memory("gpt2", config_overrides=dict(n_layer=1, n_embd=64, n_head=2),
                                     batch_size=2, seq_len=32, dtype="bf16", extrapolate=False, device="cpu")
    assert not any(n.startswith("CUDA rule") for n in cpu.notes)


def test_llama_h100_traces_still_agree():
    # results/h100/estimator_cuda_trace.json: llama-2-7b, batch 1 x 2048, bf16, traced with CUDA fake tensors
    # on an H100: 134,768,347,788 bytes. The CPU trace with the CUDA rules is within 1 KiB of it.
    from memlab.testing import assert_peak

    est = assert_peak("llama-2-7b", batch_size=1, seq_len=2048, dtype="bf16", at_most=134_768_347_788 + 1024)
    assert est.peak_bytes >= 134_768_347_788 - 1024


@pytest.mark.cuda
def test_real_cuda_fake_trace_agrees_with_the_modelled_one(monkeypatch):
    kw = dict(config_overrides=dict(n_layer=2), batch_size=4, seq_len=256, dtype="bf16", extrapolate=False)
    real = E.estimate_training_memory("gpt2", **kw)
    assert real.traced_on.startswith("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    modelled = E.estimate_training_memory("gpt2", **kw)
    assert modelled.traced_on == "cpu" and any(n.startswith("CUDA rule") for n in modelled.notes)
    assert abs(modelled.peak_bytes - real.peak_bytes) <= max(64 * 1024, real.peak_bytes // 1000)


def _saved(call) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What autograd keeps for backward while ``call()`` runs: (shape, dtype) of every tensor packed, sorted."""
    kept: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t):
        kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    out.float().sum().backward()  # the call's graph runs backward as it is
    return sorted(kept, key=repr)


@st.composite
def sdpa_calls(draw):
    b, h, s, d = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 40)), draw(st.sampled_from([8, 16, 64]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    mask = draw(st.sampled_from([None, "bool", "float"]))
    return dict(b=b, h=h, s=s, d=d, dtype=dtype, mask=mask, causal=mask is None and draw(st.booleans()),
                p=draw(st.floats(0.01, 0.9)), positional=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.3])))


def _sdpa(c, p, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(c["b"], c["h"], c["s"], c["d"], generator=g).to(c["dtype"]).requires_grad_()
               for _ in range(3))
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(c["s"], c["s"], generator=g) > 0.3
        mask[:, 0] = True  # no fully masked row
    elif c["mask"] == "float":
        mask = torch.randn(c["s"], c["s"], generator=g).to(c["dtype"])
    if c["positional"]:
        return lambda: F.scaled_dot_product_attention(q, k, v, mask, p, c["causal"], scale=c["scale"])
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=c["causal"],
                                                  scale=c["scale"])


@settings(max_examples=60, deadline=None)
@given(sdpa_calls())
def test_attention_dropout_is_kept_as_a_fused_cuda_kernel_keeps_it(c):
    # rule 5: CUDA's flash / memory-efficient kernels draw the dropout mask inside the kernel and keep what they
    # keep without dropout; on a CPU the call falls back to the math kernel (the s x s probabilities and the mask)
    with R.cuda_semantics() as mode:
        mode.fused_attention = True
        fused = _saved(_sdpa(c, c["p"]))
    assert mode.counts["attention_dropout"] == 1
    assert fused == _saved(_sdpa(c, 0.0))  # the same call without dropout, outside the mode
    plain = _saved(_sdpa(c, c["p"]))
    with R.cuda_semantics() as mode:  # the CUDA kernel is the math one (fp32 with grouped KV heads): no rule
        assert _saved(_sdpa(c, c["p"])) == plain
    assert mode.counts["attention_dropout"] == 0
    with R.cuda_semantics() as mode:
        mode.fused_attention = True
        _saved(_sdpa(c, 0.0))
    assert mode.counts["attention_dropout"] == 0  # nothing to reroute: not counted


def test_math_kernel_keeps_the_square_and_the_rule_does_not():
    c = dict(b=1, h=2, s=32, d=16, dtype=torch.bfloat16, mask=None, causal=True, p=0.1, positional=False, scale=None)
    square = (1, 2, 32, 32)
    assert any(shape == square for shape, _ in _saved(_sdpa(c, 0.1)))  # CPU: math kernel, probabilities kept
    with R.cuda_semantics() as mode:
        mode.fused_attention = True
        assert not any(shape == square for shape, _ in _saved(_sdpa(c, 0.1)))


def test_gpt2_attention_dropout_agrees_with_the_h200_cuda_trace():
    # results/h200/2026-11-28 (test_real_cuda_fake_trace_agrees_with_the_modelled_one): gpt2 at 2 layers, bf16,
    # batch 4 x 256, traced with CUDA fake tensors on an H200: 1,506,729,584 bytes; the CPU trace with the CUDA
    # rules then gave 1,591,562,872 (+5.6%: attention dropout 0.1 sent SDPA to the math kernel)
    kw = dict(config_overrides=dict(n_layer=2), batch_size=4, seq_len=256, dtype="bf16", extrapolate=False)
    est = E.estimate_training_memory("gpt2", **kw)
    assert est.traced_on == "cpu"
    assert abs(est.peak_bytes - 1_506_729_584) <= 64 * 1024
    assert any(n.startswith("CUDA rule: attention dropout runs inside CUDA's fused SDPA kernel (no mask, no s x s "
                            "matrix kept), traced with the CPU flash kernel at dropout_p=0 (2 calls") for n in est.notes)
    assert not any("math kernel" in n for n in est.notes)
    fp32 = E.estimate_training_memory("gpt2", config_overrides=dict(n_layer=1, n_embd=64, n_head=2), batch_size=2,
                                      seq_len=32, dtype="fp32", extrapolate=False)
    assert any(n.startswith("CUDA rule: attention dropout") for n in fp32.notes)  # the memory-efficient kernel too


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    # dropout 0.1 (hidden and attention probabilities) and LayerNorm: both CUDA rules fire in every block
    return BertForSequenceClassification(BertConfig(num_labels=2, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=128, vocab_size=128,
                                                    attn_implementation="eager"))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_checkpointing_recomputes_under_the_cuda_rules(dtype):
    # the checkpoint's recompute in backward must keep the forward's tensors (bool masks, fp32 norms): before
    # the fix it ran without the rules and torch.utils.checkpoint raised CheckpointError on the mismatch
    from memlab.estimate.validate import _bert_cls_step

    from memlab.testing import assert_peak

    kw = dict(batch_size=8, seq_len=256, dtype=dtype, device="cuda", step=_bert_cls_step, extrapolate=False)
    plain = E.estimate_training_memory(_tiny_bert, **kw)
    ck = assert_peak(_tiny_bert, checkpointing=True, at_most=plain.peak_bytes - 1, **kw)  # the step given as step=
    for est in (plain, ck):
        assert any(n.startswith("CUDA rule: dropout keeps a 1-byte bool mask") for n in est.notes)
        assert any(n.startswith("CUDA rule: autocast's CUDA float32 list") for n in est.notes)
    assert ck.phase_peaks["forward"] < plain.phase_peaks["forward"]


def test_cublas_workspace_follows_the_card(monkeypatch):
    # PyTorch's default (aten/src/ATen/cuda/CublasHandlePool.cpp): 32 MiB from compute capability 9.0,
    # :4096:2:16:8 = 4096 KiB x 2 + 16 KiB x 8 before it; CUBLAS_WORKSPACE_CONFIG overrides both
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace("h100")[0] == cublas_workspace("rtx5090")[0] == 32 * 2**20
    assert cublas_workspace("a100")[0] == cublas_workspace("l40s")[0] == 8_519_680
    assert cublas_workspace(None) == (32 * 2**20, "no card given: Hopper's")
    assert cublas_workspace("h100", env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})[0] == 32 * 2**20
    assert cublas_workspace("h100", env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"})[0] == 128 * 2**10
    assert cublas_workspace(None, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"})[0] == 8_519_680
    assert cublas_workspace("a100", env={"CUBLAS_WORKSPACE_CONFIG": "junk"})[0] == 8_519_680  # torch: default
    with pytest.raises(ValueError, match="gpu='tpu' is invalid; allowed: a card of memlab.core.gpus"):
        cublas_workspace("tpu")


def test_estimate_adds_the_cards_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    kw = dict(batch_size=1, seq_len=16, device="cuda", extrapolate=False)
    none, h100, a100 = (E.estimate_training_memory("gpt2", gpu=g, **kw) for g in (None, "h100", "a100"))
    assert none.allocated_bytes == h100.allocated_bytes
    assert none.allocated_bytes - a100.allocated_bytes == 2 * (32 * 2**20 - 8_519_680)
    assert any("no card given" in n for n in none.notes) and not any("no card given" in n for n in a100.notes)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    env = E.estimate_training_memory("gpt2", gpu="h100", **kw)
    assert env.allocated_bytes == a100.allocated_bytes
    with pytest.raises(ValueError, match="gpu='tpu' is invalid"):
        E.estimate_training_memory("gpt2", gpu="tpu", **kw)


# ---------------------------------------------------------------- rule 4: NF4 linears as bitsandbytes allocates
def _nf4_layer(n: int = 1024):
    from memlab.quant import Linear4bit

    return Linear4bit.from_linear(torch.nn.Linear(n, n, bias=False), torch.bfloat16, 64, True)


def _forward_rise(rule: bool) -> int:
    """The bytes a fake 1024 x 1024 NF4 layer adds at its forward's peak, above what is alive before it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab.profiler import MemoryTracker

    with FakeTensorMode():
        layer = _nf4_layer()
        x = torch.randn(8, 1024, dtype=torch.bfloat16, requires_grad=True)
        tracker = MemoryTracker()
        with tracker, (R.cuda_semantics() if rule else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
            start = tracker.current_bytes
            layer(x)
    return tracker.peak_bytes - start


def test_nf4_rule_charges_only_the_dequantized_weight():
    # bitsandbytes' dequantize_4bit on CUDA: the fp32 absmax of the 16,384 blocks (64 KiB) alive while the kernel
    # writes the bf16 weight (2 MiB); then F.linear's 16 KiB output beside the weight
    assert _forward_rise(True) == 2 * 2**20 + 64 * 2**10
    # memlab's own dequantize on a CPU trace, its torch path, works piece by piece (issue 42): the bf16 output
    # (2 MiB), the fp32 absmax (64 KiB) and the piece buffers, int32 indices and fp32 values of 128 KiB of packed
    # bytes (1.5 MiB, the default NF4_DEQUANT_BUFFER_BYTES); the table lookup before it held the whole weight's int32
    # indices and fp32 values (2 B + 4 B a weight, >= 6 MiB in all), so only the piece buffers stay above
    # bitsandbytes' kernel. Its C++ path (the CPU default where a compiler builds it) writes the output alone, as
    # bitsandbytes' kernel does
    from memlab.quant.blockwise import NF4_DEQUANT_BUFFER_BYTES, load_nf4_kernel

    assert NF4_DEQUANT_BUFFER_BYTES == 3 << 19
    try:
        load_nf4_kernel("torch")
        assert _forward_rise(False) == 2 * 2**20 + 64 * 2**10 + (3 << 19)
        assert _forward_rise(False) > _forward_rise(True)
        if load_nf4_kernel("auto").startswith("C++"):
            assert _forward_rise(False) == _forward_rise(True)
    finally:
        load_nf4_kernel()


def test_nf4_rule_computes_what_the_layer_computes():
    layer = _nf4_layer(128)
    x = torch.randn(4, 128, requires_grad=True)
    ref = layer(x)
    ref.sum().backward()
    gref, x.grad = x.grad, None
    with R.cuda_semantics() as mode:
        out = layer(x)
    out.sum().backward()
    assert mode.counts["nf4"] == 1 and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, gref)


@pytest.mark.parametrize("version, kept", [("0.43.1", True), ("0.41.0", True), ("0.43.2", False), ("0.45.0", False)])
def test_nf4_rule_keeps_the_input_by_bitsandbytes_version(version, kept):
    import weakref

    layer = _nf4_layer(128)
    with R.cuda_semantics(bnb_version=version) as mode:
        leaf = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
        x = leaf * 2.0  # a layer's input: a non-leaf (autograd's own graph holds a leaf)
        ref = weakref.ref(x)
        out = layer(x)
        del x
    assert (ref() is not None) == kept  # MatMul4Bit held its input on ctx before 0.43.2
    out.float().sum().backward()
    assert ref() is None  # freed by backward either way
    note = [n for n in R.rule_notes(mode) if "NF4" in n]
    assert len(note) == 1 and f"bitsandbytes {version} (given)" in note[0]
    assert ("kept for backward" in note[0]) == kept


def test_nf4_rule_follows_the_installed_bitsandbytes():
    version, source = R.bnb_version()
    mode = R.cuda_semantics()
    assert (mode.bnb_version, mode.bnb_source) == (version, source)
    from memlab.quant import Linear4bit

    before = Linear4bit.forward
    with mode:
        assert Linear4bit.forward is not before
    assert Linear4bit.forward is before  # the rule is undone on leaving
    with pytest.raises(ValueError, match="bnb_version='latest' is invalid; allowed: a bitsandbytes release"):
        R.cuda_semantics(bnb_version="latest")


def test_qlora_estimate_states_the_nf4_rule():
    from memlab.models import tiny_llama_config

    cfg = lambda: tiny_llama_config(hidden_size=64, intermediate_size=160, num_hidden_layers=2,  # noqa: E731
                                    vocab_size=512, max_position_embeddings=64)
    est = E.estimate_training_memory(cfg(), batch_size=1, seq_len=32, device="cuda", adapter="qlora",
                                     extrapolate=False)
    assert any("NF4 linears allocate what bitsandbytes' CUDA kernels allocate" in n for n in est.notes)
    cpu = E.estimate_training_memory(cfg(), batch_size=1, seq_len=32, device="cpu", adapter="qlora",
                                     extrapolate=False)
    assert not any("allocate what bitsandbytes" in n for n in cpu.notes)
