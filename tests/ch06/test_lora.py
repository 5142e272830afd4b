"""memlab.quant.lora against peft: initialisation under the same seed, outputs and gradients, merge / unmerge,
LoRA on a Linear4bit base (QLoRA) against peft on bitsandbytes.nn.Linear4bit, and bad arguments."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from memlab.quant import lora as L  # noqa: E402
from memlab import quant as Q  # noqa: E402


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(32, 32)
        self.v_proj = nn.Linear(32, 16, bias=False)
        self.o_proj = nn.Linear(16, 8)

    def forward(self, x):
        return self.o_proj(torch.relu(self.q_proj(x))[:, :16] + self.v_proj(x))


def _pair(r=4, alpha=8, targets=("q_proj", "v_proj")):
    torch.manual_seed(0)
    base = Tiny()
    pm, mm = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(1)
    pm = peft.get_peft_model(pm, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0))
    torch.manual_seed(1)
    L.add_lora(mm, r=r, alpha=alpha, target_modules=targets)
    return pm, mm


def _peft_layer(pm, name):
    return getattr(pm.base_model.model, name)


def test_initialisation_equal_to_peft_under_the_same_seed():
    pm, mm = _pair()
    for name in ("q_proj", "v_proj"):
        p, m = _peft_layer(pm, name), getattr(mm, name)
        assert torch.equal(p.lora_A["default"].weight, m.lora_A.weight)
        assert torch.equal(p.lora_B["default"].weight, m.lora_B.weight)
        assert bool((m.lora_B.weight == 0).all())
        assert m.scaling == p.scaling["default"] == 2.0
    assert L.count_trainable(mm)[0] == sum(p.numel() for p in pm.parameters() if p.requires_grad) == 4 * (64 + 48)


def test_outputs_and_gradients_equal_to_peft():
    pm, mm = _pair()
    with torch.no_grad():
        for name in ("q_proj", "v_proj"):
            w = torch.randn_like(getattr(mm, name).lora_B.weight)
            _peft_layer(pm, name).lora_B["default"].weight.copy_(w)
            getattr(mm, name).lora_B.weight.copy_(w)
    x = torch.randn(5, 32)
    yp, ym = pm(x), mm(x)
    assert torch.equal(yp, ym)
    yp.square().sum().backward()
    ym.square().sum().backward()
    for name in ("q_proj", "v_proj"):
        p, m = _peft_layer(pm, name), getattr(mm, name)
        assert torch.equal(p.lora_A["default"].weight.grad, m.lora_A.weight.grad)
        assert torch.equal(p.lora_B["default"].weight.grad, m.lora_B.weight.grad)
        assert m.base.weight.grad is None
    assert mm.o_proj.weight.grad is None


def test_merge_and_unmerge_equal_to_peft():
    pm, mm = _pair()
    with torch.no_grad():
        for name in ("q_proj", "v_proj"):
            w = torch.randn_like(getattr(mm, name).lora_B.weight)
            _peft_layer(pm, name).lora_B["default"].weight.copy_(w)
            getattr(mm, name).lora_B.weight.copy_(w)
    x = torch.randn(5, 32)
    before = mm(x)
    for name in ("q_proj", "v_proj"):
        _peft_layer(pm, name).merge()
        getattr(mm, name).merge()
        assert torch.equal(_peft_layer(pm, name).base_layer.weight, getattr(mm, name).base.weight)
    assert torch.allclose(mm(x), before, atol=1e-5)
    with pytest.raises(RuntimeError):
        mm.q_proj.merge()
    for name in ("q_proj", "v_proj"):
        _peft_layer(pm, name).unmerge()
        getattr(mm, name).unmerge()
        assert torch.equal(_peft_layer(pm, name).base_layer.weight, getattr(mm, name).base.weight)
    assert torch.allclose(mm(x), before, atol=1e-6)


def test_dropout_applies_to_the_adapter_path_only():
    torch.manual_seed(0)
    layer = L.LoRALinear(nn.Linear(16, 16), r=2, alpha=4, dropout=0.5)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 16)
    layer.eval()
    y_eval = layer(x)
    layer.train()
    torch.manual_seed(5)
    y_train = layer(x)
    assert not torch.equal(y_eval, y_train)
    torch.manual_seed(5)
    h = nn.functional.dropout(x, 0.5, training=True)
    want = layer.base(x) + layer.lora_B(layer.lora_A(h)) * 2.0
    assert torch.equal(y_train, want)


def test_qlora_layer_equal_to_peft_on_bitsandbytes_linear4bit():
    """QLoRA: our LoRALinear on our Linear4bit vs peft's lora.Linear4bit on bitsandbytes.nn.Linear4bit, same weights."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    ref_base = bnb.nn.Linear4bit(64, 32, bias=True, compute_dtype=torch.float32, compress_statistics=False, quant_type="nf4")
    ref_base.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                       compress_statistics=False, blocksize=64)
    ref_base.bias = nn.Parameter(lin.bias.data.clone())
    ref_base = ref_base.to("cpu")
    wrapper = nn.Sequential()
    wrapper.add_module("q_proj", ref_base)
    torch.manual_seed(3)
    pm = peft.get_peft_model(wrapper, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    torch.manual_seed(3)
    ours = L.LoRALinear(Q.Linear4bit.from_linear(lin, compute_dtype=torch.float32, double_quant=False), r=4, alpha=8)
    pl = pm.base_model.model.q_proj
    assert isinstance(pl.base_layer, bnb.nn.Linear4bit)
    assert torch.equal(pl.lora_A["default"].weight, ours.lora_A.weight)
    with torch.no_grad():
        w = torch.randn_like(ours.lora_B.weight)
        pl.lora_B["default"].weight.copy_(w)
        ours.lora_B.weight.copy_(w)
    x = torch.randn(6, 64)
    yp, ym = pm(x), ours(x)
    assert torch.equal(yp, ym)
    yp.sum().backward()
    ym.sum().backward()
    assert torch.equal(pl.lora_A["default"].weight.grad, ours.lora_A.weight.grad)
    assert torch.equal(pl.lora_B["default"].weight.grad, ours.lora_B.weight.grad)


def test_merge_on_a_4bit_base_requantizes():
    torch.manual_seed(0)
    layer = L.LoRALinear(Q.Linear4bit(64, 32, compute_dtype=torch.float32), r=4, alpha=8)
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 0.01)
    x = torch.randn(4, 64)
    before = layer(x)
    layer.merge()
    after = layer(x)
    assert (after - before).abs().max().item() < 0.1 * before.abs().max().item()  # NF4 rounding of W + BA
    layer.unmerge()
    assert not layer.merged


def test_bad_arguments():
    with pytest.raises(TypeError):
        L.LoRALinear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match=r"^r=0 is invalid; allowed: an int >= 1$"):
        L.LoRALinear(nn.Linear(4, 4), r=0)
    with pytest.raises(ValueError, match=r"^dropout=1.0 is invalid; allowed: a float with 0 <= dropout < 1$"):
        L.LoRALinear(nn.Linear(4, 4), dropout=1.0)
    with pytest.raises(ValueError, match=r"target_modules=\('k_proj',\) is invalid; .*no nn.Linear"):
        L.add_lora(Tiny(), target_modules=["k_proj"])
    with pytest.raises(ValueError, match="target_modules=\\[\\] is invalid; allowed: a non-empty"):
        L.add_lora(Tiny(), target_modules=[])


# ----------------------------------------------------------------------------- the QLoRA model, its bytes, end to end
def test_qlora_model_bytes_predicted_exactly_and_only_adapters_train():
    from memlab.models import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    predicted = L.predict_qlora_bytes(model, r=8)
    q = L.qlora_model(copy.deepcopy(model), r=8)
    assert L.model_storage_bytes(q) == predicted
    assert isinstance(q.lm_head, nn.Linear)  # kept, as transformers' BitsAndBytesConfig does
    assert isinstance(q.model.layers[0].mlp.down_proj.base, Q.Linear4bit)
    names = {n for n, p in q.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert L.count_trainable(q)[0] == sum(8 * (m.in_features + m.out_features) for m in q.modules()
                                          if isinstance(m, L.LoRALinear))


def test_qlora_end_to_end_matches_transformers_bitsandbytes_peft():
    """Stated tolerance: tiny_llama, the same fp32 weights, transformers' BitsAndBytesConfig (NF4, double quant,
    bf16 compute) + peft LoRA r=8 on every linear vs memlab.quant.lora.qlora_model with the same adapter weights;
    10 AdamW steps on the stdlib corpus: every loss within 1e-3 (the only differences are the CPU lookup's
    occasional neighbour code for a double-quantized scale and the order of bf16 roundings)."""
    import tempfile

    import torch._dynamo
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from memlab.models.corpus import batches, stdlib_corpus
    from memlab.models import lm_loss, tiny_llama

    old = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        torch.manual_seed(0)
        base = tiny_llama()
        with tempfile.TemporaryDirectory() as d:
            base.save_pretrained(d)
            qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=torch.bfloat16)
            ref = LlamaForCausalLM.from_pretrained(d, quantization_config=qc, device_map="cpu", dtype=torch.float32)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        ref = peft.get_peft_model(ref, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        mine = L.qlora_model(copy.deepcopy(base), r=8, alpha=16)
        ref_layers = {n: m for n, m in ref.named_modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}
        mine_layers = {n: m for n, m in mine.named_modules() if isinstance(m, L.LoRALinear)}
        assert len(ref_layers) == len(mine_layers) == 7 * base.config.num_hidden_layers
        with torch.no_grad():
            for (rn, rm), (mn, mm) in zip(sorted(ref_layers.items()), sorted(mine_layers.items())):
                assert rn.endswith(mn)
                mm.lora_A.weight.copy_(rm.lora_A["default"].weight)
                mm.lora_B.weight.copy_(rm.lora_B["default"].weight)
        ro = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
        mo = torch.optim.AdamW(L.lora_parameters(mine), lr=1e-3)
        assert sum(p.numel() for g in ro.param_groups for p in g["params"]) == sum(p.numel() for p in L.lora_parameters(mine))
        stream = batches(stdlib_corpus(), 4, 64, seed=0)
        worst = 0.0
        for _ in range(10):
            x, y = next(stream)
            lr_, lm_ = lm_loss(ref, x, y), lm_loss(mine, x, y)
            worst = max(worst, abs(lr_.item() - lm_.item()))
            lr_.backward()
            lm_.backward()
            ro.step(), mo.step()
            ro.zero_grad(), mo.zero_grad()
        assert worst < 1e-3, worst
    finally:
        torch._dynamo.config.disable = old


def test_bench_qlora_runs_small(capsys):
    from memlab.bench import qlora as bench

    assert bench.main(["--size", "128", "--repeat", "1", "--skip-steps"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and "NO" not in out.split("Linear4bit")[0] and "device:" in out


def test_estimator_traces_lora_and_qlora_and_matches_the_real_step():
    """memlab.estimate traces a LoRA / QLoRA tiny_llama on fake tensors (no formula): LoRA byte-equal to the real
    tracked step; QLoRA byte-equal too (NF4 dequantize's fake path allocates exactly what the real call does;
    the double-quant dynamic map's fake 1 KiB copy is not at this step's peak)."""
    from memlab import estimate as E
    from memlab.models import tiny_llama

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def lora_model():
        torch.manual_seed(0)
        return L.add_lora(tiny_llama(num_hidden_layers=2), r=8, target_modules=targets)

    def qlora():
        torch.manual_seed(0)
        return L.qlora_model(tiny_llama(num_hidden_layers=2), r=8)

    kw = dict(batch_size=2, seq_len=32, dtype="fp32", device="cpu", loss="memlab")
    for build, slack in ((lora_model, 0), (qlora, 0)):
        est = E.estimate_training_memory(build, extrapolate=False, kernel_scratch=False, **kw)
        real = E.measure_training_memory(build, **kw)
        assert abs(est.peak_bytes - real.peak_bytes) <= slack, (build.__name__, est.peak_bytes, real.peak_bytes)
