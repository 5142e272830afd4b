"""The planner's cost model: seconds per optimizer step (one effective batch), relative to the ideal
16-bit forward + backward, from stated vendor constants (:data:`GPU_SPECS`) and the model's shape.
FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B); recomputation Chen et al. 2016."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memlab.core.vocab import Recipe
from memlab.plan.stack import ADAPTERS, Stack
from memlab.plan.stacks import config_at_depth, layer_count, model_builder

@dataclass(frozen=True)
class CostModel:
    """Stated constants of the relative cost model (all rates in bytes or FLOP per second).

    ``flops_16bit``: dense bf16/fp16 tensor-core FLOP/s with fp32 accumulation; ``flops_fp32``:
    fp32 FLOP/s without TF32 (PyTorch's default for fp32 matmuls on CUDA since 1.12); ``hbm``: the
    card's memory bandwidth; ``pcie``: a practical host<->device rate (about 80% of the raw link:
    chapter 04 uses 25 GB/s for PCIe 4.0 x16, 32 GB/s raw); ``host``: the CPU's streaming bandwidth
    for the offloaded AdamW step (an assumption: chapter 04 measures it on your machine); ``mfu``:
    the fraction of peak FLOP/s a training step reaches (an assumption, the same for every stack,
    so it only weighs compute against the memory-bound terms); ``launch``: seconds per kernel launch
    and ``kernels_per_layer`` kernels per layer and pass (assumptions; what makes many small
    micro-batches slower beyond the roofline). To be calibrated on a GPU.
    """

    name: str
    flops_16bit: float
    flops_fp32: float
    hbm: float
    pcie: float
    source: str
    host: float = 50e9
    mfu: float = 0.5
    launch: float = 5e-6
    kernels_per_layer: int = 25


# Vendor figures (dense, no sparsity), cited in ``source``.
GPU_SPECS: dict[str, CostModel] = {
    "rtx4090": CostModel("GeForce RTX 4090", 165.2e12, 82.6e12, 1008e9, 25e9,
                         "NVIDIA Ada Lovelace GPU architecture whitepaper (v1.01, 2022), RTX 4090 column: "
                         "165.2 TFLOPS BF16 tensor with FP32 accumulate (dense), 82.6 TFLOPS FP32, 1008 GB/s; PCIe 4.0 x16"),
    "rtx3090": CostModel("GeForce RTX 3090", 71e12, 35.6e12, 936e9, 25e9,
                         "NVIDIA Ampere GA102 GPU architecture whitepaper (v2.0), RTX 3090 column: 71 TFLOPS "
                         "FP16/BF16 tensor with FP32 accumulate (dense), 35.6 TFLOPS FP32, 936 GB/s; PCIe 4.0 x16"),
    "a100-40gb": CostModel("A100-SXM4-40GB", 312e12, 19.5e12, 1555e9, 25e9,
                           "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS BF16 (dense), 19.5 TFLOPS FP32, "
                           "1,555 GB/s (40GB); PCIe 4.0 x16"),
    "a100-80gb": CostModel("A100-SXM4-80GB", 312e12, 19.5e12, 2039e9, 25e9,
                           "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS BF16 (dense), 19.5 TFLOPS FP32, "
                           "2,039 GB/s (80GB SXM); PCIe 4.0 x16"),
    "h100-80gb": CostModel("H100 SXM5 80GB", 989e12, 67e12, 3.35e12, 50e9,
                           "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 1,979 TFLOPS BF16 with sparsity "
                           "(989 dense), 67 TFLOPS FP32, 3.35 TB/s; PCIe 5.0 x16 (64 GB/s raw per direction)"),
}
REFERENCE_GPU = "h100-80gb"
#: kernel launches of one parameter's optimizer step run alone (a for-loop AdamW's elementwise ops: an assumption)
STEP_KERNELS = 10


def cost_model_for(gpu: Any) -> tuple[CostModel, str | None]:
    """The cost constants for ``gpu`` (a card name, or anything else for the reference card's), and a note
    when they are not the card's own."""
    from memlab.core import gpus

    card = gpus.find_gpu(gpu) if isinstance(gpu, str) else None
    if card is not None:
        key = next(k for k, v in gpus.GPUS.items() if v is card)
        if key in GPU_SPECS:
            return GPU_SPECS[key], None
        return GPU_SPECS[REFERENCE_GPU], (f"no cost constants for {card.name}: the {GPU_SPECS[REFERENCE_GPU].name}'s "
                                           f"are used (ratios, not seconds, set the ranking)")
    return GPU_SPECS[REFERENCE_GPU], (f"costs use the {GPU_SPECS[REFERENCE_GPU].name}'s constants "
                                       f"(name a card with gpu= for its own)")


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know of the model (counted on the meta device)."""

    n_layers: int
    d_model: int
    n_heads: int
    matmul_params: int         # weights of every nn.Linear, lm_head included: 2 FLOP per token each
    block_matmul_params: int   # those inside the decoder layers (recomputed by checkpointing)
    all_params: int
    trainable: dict[str, int]  # adapter -> trainable parameters
    quantized: int             # weights stored in NF4 under QLoRA
    param_tensors: dict[str, int] = field(default_factory=dict)  # adapter -> trainable parameter tensors


def stack_cost(stack: Stack, shape: ModelShape, seq_len: int, cost: CostModel) -> tuple[float, dict[str, float]]:
    """(relative cost, seconds by term) of one optimizer step of ``stack``.

    The step's time, term by term, divided by the ideal: the effective batch's 16-bit
    forward + backward of every weight at ``cost.mfu`` of peak, with nothing else.

    * FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T for training):
      forward 2N (N = weights of the matmuls) + 4 L d T attention (L layers, width d, sequence T);
      backward twice that, except that a frozen weight (LoRA/QLoRA base) needs no weight gradient
      (2N for the input gradients + 2 per trainable parameter).
    * Checkpointing recomputes the forward of the checkpointed decoder layers in backward (Chen et
      al. 2016): every one for "full", one in k for "every-k".
    * fp32 runs at ``flops_fp32``, 16-bit at ``flops_16bit``; each micro-batch takes at least the time to
      read the 16-bit weights once per pass (roofline: Williams et al. 2009), plus
      ``launch * kernels_per_layer * L * passes`` of kernel launches: this is what gradient
      accumulation loses.
    * QLoRA dequantizes each NF4 weight at each use (forward, backward, recompute): 0.5 byte read
      and 2 bytes written per weight, at HBM bandwidth.
    * The optimizer step is memory-bound, once per effective batch: bytes per trainable parameter
      moved (2 x weight + gradient + 2 x 2 x moment bytes, + 2 x moment for the foreach AdamW's temporary; 8-bit
      moments are 1 byte) over HBM bandwidth.
    * CPU-offloaded AdamW (gradients offloaded in backward): every micro-batch's gradients go to the host
      and the updated weights come back over PCIe, and the host runs a 28-byte-per-parameter
      fp32 AdamW step (chapter 04) at ``host`` bandwidth; no overlap is assumed (an upper bound).
    * The fused loss (chapter 09) recomputes the head's logits in backward: 2 FLOP per head weight and token
      more. The optimizer step in backward runs one optimizer per parameter tensor: ``STEP_KERNELS``
      launches each (an assumption: a for-loop AdamW's elementwise kernels) instead of multi-tensor ones; its
      bytes are the normal step's.
    * Eager attention writes and reads the b x h x T x T probabilities (forward, backward) at HBM
      bandwidth.
    """
    sixteen = stack.precision != Recipe.FP32
    peak = cost.flops_16bit if sixteen else cost.flops_fp32
    frozen = stack.adapter != "full"
    trainable = shape.trainable[stack.adapter]
    N, L, d, T = shape.matmul_params, shape.n_layers, shape.d_model, seq_len
    att = 4 * L * d * T
    fwd = 2 * N + att
    bwd = (2 * N + 2 * trainable if frozen else 4 * N) + 2 * att
    if stack.checkpointing == "full":
        frac = 1.0
    elif stack.checkpointing == "every-k":
        frac = math.ceil(L / stack.ckpt_every) / L
    else:
        frac = 0.0
    recompute = frac * (2 * shape.block_matmul_params + att)
    if stack.loss == "fused":  # the head's logits computed again, chunk by chunk, in backward
        recompute += 2 * (N - shape.block_matmul_params)
    tokens = stack.micro_batch * T
    compute = tokens * (fwd + bwd + recompute) / (peak * cost.mfu)
    wbytes = 2 if (sixteen or stack.adapter != "full") else 4
    passes = 2 + frac
    weights_read = wbytes * N * passes / cost.hbm
    terms: dict[str, float] = {}
    terms["compute"] = stack.grad_accum * max(compute, weights_read)
    terms["launches"] = stack.grad_accum * cost.launch * cost.kernels_per_layer * L * passes
    if stack.adapter == "qlora":
        terms["dequant"] = stack.grad_accum * 2.5 * shape.quantized * passes / cost.hbm
    if stack.attention == "eager":
        probs = stack.micro_batch * shape.n_heads * T * T * (2 if sixteen else 4) * L
        terms["eager attention"] = stack.grad_accum * 4 * probs / cost.hbm
    pb = 2 if stack.precision == Recipe.BF16_PURE else 4          # weights (and their gradients) in bytes
    if stack.optimizer == "offload-adamw":
        terms["pcie"] = (stack.grad_accum * pb + pb) * trainable / cost.pcie
        terms["host step"] = (28 + 8 * (stack.grad_accum - 1)) * trainable / cost.host
    else:
        sb = 1 if stack.optimizer == "adamw8bit" else pb
        per = 2 * pb + pb + 4 * sb + (2 * sb if stack.optimizer == "adamw" else 0)
        if stack.grad_accum > 1:
            per += 2 * pb * (stack.grad_accum - 1)   # accumulating into .grad: read + write per extra micro-batch
        terms["optimizer"] = per * trainable / cost.hbm
    if stack.optimizer_in_backward:  # one optimizer per parameter tensor: no multi-tensor kernels
        terms["per-parameter steps"] = cost.launch * STEP_KERNELS * shape.param_tensors[stack.adapter]
    ideal = stack.effective_batch * T * (6 * N + 3 * att) / (cost.flops_16bit * cost.mfu)
    return sum(terms.values()) / ideal, terms



def model_shape(cfg: Any, lora_r: int = 16) -> ModelShape:
    """What :func:`stack_cost` needs of a transformers config (adapters of rank ``lora_r``): parameter
    counts at depths 1 and 2 on the meta device, extrapolated by layer count."""
    import torch
    from torch import nn

    L = layer_count(cfg)
    counts: dict[int, dict[str, int]] = {}
    for depth in (1, 2):
        c: dict[str, int] = {}
        for adapter in ("full", "lora"):  # QLoRA: the same adapters on the same layers, quantized
            with torch.device("meta"):
                m = model_builder(config_at_depth(cfg, depth), Stack(precision="bf16-mixed", adapter=adapter), lora_r)()
            c[adapter] = sum(p.numel() for p in m.parameters() if p.requires_grad)
            c[f"{adapter} tensors"] = sum(1 for p in m.parameters() if p.requires_grad)
            if adapter == "full":
                c["all"] = sum(p.numel() for p in m.parameters())
                lin = [(n, mod) for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
                c["matmul"] = sum(mod.weight.numel() for _, mod in lin)
                c["head"] = sum(mod.weight.numel() for n, mod in lin if n.rsplit(".", 1)[-1] == "lm_head")
        c["qlora"], c["qlora tensors"] = c["lora"], c["lora tensors"]
        c["quantized"] = c["matmul"] - c["head"]  # memlab.quant.lora.qlora_model: every nn.Linear but lm_head
        counts[depth] = c
    ext = {k: counts[1][k] + (counts[2][k] - counts[1][k]) * (L - 1) for k in counts[1]}
    d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or getattr(cfg, "d_model")
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head")
    return ModelShape(n_layers=L, d_model=int(d), n_heads=int(heads), matmul_params=ext["matmul"],
                  block_matmul_params=ext["matmul"] - ext["head"], all_params=ext["all"],
                  trainable={a: ext[a] for a in ADAPTERS}, quantized=ext["quantized"],
                  param_tensors={a: ext[f"{a} tensors"] for a in ADAPTERS})


