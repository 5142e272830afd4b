"""Depth extrapolation for a model given as a callable (issue 38, point 2).

A model factory (a callable taking ``depth``, ``num_layers``, ``n_layers`` or ``num_hidden_layers``) is traced at
three small depths and extrapolated to its default depth (or the one ``config_overrides`` gives it); a callable
whose model is ``AutoModelForCausalLM.from_config(model.config)`` takes the config route; anything else is traced
at full depth. Each extrapolated answer equals the full-depth trace of the same callable to the byte, and the notes
say which route was taken and, for a full trace, why.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memlab.estimate import estimate_training_memory
from memlab.estimate.extrapolate import EXTRAPOLATION_DEPTHS, callable_route
from memlab.estimate.model import depth_parameter, resolve_model
from memlab.models import TinyGPT, TinyGPTConfig

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

STEP = dict(batch_size=2, seq_len=32)
# the allocated figures an extrapolation must give exactly (the reserved figure's growth per layer is modelled)
EXACT = ("peak_bytes", "breakdown", "breakdown_end", "phase_peaks", "phase_breakdowns", "n_params",
         "max_activation_bytes", "host_breakdown", "peak_phase", "largest_layer_params")


def exact(est) -> dict:
    return {k: getattr(est, k) for k in EXACT}


def route_note(est) -> str:
    notes = [n for n in est.notes if n.startswith(("model factory ", "model "))]
    assert len(notes) == 1, est.notes
    return notes[0]


# ---------------------------------------------------------------- the factories

def tiny_gpt(n_layers: int = 8):
    return TinyGPT(TinyGPTConfig(n_layer=n_layers, n_embd=64, n_head=4, vocab_size=256, block_size=64))


class Block(nn.Module):
    """A Llama-like block of memlab's own: RMSNorm, causal SDPA attention, a gated SiLU MLP (``wide`` its width)."""

    def __init__(self, d: int, wide: int, extra: bool = False) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, wide, bias=False), nn.Linear(d, wide, bias=False)
        self.down = nn.Linear(wide, d, bias=False)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.n2(x)
        if self.extra:  # the same parameters, more kept for backward: a layer that runs differently
            h = torch.tanh(h) * h
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaLike(nn.Module):
    def __init__(self, depth: int, widths=None, extra_every: int = 0, vocab: int = 256, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, (widths or (128,))[i % len(widths or (128,))],
                                          extra=bool(extra_every) and i % extra_every == 1) for i in range(depth))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def llama_like(depth: int = 8):
    return LlamaLike(depth)


def llama_like_alternating(depth: int = 8):  # every other layer wider: layers that differ in shape
    return LlamaLike(depth, widths=(128, 192))


def llama_like_odd_layers_differ(depth: int = 8):  # same shapes, every other layer keeps more: not affine
    return LlamaLike(depth, extra_every=2)


def llama_like_ignores_depth(depth: int = 8):  # the parameter builds nothing per layer
    return LlamaLike(8)


def _llama_config(layers: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=layers, vocab_size=512)


def _from_config(cfg, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg, **kw)


def hf_llama(num_hidden_layers: int = 7):
    return _from_config(_llama_config(num_hidden_layers))


def hf_llama_7():  # no depth parameter: the transformers config route
    return _from_config(_llama_config(7))


def hf_llama_7_eager():
    return _from_config(_llama_config(7), attn_implementation="eager")


def hf_llama_7_checkpointed():  # checkpointing turned on by the builder: not from_config's model
    m = _from_config(_llama_config(7))
    m.gradient_checkpointing_enable()
    return m


def hf_llama_7_frozen_embedding():
    m = _from_config(_llama_config(7))
    m.model.embed_tokens.weight.requires_grad_(False)
    return m


def hf_llama_7_replaced_module():  # a module replaced after the build
    m = _from_config(_llama_config(7))
    m.model.layers[5].mlp.down_proj = nn.Linear(128, 64, bias=True)
    return m


# ---------------------------------------------------------------- extrapolated == the full trace, to the byte

@pytest.mark.parametrize("factory,device,dtype", [
    (tiny_gpt, "cpu", "bf16-mixed"),
    (llama_like, "cuda", "bf16-mixed"),
    (llama_like, "cpu", "fp32"),
    (hf_llama, "cuda", "bf16-mixed"),
    (hf_llama, "cpu", "bf16-pure"),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_model_factory_extrapolated_equals_its_full_trace(factory, device, dtype):
    est = estimate_training_memory(factory, device=device, dtype=dtype, **STEP)
    full = estimate_training_memory(factory, device=device, dtype=dtype, extrapolate=False, **STEP)
    assert est.extrapolated_from == EXTRAPOLATION_DEPTHS and not full.extrapolated_from
    assert exact(est) == exact(full)
    param = depth_parameter(factory)[0]
    n = depth_parameter(factory)[1]
    note = route_note(est)
    assert note.startswith(f"model factory {factory.__name__}({param}=...)") and f"extrapolated to {param}={n}" in note
    assert "extrapolate=False" in route_note(full)


def test_the_depth_config_overrides_gives_is_the_one_extrapolated_to():
    est = estimate_training_memory(llama_like, config_overrides={"depth": 11}, device="cpu", **STEP)
    full = estimate_training_memory(lambda: LlamaLike(11), device="cpu", **STEP)
    default = estimate_training_memory(llama_like, device="cpu", **STEP)
    assert exact(est) == exact(full) and est.n_params > default.n_params
    assert "extrapolated to depth=11 (config_overrides {'depth': 11})" in route_note(est)
    assert "takes no depth parameter" in route_note(full)


def test_a_factory_with_adapters_and_checkpointing_extrapolates_exactly():
    kw = dict(device="cuda", adapter="lora", lora_r=4, checkpointing=True, **STEP)
    est = estimate_training_memory(hf_llama, **kw)
    full = estimate_training_memory(hf_llama, extrapolate=False, **kw)
    assert est.extrapolated_from and exact(est) == exact(full)


@pytest.mark.parametrize("build", [hf_llama_7, hf_llama_7_eager])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_callable_building_from_config_takes_the_config_route(build, device):
    est = estimate_training_memory(build, device=device, **STEP)
    full = estimate_training_memory(build, device=device, extrapolate=False, **STEP)
    assert est.extrapolated_from and exact(est) == exact(full)
    note = route_note(est)
    assert "estimated by the config route" in note and "num_hidden_layers=7" in note
    # the same answer as the config itself
    cfg = build().config
    assert exact(estimate_training_memory(cfg, device=device, **STEP)) == exact(est)


@pytest.mark.parametrize("build,why", [
    (hf_llama_7_checkpointed, "attributes of 'model' (LlamaModel) differ"),
    (hf_llama_7_frozen_embedding, "parameters or buffers of 'model.embed_tokens' (Embedding) differ"),
    (hf_llama_7_replaced_module, "parameters or buffers of 'model.layers.5.mlp.down_proj' (Linear) differ"),
])
def test_a_callable_whose_model_is_not_from_configs_is_traced_at_full_depth(build, why):
    est = estimate_training_memory(build, device="cpu", **STEP)
    assert not est.extrapolated_from
    note = route_note(est)
    assert "every layer traced" in note and why in note
    full = estimate_training_memory(build, device="cpu", extrapolate=False, **STEP)
    assert exact(est) == exact(full)


@pytest.mark.parametrize("factory,why", [
    (llama_like_alternating, "its modules at depth=8 are not those at depth=3 plus 5 times one layer's"),
    (llama_like_ignores_depth, "depth=4 does not build the modules of depth=3 and one layer more"),
    (llama_like_odd_layers_differ, "are not affine in the layer count"),
])
def test_a_factory_whose_layers_differ_is_traced_at_full_depth(factory, why):
    est = estimate_training_memory(factory, device="cpu", **STEP)
    full = estimate_training_memory(factory, device="cpu", extrapolate=False, **STEP)
    assert not est.extrapolated_from and exact(est) == exact(full)
    assert why in route_note(est)


def test_the_odd_layers_factory_would_be_wrong_if_extrapolated():
    """The check at a third depth is what keeps llama_like_odd_layers_differ at full depth: its traces at 3 and 4
    layers, extended linearly, miss the full trace (so the test above can fail)."""
    from memlab.estimate import make_step
    from memlab.estimate.extrapolate import affine_estimate
    from memlab.estimate.trace import trace_step

    spec = resolve_model(llama_like_odd_layers_differ, None)
    step = make_step(device="cpu", **STEP)
    a, b = (trace_step(spec.at_depth(d), step) for d in EXTRAPOLATION_DEPTHS)
    guess = affine_estimate(a, b, *EXTRAPOLATION_DEPTHS, 8)
    assert guess is not None and guess.peak_bytes != trace_step(spec, step).peak_bytes


def test_a_small_or_plain_callable_is_traced_at_full_depth_and_says_why():
    small = estimate_training_memory(functools.partial(llama_like, depth=4), device="cpu", **STEP)
    assert not small.extrapolated_from and "4 layers, fewer than the 6" in route_note(small)
    plain = estimate_training_memory(lambda: tiny_gpt(8), device="cpu", **STEP)
    assert "it takes no depth parameter" in route_note(plain) and "TinyGPT" in route_note(plain)
    assert exact(plain) == exact(estimate_training_memory(tiny_gpt, device="cpu", **STEP))


def test_depth_parameter_and_the_factorys_errors():
    assert depth_parameter(llama_like) == ("depth", 8)
    assert depth_parameter(functools.partial(tiny_gpt, n_layers=12)) == ("n_layers", 12)
    assert depth_parameter(lambda: None) is None
    assert depth_parameter(lambda depth: None)[0] == "depth"
    with pytest.raises(ValueError, match=r"takes depth, num_layers: which of them sets the depth"):
        resolve_model(lambda depth=2, num_layers=3: None, None)
    with pytest.raises(ValueError, match=r"takes 'depth' without a default.*config_overrides=\{'depth': N\}"):
        resolve_model(lambda depth: None, None)
    with pytest.raises(ValueError, match=r"config_overrides key 'n_embd' is invalid for the model factory"):
        estimate_training_memory(llama_like, config_overrides={"n_embd": 8}, device="cpu", **STEP)
    for bad in (0, True, "8", 2000):
        with pytest.raises(ValueError, match=r"config_overrides\['depth'\]=.* is invalid; allowed"):
            estimate_training_memory(llama_like, config_overrides={"depth": bad}, device="cpu", **STEP)
    with pytest.raises(ValueError, match=r"default depth=0 is invalid"):
        resolve_model(lambda depth=0: None, None)
    with pytest.raises(ValueError, match=r"config_overrides=\{'x': 1\} is invalid for model=<lambda>"):
        estimate_training_memory(lambda: tiny_gpt(2), config_overrides={"x": 1}, device="cpu", **STEP)
    # a factory given its depth by config_overrides where it has no default
    spec = resolve_model(lambda depth: LlamaLike(depth), {"depth": 9})
    assert spec.layers() == ("depth", 9) and spec.at_depth(3).layers() == ("depth", 3)


def test_a_default_that_is_no_depth_is_traced_as_it_is():
    def build(num_layers=None):
        return LlamaLike(num_layers or 7)

    spec = resolve_model(build, None)
    assert spec.factory is None and spec.layers() is None
    from memlab.estimate import make_step

    _, why = callable_route(spec, make_step(device="cpu", **STEP))
    assert "its num_layers=None is not a depth" in why
    est = estimate_training_memory(build, config_overrides={"num_layers": 7}, device="cpu", **STEP)
    assert est.extrapolated_from and exact(est) == exact(estimate_training_memory(build, device="cpu", **STEP))


def test_a_factory_over_the_traced_layer_bound_is_refused_without_extrapolation():
    with pytest.raises(ValueError, match=r"extrapolate=False with depth=200"):
        estimate_training_memory(llama_like, config_overrides={"depth": 200}, extrapolate=False, device="cpu", **STEP)


def test_a_factorys_untraceable_line_is_named():
    from memlab.estimate.model import UntraceableBuilder

    def broken(depth: int = 8):
        m = LlamaLike(depth)
        m.emb.weight.data[0, 0].item()  # a value read from a fake tensor
        return m

    with pytest.raises(UntraceableBuilder, match=r"broken\(\) cannot be traced on fake tensors: .* line \d+, "
                                                 r"`m.emb.weight.data\[0, 0\].item\(\)"):
        estimate_training_memory(broken, device="cpu", **STEP)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_a_factory_under_fsdp2_extrapolates_exactly():
    def tiny(n_layers: int = 7):
        return TinyGPT(TinyGPTConfig(n_layer=n_layers, n_embd=32, n_head=2, vocab_size=64, block_size=32))

    kw = dict(batch_size=1, seq_len=16, device="cpu", world_size=2, zero_stage=3)
    est = estimate_training_memory(tiny, **kw)
    full = estimate_training_memory(tiny, extrapolate=False, **kw)
    assert est.extrapolated_from and not full.extrapolated_from and exact(est) == exact(full)
    assert any("FSDP2 per-rank trace: the extrapolation" in n for n in est.notes)
    assert "model factory tiny(n_layers=...)" in route_note(est)


def test_bench_estimate_callable_runs_and_its_routes_agree(capsys):
    from memlab.bench import estimate_callable

    assert estimate_callable.main(["--layers", "6", "--hidden", "64", "--intermediate", "128", "--vocab", "256",
                                   "--seq-len", "16", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for route in ("factory", "config"):
        assert (f"TARGET MET: {route} route: extrapolated from (3, 4), its peak and every phase's breakdown equal to "
                f"the full trace's") in out
    assert "load average (1, 5, 15 min)" in out
    with pytest.raises(SystemExit):
        estimate_callable.main(["--layers", "4"])
    assert "--layers=4 is invalid" in capsys.readouterr().err


def test_an_fp32_gqa_callable_for_cuda_equals_its_full_trace():
    # attention_plan reads the grouped KV heads from the model's own config where the spec (a callable's) has none:
    # the full trace then models the math kernel CUDA runs for fp32 GQA, as the config route does
    kw = dict(device="cuda", dtype="fp32", **STEP)
    est = estimate_training_memory(hf_llama_7, **kw)
    assert est.extrapolated_from and exact(est) == exact(estimate_training_memory(hf_llama_7, extrapolate=False, **kw))
