"""Tests for memlab.models: TinyGPT, the tiny Llama, presets and the counting helpers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

try:
    import memlab  # noqa: F401
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "utils"))

from memlab.models import (  # noqa: E402
    PRESETS,
    TinyGPT,
    TinyGPTConfig,
    build_preset,
    count_parameters,
    lm_loss,
    preset_config,
    preset_parameter_count,
    tiny_llama,
    tiny_llama_config,
)

SMALL = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)


def make_model(seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(TinyGPTConfig(**{**SMALL, **kwargs}))


def random_batch(seed: int = 1, batch: int = 3, seq: int = 32, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    return x, y


# ---------------------------------------------------------------------------- TinyGPT


def test_forward_shapes_and_optional_loss():
    model = make_model()
    x, y = random_batch(seq=20)
    logits, loss = model(x)
    assert logits.shape == (3, 20, 256)
    assert loss is None
    logits, loss = model(x, y)
    assert loss.shape == ()
    expected = nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    assert torch.allclose(loss, expected)


def test_default_config_and_module_names():
    model = TinyGPT()
    cfg = model.config
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (256, 128, 4, 4, 128)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 4
    block = model.blocks[0]
    assert block.attn.c_attn.weight.shape == (3 * 128, 128)
    assert block.mlp.c_fc.weight.shape == (4 * 128, 128)
    assert isinstance(block.mlp.gelu, nn.GELU) and block.mlp.gelu.approximate == "tanh"
    for name in ("tok_emb", "pos_emb", "drop", "ln_f", "lm_head"):
        assert hasattr(model, name)
    for name in ("attn_dropout", "resid_dropout", "c_proj"):
        assert hasattr(block.attn, name)
    assert hasattr(block.mlp, "dropout") and hasattr(block, "ln_1") and hasattr(block, "ln_2")


def test_initial_loss_is_close_to_uniform():
    model = make_model()
    x, y = random_batch()
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_init_scheme():
    model = make_model(n_layer=8, n_embd=256, block_size=16)
    c_fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.blocks])
    c_proj = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.blocks])
    assert c_fc.std().item() == pytest.approx(0.02, rel=0.05)
    assert c_proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for block in model.blocks:
        assert torch.count_nonzero(block.attn.c_attn.bias) == 0
        assert torch.count_nonzero(block.mlp.c_fc.bias) == 0


def test_backward_reaches_every_parameter():
    model = make_model()
    x, y = random_batch()
    _, loss = model(x, y)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
    assert model.tok_emb.weight.grad.abs().sum() > 0


def test_weight_tying_shares_storage():
    tied = make_model()
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    untied = make_model(tie_weights=False)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert count_parameters(untied) - count_parameters(tied) == 256 * 64


def test_future_mask_is_a_non_persistent_buffer():
    model = make_model()
    attn = model.blocks[0].attn
    expected = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1)
    assert attn.future_mask.dtype == torch.bool
    assert torch.equal(attn.future_mask, expected)
    assert not any("future_mask" in key for key in model.state_dict())


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_attention_is_causal(attention):
    model = make_model(attention=attention).eval()
    x, _ = random_batch(batch=2, seq=16)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 256  # change only the future of position 9
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(x2)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_manual_and_sdpa_attention_agree():
    manual = make_model(attention="manual")
    sdpa = TinyGPT(TinyGPTConfig(**{**SMALL, "attention": "sdpa"}))
    sdpa.load_state_dict(manual.state_dict())
    x, y = random_batch()
    lm, loss_m = manual(x, y)
    ls, loss_s = sdpa(x, y)
    assert torch.allclose(lm, ls, atol=1e-5)
    loss_m.backward()
    loss_s.backward()
    g_m = manual.blocks[0].attn.c_attn.weight.grad
    g_s = sdpa.blocks[0].attn.c_attn.weight.grad
    assert torch.allclose(g_m, g_s, atol=1e-5)


def test_sequence_longer_than_block_size_raises():
    model = make_model()
    x = torch.zeros(1, 33, dtype=torch.long)
    with pytest.raises(ValueError, match=r"T=33.*block_size=32"):
        model(x)


def _loss_and_grads(model: TinyGPT, x, y, seed: int = 123):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in both runs
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_gives_identical_loss_and_grads(dropout):
    model = make_model(dropout=dropout).train()
    x, y = random_batch()
    loss_ref, grads_ref = _loss_and_grads(model, x, y)
    model.gradient_checkpointing_enable()
    assert model.checkpoint_fn is not None
    loss_ckpt, grads_ckpt = _loss_and_grads(model, x, y)
    assert torch.allclose(loss_ref, loss_ckpt)
    for name in grads_ref:
        assert torch.allclose(grads_ref[name], grads_ckpt[name], atol=1e-6), name
    model.gradient_checkpointing_disable()
    assert model.checkpoint_fn is None


def test_custom_checkpoint_fn_is_called_only_when_training_with_grad():
    model = make_model().train()
    calls = []

    def spy(block, x):
        calls.append(block)
        return block(x)

    model.gradient_checkpointing_enable(spy)
    x, y = random_batch()
    model(x, y)
    assert calls == list(model.blocks)
    calls.clear()
    with torch.no_grad():
        model(x, y)
    model.eval()
    model(x, y)
    assert calls == []


def _saved_activation_bytes(model: TinyGPT, x, y) -> int:
    params = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    storages: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    loss.backward()
    return sum(storages.values())


def test_checkpointing_saves_fewer_activations():
    model = make_model(n_layer=4).train()
    x, y = random_batch()
    full = _saved_activation_bytes(model, x, y)
    model.gradient_checkpointing_enable()
    ckpt = _saved_activation_bytes(model, x, y)
    assert ckpt < full / 2


def _block_saved_bytes(dtype: torch.dtype, dropout: float, device: str) -> tuple[int, dict]:
    """Bytes one training-mode Block saves for backward (each storage once; parameters,
    buffers and LayerNorm's (b, s, 1) mean/rstd left out), and the formula's sizes."""
    b, s, h, a = 2, 64, 64, 4
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, dropout=dropout))
    model = model.to(device=device, dtype=dtype).train()
    block = model.blocks[0]
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and t.shape[-1] != 1:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(b, s, h, dtype=dtype, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(storages.values()), dict(sbh=s * b * h, as2b=a * s * s * b, e=dtype.itemsize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_manual_attention_saves_the_korthikanti_tensors_on_cpu(dtype, dropout):
    saved, n = _block_saved_bytes(dtype, dropout, "cpu")
    e = n["e"]
    if dropout > 0:
        m = e  # CPU dropout keeps its mask in the activation dtype
        expected = n["sbh"] * (16 * e + 2 * m) + n["as2b"] * (2 * e + m)
    else:  # no masks, and the softmax output is also the (identity) dropout output
        expected = n["sbh"] * 16 * e + n["as2b"] * e
    assert saved == expected


@pytest.mark.cuda
def test_manual_attention_matches_korthikanti_formula_on_cuda():
    saved, n = _block_saved_bytes(torch.bfloat16, 0.1, "cuda")
    a, s, h = 4, 64, 64
    assert saved == n["sbh"] * (34 + 5 * a * s / h)  # 16-bit activations, 1-byte masks


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(n_embd=100, n_head=3), r"n_embd=100 is invalid; allowed: a multiple of n_head=3"),
        (dict(n_layer=0), r"TinyGPTConfig.n_layer=0 is invalid; allowed: an int >= 1"),
        (dict(vocab_size=-5), r"vocab_size=-5.*an int >= 1"),
        (dict(block_size=2.5), r"block_size=2.5.*an int >= 1"),
        (dict(dropout=1.0), r"dropout=1.0.*0 <= dropout < 1"),
        (dict(dropout=-0.1), r"dropout=-0.1.*0 <= dropout < 1"),
        (dict(attention="flash"), r"attention='flash'.*'manual', 'sdpa'"),
        (dict(bias="yes"), r"bias='yes'.*True or False"),
    ],
)
def test_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        TinyGPTConfig(**kwargs)


# ------------------------------------------------------------------ tiny Llama, lm_loss


def test_tiny_llama_config_defaults_and_overrides():
    cfg = tiny_llama_config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (256, 128, 344)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 4, 2)
    assert cfg.max_position_embeddings == 256 and cfg.tie_word_embeddings is False
    assert cfg._attn_implementation == "eager"
    assert tiny_llama_config(num_hidden_layers=2).num_hidden_layers == 2


def test_tiny_llama_builds_and_trains():
    torch.manual_seed(0)
    model = tiny_llama(num_hidden_layers=2)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(model.model.layers) == 2
    x, y = random_batch(seq=16)
    loss = lm_loss(model, x, y)
    assert abs(loss.item() - math.log(256)) < 0.3
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_lm_loss_uses_next_token_convention_for_hf_models():
    torch.manual_seed(0)
    model = tiny_llama(num_hidden_layers=1).eval()
    seq, _ = random_batch(batch=2, seq=17)
    with torch.no_grad():
        hf_loss = model(input_ids=seq, labels=seq).loss  # transformers shifts internally
        ours = lm_loss(model, seq[:, :-1], seq[:, 1:])
    assert torch.allclose(hf_loss, ours, atol=1e-5)


def test_lm_loss_on_tinygpt_matches_forward():
    model = make_model()
    x, y = random_batch()
    assert torch.allclose(lm_loss(model, x, y), model(x, y)[1])


# ------------------------------------------------------------------ count_parameters


def test_count_parameters_matches_formula_and_handles_tying():
    model = make_model()
    V, C, T, L = 256, 64, 32, 2
    per_block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C)
    assert count_parameters(model) == V * C + T * C + L * per_block + 2 * C
    # parameters() already skips the tied duplicate; a naive sum over named_parameters
    # with duplicates would count the embedding twice.
    naive = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert naive - count_parameters(model) == V * C


def test_count_parameters_dedups_shared_storage_and_trainable_only():
    lin = nn.Linear(10, 10)
    holder = nn.Module()
    holder.a = lin
    holder.alias = nn.Parameter(lin.weight.data)  # another Parameter, same memory
    holder.frozen = nn.Parameter(torch.zeros(7), requires_grad=False)
    assert count_parameters(holder) == 110 + 7
    assert count_parameters(holder, trainable_only=True) == 110


# ------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", ["gpt2", "qwen2.5-0.5b", "llama-2-7b", "mistral-7b"])
def test_preset_count_matches_meta_built_model(name):
    with torch.device("meta"):
        model = build_preset(name)
    assert count_parameters(model) == preset_parameter_count(name)


@pytest.mark.parametrize(
    "name, overrides",
    [("qwen2.5-7b", dict(num_hidden_layers=2)), ("llama-3-8b", dict(num_hidden_layers=1)),
     ("gpt2", dict(tie_word_embeddings=False, n_layer=1)), ("llama-2-70b", dict(num_hidden_layers=1))],
)
def test_preset_count_with_overrides_matches_meta_built_model(name, overrides):
    with torch.device("meta"):
        model = build_preset(name, **overrides)
    assert count_parameters(model) == preset_parameter_count(name, **overrides)


@pytest.mark.parametrize(
    "name, famous",
    [
        ("gpt2", 124_439_808),
        ("llama-2-7b", 6.74e9),
        ("llama-2-13b", 13.0e9),
        ("llama-2-70b", 68.98e9),
        ("llama-3-8b", 8.03e9),
        ("mistral-7b", 7.24e9),
        ("qwen2.5-0.5b", 0.494e9),
        ("qwen2.5-7b", 7.62e9),
    ],
)
def test_preset_totals_match_published_sizes(name, famous):
    assert abs(preset_parameter_count(name) - famous) / famous < 0.01


def test_gpt2_count_is_exact():
    assert preset_parameter_count("gpt2") == 124_439_808


def test_preset_config_types_and_overrides():
    expected = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
    for name, entry in PRESETS.items():
        assert {"family", "hf_id"} <= set(entry)
        assert type(preset_config(name)).__name__ == expected[entry["family"]]
    cfg = preset_config("llama-2-70b", num_hidden_layers=3)
    assert cfg.num_hidden_layers == 3 and cfg.num_key_value_heads == 8 and cfg.hidden_size == 8192
    assert PRESETS["llama-2-70b"]["num_hidden_layers"] == 80  # overrides do not leak


def test_unknown_preset_lists_the_allowed_names():
    for fn in (preset_config, build_preset, preset_parameter_count):
        with pytest.raises(KeyError) as info:
            fn("llama-9000")
        message = str(info.value)
        assert "llama-9000" in message
        for name in PRESETS:
            assert name in message
        assert isinstance(info.value, ValueError)


def test_count_parameters_on_fake_tensors():
    # fake tensors have no memory: sharing must be decided by identity, not by a (zero) data pointer
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab.models import TinyGPT, TinyGPTConfig, count_parameters

    cfg = TinyGPTConfig(n_layer=2, n_embd=64, n_head=4)
    real = count_parameters(TinyGPT(cfg))
    with FakeTensorMode():
        fake_model = TinyGPT(cfg)
    assert count_parameters(fake_model) == real


def test_decoder_layers_finds_each_family_and_names_the_model_when_none():
    from memlab.models import NoDecoderLayersError, TinyGPT, TinyGPTConfig, decoder_layers, tiny_llama

    gpt = TinyGPT(TinyGPTConfig(n_layer=3, n_embd=16, n_head=2, block_size=8, vocab_size=32))
    assert decoder_layers(gpt) == list(gpt.blocks)
    llama = tiny_llama(num_hidden_layers=2)
    assert decoder_layers(llama) == list(llama.model.layers)
    with pytest.raises(NoDecoderLayersError, match=r"model=Linear has no stack of decoder layers"):
        decoder_layers(nn.Linear(2, 2))
