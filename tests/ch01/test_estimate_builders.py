"""A user's own builder traced as written (issue 40, point 1): ``.to(device/dtype)``, ``.cuda()``, peft's
``get_peft_model`` and ``prepare_model_for_kbit_training``, ``from_config(..., torch_dtype=...)``, inside the
estimator's fake mode. Each form's estimate equals the same step run for real, and the config route where one
exists; a builder that fake tensors cannot run is one line naming its line and the route that works; README's
peft example (PEFT_EXAMPLE, pasted into README under ``<!-- peft-example -->``) runs as written."""
from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest
import torch

from memlab.estimate import estimate_training_memory, measure_training_memory
from memlab.estimate.model import UntraceableBuilder

pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

STEP = dict(batch_size=2, seq_len=16, device="cpu")


def _cfg() -> LlamaConfig:
    # a new config for every build: from_config(..., torch_dtype=...) writes the dtype into the config it is given
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=512)


def _hf(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(_cfg(), **kw)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def to_cpu():
    return _hf().to("cpu")


def to_bf16():
    return _hf().to(torch.bfloat16)


def half_then_float():
    return _hf().half().float()


def from_config_bf16():
    return _hf(torch_dtype=torch.bfloat16)


def peft_lora():
    from peft import get_peft_model

    return get_peft_model(_hf(torch_dtype=torch.bfloat16), _lora())


def peft_kbit():
    from peft import get_peft_model, prepare_model_for_kbit_training

    return get_peft_model(prepare_model_for_kbit_training(_hf(torch_dtype=torch.bfloat16)), _lora())


BUILDERS = [(to_cpu, "bf16-mixed"), (to_bf16, "bf16-mixed"), (half_then_float, "bf16-mixed"),
            (from_config_bf16, "bf16-pure"), (peft_lora, "bf16-mixed"), (peft_kbit, "bf16-mixed")]


@pytest.mark.parametrize("build,dtype", BUILDERS, ids=[b.__name__ for b, _ in BUILDERS])
def test_builder_estimate_equals_the_real_step(build, dtype):
    """Failed on the old code: _apply(): Couldn't swap Embedding.weight / Linear.weight."""
    fake = estimate_training_memory(build, dtype=dtype, kernel_scratch=False, **STEP)
    real = measure_training_memory(build, dtype=dtype, **STEP)
    assert fake.peak_bytes == real.peak_bytes > 0
    assert fake.breakdown == real.breakdown and fake.phase_peaks == real.phase_peaks


def test_builders_equal_the_config_route_where_there_is_one():
    kw = dict(kernel_scratch=False, **STEP)
    assert estimate_training_memory(to_cpu, **kw).peak_bytes == estimate_training_memory(_cfg(), **kw).peak_bytes
    pure = dict(kw, dtype="bf16-pure")
    assert (estimate_training_memory(from_config_bf16, **pure).peak_bytes
            == estimate_training_memory(_cfg(), **pure).peak_bytes)
    peft = estimate_training_memory(peft_lora, **kw)
    ours = estimate_training_memory(_cfg(), adapter="lora", lora_r=8, **kw)
    assert peft.peak_bytes == ours.peak_bytes and peft.breakdown == ours.breakdown
    assert peft.loss == "hf"  # peft's wrapper of a transformers model runs transformers' loss
    # .to(torch.bfloat16) has no config route: it converts the rotary inv_freq buffer too (the config route's
    # bf16-pure builds the weights in bf16 and keeps that buffer fp32): 32 bytes apart, both equal their real step
    conv = estimate_training_memory(to_bf16, **pure).peak_bytes
    assert conv == measure_training_memory(to_bf16, dtype="bf16-pure", **STEP).peak_bytes
    assert estimate_training_memory(half_then_float, **kw).peak_bytes == estimate_training_memory(_cfg(), **kw).peak_bytes


def test_prepare_model_for_kbit_training_has_no_config_route_and_says_why():
    # on a model that is not quantized, peft's prepare_model_for_kbit_training upcasts every 16-bit parameter to
    # fp32 (and turns on gradient checkpointing): an fp32 frozen base under bf16 autocast, which no adapter= route
    # builds (adapter="lora" keeps the base in bf16 under bf16-mixed). Its weights are those of the fp32 route's.
    kw = dict(kernel_scratch=False, **STEP)
    kbit = estimate_training_memory(peft_kbit, **kw)
    fp32 = estimate_training_memory(_cfg(), adapter="lora", lora_r=8, **dict(kw, dtype="fp32"))
    assert kbit.breakdown["parameters"] == fp32.breakdown["parameters"]
    assert kbit.peak_bytes != estimate_training_memory(_cfg(), adapter="lora", lora_r=8, **kw).peak_bytes


def test_to_cuda_on_a_cpu_only_machine_traces_the_cuda_target():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine builds on CUDA")

    def to_cuda():
        return _hf().to("cuda")

    def dot_cuda():
        return _hf().cuda()

    kw = dict(batch_size=2, seq_len=16, gpu="rtx4090")
    ref = estimate_training_memory(_cfg(), **kw)
    for build in (to_cuda, dot_cuda):
        est = estimate_training_memory(build, **kw)
        assert est.peak_bytes == ref.peak_bytes and est.reserved_replay_bytes == ref.reserved_replay_bytes


def test_an_untraceable_builder_is_one_line_naming_its_line_and_what_works():
    def build():
        model = _hf()
        model.lm_head.weight.numpy()  # reads values: fake tensors have none
        return model

    with pytest.raises(UntraceableBuilder) as info:
        estimate_training_memory(build, **STEP)
    msg = str(info.value)
    assert "\n" not in msg
    assert "model.lm_head.weight.numpy()" in msg and "test_estimate_builders.py line" in msg
    assert "from_config" in msg and "adapter='lora'" in msg
    assert isinstance(info.value.original, RuntimeError)


def test_from_pretrained_runs_and_4bit_loading_names_the_route_that_works(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf().save_pretrained(tmp_path)

    def local():
        return AutoModelForCausalLM.from_pretrained(tmp_path)

    def four_bit():
        quant = BitsAndBytesConfig(load_in_4bit=True)
        return AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant)

    assert (estimate_training_memory(local, kernel_scratch=False, **STEP).peak_bytes
            == measure_training_memory(local, **STEP).peak_bytes)
    with pytest.raises(UntraceableBuilder) as info:
        estimate_training_memory(four_bit, **STEP)
    msg = str(info.value)
    assert "\n" not in msg and "quantization_config=quant" in msg and "adapter='qlora'" in msg


def test_our_own_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="target_modules"):
        estimate_training_memory(to_cpu, adapter="lora", target_modules="nope", **STEP)


PEFT_EXAMPLE = '''\
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig
from memlab.estimate import estimate_training_memory

# in your project: config = AutoConfig.from_pretrained("meta-llama/Llama-3.1-8B") (its config.json, no weights)
config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=2048)

def build():                                        # your builder, as you wrote it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora).to("cuda")

est = estimate_training_memory(build, batch_size=4, seq_len=512, gpu="rtx4090")  # fake tensors: nothing allocated
same = estimate_training_memory(config, batch_size=4, seq_len=512, gpu="rtx4090", adapter="lora", lora_r=16)
print(est.table())
print(f"peft builder {est.peak_bytes:,} B, adapter='lora' {same.peak_bytes:,} B")
'''


def test_readme_peft_example_runs_as_written():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    marker = "<!-- peft-example -->"
    if marker in readme:  # once pasted, README's block is this code, character for character
        block = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", readme, re.S).group(1)
        assert block == PEFT_EXAMPLE
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(PEFT_EXAMPLE, "README.md:peft-example", "exec"), {"__name__": "readme_peft"})
    text = out.getvalue()
    a, b = re.search(r"peft builder ([\d,]+) B, adapter='lora' ([\d,]+) B", text).groups()
    assert a == b
    assert "peak:" in text and "transformers' loss" in text
