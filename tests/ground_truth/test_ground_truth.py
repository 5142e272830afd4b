"""Ground truth: memlab's implementations against the production ones, on the same model and input, each measured
by a counter that is not memlab's twin of it (issue 20).

The counter is the CPU allocator itself, read through ``torch.profiler.profile(profile_memory=True)``: every
allocation and free in the profiled region is an event with its size; :func:`allocator_curve` adds them up in time
order into the live-bytes curve and its peak. It sees nothing allocated before the region began, so each number
here is "bytes above the resting state" of the region (the resting state is compared separately where it matters).

Comparisons (tiny Llama from transformers' LlamaConfig, batch 4 x 64 tokens, eager attention):

* QLoRA r=8, one training step: memlab.quant + memlab.quant.lora vs transformers ``BitsAndBytesConfig`` (nf4, double
  quant) + bitsandbytes + peft, fp32 and bf16 compute, both with the attention ``from_pretrained`` picks by default
  (SDPA): the production stack as it is loaded. Tolerance 2%; measured equal (before memlab's Linear4bit kept only
  its 4-bit state for backward: 1.23x in fp32, 1.11x in bf16 compute). The same through
  ``memlab.estimate.measure_training_memory``: a setup that builds memlab's side from ``tiny_llama()`` (eager
  attention, its default) and loads the production side with transformers' default (SDPA) reads 1.13x, all of it
  the attention implementation (eager keeps the probabilities and GQA's repeated keys and values for backward).
* one Linear4bit layer's forward: bytes still allocated when forward returns, besides its output, vs
  ``bnb.nn.Linear4bit``: bitwise equal (0 B).
* LoRA r=8 (fp32 base) vs peft LoRA: peak within 2%, trainable parameters equal, first-step loss and
  adapters bitwise equal.
* memlab.offload.OffloadedAdamW vs torch.optim.AdamW: peak of the first step (state created inside the region).
  On a CPU-only machine host == device, so OffloadedAdamW's fp32 master copy and host gradient buffers are extra
  bytes on the same allocator: the known difference, checked to within 2% of the torch peak.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from memlab.quant import lora  # noqa: E402
from memlab.models import lm_loss, tiny_llama  # noqa: E402
from memlab.quant import Linear4bit  # noqa: E402

# peft 0.21 asks transformers 5.24 a deprecated question; nothing for this test to act on
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

BATCH, SEQ = 4, 64
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


# ----------------------------------------------------------------------------- the counter
def allocator_events(prof) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated, - freed) of every CPU allocator event a profile recorded, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
            out.append((ev.start_time_ns, ev.extra_fields.alloc_size))
        stack.extend(ev.children)
    out.sort(key=lambda e: e[0])
    return out


def allocator_curve(fn) -> tuple[int, int, list[int]]:
    """Run ``fn()`` under the profiler: (peak live bytes, live bytes at the end, the curve), all relative to the
    bytes live when ``fn`` began."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    curve, live = [0], 0
    for _, nbytes in allocator_events(prof):
        live += nbytes
        curve.append(live)
    return max(curve), live, curve


def test_allocator_curve_on_a_known_workload():
    """The counter itself: 1 MiB then 2 MiB allocated, the 1 MiB freed, a 3 MiB temporary: peak 5 MiB, end 2 MiB."""
    keep = []

    def work():
        a = torch.empty(2**18)            # 1 MiB
        b = torch.empty(2**19)            # 2 MiB
        del a
        torch.empty(3 * 2**18).fill_(1)   # 3 MiB, freed at once
        keep.append(b)

    peak, end, _ = allocator_curve(work)
    assert peak == 5 * 2**20 and end == 2 * 2**20, (peak, end)


# ----------------------------------------------------------------------------- models
def _step(model, opt, x, y):
    def run():
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


@pytest.fixture(scope="module")
def base_and_batch():
    torch.manual_seed(0)
    base = tiny_llama()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    y = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    return base, x, y


#: the attention implementation transformers' ``from_pretrained`` picks on this CPU when none is named
PRODUCTION_ATTENTION = "sdpa"


def _production_qlora(base, compute_dtype, tmp_path, attn_implementation=None):
    """transformers' 4-bit loading (BitsAndBytesConfig) of the same weights from a local directory, then peft; the
    attention is transformers' default unless named (the production stack as one loads it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    base.save_pretrained(tmp_path)
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute_dtype)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=cfg,
                                                 device_map="cpu", **extra)
    assert isinstance(model.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    # from_pretrained returns eval mode, where bitsandbytes on an AVX512-BF16 CPU repacks the weights for inference
    # at the first forward without gradients: train as one trains
    return model.train()


def _trainable(model) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- QLoRA
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qlora_step_peak_equal_to_transformers_bitsandbytes_peft(base_and_batch, compute_dtype, tmp_path):
    """One QLoRA r=8 step (forward, backward, AdamW step) after a first one: memlab's peak above the resting state
    within 2% of the production stack's (measured: equal). Before memlab's Linear4bit kept only its 4-bit state for
    backward, autograd held a dequantized copy of every frozen weight: 14.01 vs 11.37 MiB (fp32 compute, 1.23x),
    12.69 vs 11.37 MiB (bf16 compute, 1.12x)."""
    base, x, y = base_and_batch
    base = _with_attention(base, PRODUCTION_ATTENTION)
    ours = lora.qlora_model(copy.deepcopy(base), r=8, alpha=16) if compute_dtype == torch.bfloat16 else None
    if ours is None:
        ours = lora.add_lora(lora.quantize_model(copy.deepcopy(base), compute_dtype=compute_dtype), r=8, alpha=16,
                             target_modules=TARGETS)
    prod = _production_qlora(base, compute_dtype, tmp_path)
    assert prod.config._attn_implementation == ours.config._attn_implementation == PRODUCTION_ATTENTION
    assert sum(p.numel() for p in _trainable(ours)) == sum(p.numel() for p in _trainable(prod)) == 73984
    results = {}
    for name, model in (("memlab", ours), ("production", prod)):
        opt = torch.optim.AdamW(_trainable(model), lr=1e-4)
        _step(model, opt, x, y)()  # the optimizer state exists from here on
        results[name] = allocator_curve(_step(model, opt, x, y))[0]
        with torch.no_grad():
            results[name + " loss"] = lm_loss(model, x, y).item()
    ratio = results["memlab"] / results["production"]
    assert abs(ratio - 1) <= 0.02, (f"QLoRA step peak: memlab {results['memlab'] / 2**20:.3f} MiB, transformers + "
                                    f"bitsandbytes + peft {results['production'] / 2**20:.3f} MiB ({ratio:.3f}x)")
    # the same model: bitsandbytes' CPU lookup may pick a neighbouring 8-bit code for a few double-quantized
    # scales (tests/ch06/test_quant.py), so the losses agree closely, not bitwise
    assert abs(results["memlab loss"] - results["production loss"]) < 1e-3 * abs(results["production loss"])


def _with_attention(base, attn_implementation):
    """The same weights (seed 0, as the fixture) in a tiny Llama built with ``attn_implementation``."""
    torch.manual_seed(0)
    other = tiny_llama(attn_implementation=attn_implementation)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), base.parameters()))
    return other


def test_qlora_measured_peak_equal_to_the_production_stack_when_the_attention_is(tmp_path):
    """The comparison as the issue ran it: ``measure_training_memory(batch_size=4, seq_len=64, dtype="fp32",
    device="cpu", loss="memlab")`` of ``qlora_model`` against transformers (BitsAndBytesConfig nf4, double quant,
    bf16 compute) + peft LoraConfig(r=8, lora_alpha=16) on the same seven projections. ``tiny_llama()`` defaults
    to eager attention, ``from_pretrained`` to SDPA: 12.83 vs 11.33 MiB (1.132x). With the production stack's
    attention on both sides the peaks agree within 0.2% (the step's rise is byte-identical by the allocator; the
    resting 4-bit state differs by a few hundred bytes a layer); with eager on both, too: the attention is the
    whole difference. Compute dtype (bf16), adapter dtype (fp32), loss and modules are the same on both sides."""
    from memlab.estimate import measure_training_memory

    kw = dict(batch_size=4, seq_len=64, dtype="fp32", device="cpu", loss="memlab")
    torch.manual_seed(0)
    base = tiny_llama()
    peaks = {}
    for attn in ("eager", "sdpa"):
        peaks["memlab", attn] = measure_training_memory(
            lambda: lora.qlora_model(_with_attention(base, attn), r=8), **kw).peak_bytes
        prod_attn = None if attn == PRODUCTION_ATTENTION else attn
        builder = lambda: _production_qlora(base, torch.bfloat16, tmp_path, prod_attn)  # noqa: E731
        assert builder().config._attn_implementation == attn
        peaks["production", attn] = measure_training_memory(builder, **kw).peak_bytes
    for attn in ("eager", "sdpa"):
        ratio = peaks["memlab", attn] / peaks["production", attn]
        assert abs(ratio - 1) <= 0.002, (attn, peaks)
    # the setup that read 1.132x: memlab's default (eager) against production's default (SDPA)
    assert peaks["memlab", "eager"] / peaks["production", PRODUCTION_ATTENTION] > 1.10, peaks


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear4bit_forward_keeps_nothing_but_its_output_like_bitsandbytes(compute_dtype):
    """Bytes still allocated when one layer's forward returns, besides its output (what autograd keeps for
    backward, counted by the allocator): equal to bitsandbytes' Linear4bit, 0 B. It was the dequantized weight
    (4 B or 2 B per weight: 128 KiB or 64 KiB at 256 x 128)."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 256, bias=False)
    ours = Linear4bit.from_linear(lin, compute_dtype=compute_dtype)
    ref = bnb.nn.Linear4bit(128, 256, bias=False, compute_dtype=compute_dtype, compress_statistics=True,
                            quant_type="nf4")
    ref.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                   compress_statistics=True, blocksize=64)
    ref = ref.to("cpu")
    x = torch.randn(4, 16, 128, requires_grad=True)
    kept = {}
    for name, layer in (("memlab", ours), ("bitsandbytes", ref)):
        outs = []
        _, end, _ = allocator_curve(lambda: outs.append(layer(x)))
        kept[name] = end - outs[0].untyped_storage().nbytes()
    assert kept["memlab"] == kept["bitsandbytes"] == 0, kept


# ----------------------------------------------------------------------------- LoRA
def test_lora_step_peak_and_trainable_equal_to_peft(base_and_batch):
    """LoRA r=8 on every linear of the fp32 tiny Llama but lm_head: memlab.quant.lora vs peft. Same initialisation order
    (so the same adapters under the same seed), trainable parameters equal, the step's peak within 2% (measured:
    equal), the first step's loss and updated adapters bitwise equal."""
    from peft import LoraConfig, get_peft_model

    base, x, y = base_and_batch
    torch.manual_seed(5)
    ours = lora.add_lora(copy.deepcopy(base), r=8, alpha=16, target_modules=TARGETS)
    torch.manual_seed(5)
    prod = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    n_ours, n_prod = (sum(p.numel() for p in _trainable(m)) for m in (ours, prod))
    assert n_ours == n_prod == 73984
    peaks, losses = {}, {}
    for name, model in (("memlab", ours), ("peft", prod)):
        opt = torch.optim.AdamW(_trainable(model), lr=1e-3)
        losses[name] = lm_loss(model, x, y).item()
        _step(model, opt, x, y)()
        peaks[name] = allocator_curve(_step(model, opt, x, y))[0]
    ratio = peaks["memlab"] / peaks["peft"]
    assert abs(ratio - 1) <= 0.02, f"LoRA step peak: memlab {peaks['memlab']} B, peft {peaks['peft']} B ({ratio:.3f}x)"
    assert losses["memlab"] == losses["peft"]
    for a, b in zip(_trainable(ours), _trainable(prod)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- offloaded AdamW
def test_offloaded_adamw_peak_vs_torch_adamw(base_and_batch):
    """Full fine-tuning of the same fp32 model with memlab.offload.OffloadedAdamW vs torch.optim.AdamW(foreach=False):
    the optimizer built and two steps taken inside the region, so the peak holds the optimizer state as training
    does. On a GPU the offloaded optimizer moves its fp32 state off the device; on this CPU-only machine host ==
    device, so the allocator sees it all: the moments (8 B/param, as torch's) plus the fp32 master copy (4 B/param)
    and the host gradient buffer (4 B/param) that torch's AdamW does not have. Known difference: 8 B per parameter
    (measured: exactly that); tolerance 2% of torch's peak."""
    from memlab.offload import OffloadedAdamW

    base, x, y = base_and_batch
    n = sum(p.numel() for p in base.parameters())
    peaks = {}
    for name in ("torch", "offloaded"):
        model, keep = copy.deepcopy(base), []

        def train():
            opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False) if name == "torch"
                   else OffloadedAdamW(model.parameters(), lr=1e-4))
            keep.append(opt)  # alive at the end, as in training
            _step(model, opt, x, y)()
            _step(model, opt, x, y)()

        peaks[name] = allocator_curve(train)[0]
    diff = peaks["offloaded"] - peaks["torch"]
    known = 8 * n
    assert abs(diff - known) <= 0.02 * peaks["torch"], (
        f"OffloadedAdamW peak {peaks['offloaded'] / 2**20:.3f} MiB, torch AdamW {peaks['torch'] / 2**20:.3f} MiB: "
        f"difference {diff / 2**20:.3f} MiB, known (fp32 master + host gradients, 8 B x {n} params on a CPU-only "
        f"machine) {known / 2**20:.3f} MiB")
