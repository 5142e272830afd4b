"""Pick the training stack that fits a model into a memory budget (chapter 07).

A training run has knobs that trade memory for time: the precision, activation checkpointing
(none, every k-th block, every block), the optimizer (AdamW, fused AdamW, 8-bit AdamW, AdamW
offloaded to the CPU), LoRA or QLoRA adapters, the attention kernel, and the micro-batch (with
gradient accumulation keeping the effective batch). :class:`Stack` is one choice of all of them.

:func:`plan` enumerates the stacks, estimates each one's peak by *tracing* its training step on
fake tensors with :func:`memlab.estimate.estimate_training_memory` (LoRA and QLoRA models are
built by :mod:`memlab.lora` / :mod:`memlab.quant` inside the fake mode and traced too), and ranks
those that fit by a stated cost model (:func:`stack_cost`: recompute FLOPs, PCIe bytes, dequant
and optimizer bytes, per-micro-batch overheads, with vendor peak rates in :data:`GPU_SPECS`).
The cost model orders stacks; its seconds are not a measurement (to be calibrated on a GPU).

    memlab plan llama-3-8b --gpu rtx4090 --seq-len 2048 --batch-size 16
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
CHECKPOINTING = ("none", "every-k", "selective", "full")
OPTIMIZERS = ("adamw", "adamw-fused", "adam8bit", "offload-adamw")
ADAPTERS = ("full", "lora", "qlora")
ATTENTIONS = ("eager", "sdpa", "flash")


@dataclass(frozen=True)
class Stack:
    """One choice of every memory knob for a training run.

    ``micro_batch * grad_accum`` is the effective batch; ``ckpt_every`` is k for
    ``checkpointing="every-k"`` (checkpoint every k-th block).
    """

    precision: str = "fp32"
    checkpointing: str = "none"
    ckpt_every: int = 1
    optimizer: str = "adamw"
    adapter: str = "full"
    attention: str = "sdpa"
    micro_batch: int = 1
    grad_accum: int = 1

    def __post_init__(self) -> None:
        for name, allowed in (("precision", PRECISIONS), ("checkpointing", CHECKPOINTING),
                              ("optimizer", OPTIMIZERS), ("adapter", ADAPTERS), ("attention", ATTENTIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: allowed {', '.join(map(repr, allowed))}")
        for name in ("ckpt_every", "micro_batch", "grad_accum"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum


# ======================================================================================
# The planner
# ======================================================================================

__all__ = ["Stack", "PRECISIONS", "CHECKPOINTING", "OPTIMIZERS", "ADAPTERS", "ATTENTIONS",
           "CostModel", "GPU_SPECS", "PlanRow", "PlanResult", "plan", "enumerate_stacks", "estimate_stack",
           "stack_cost", "fidelity_tier", "main", "DEFAULT_ALLOW", "ModelShape", "model_shape", "stack_label",
           "resolve_budget"]

# --------------------------------------------------------------------------------------
# What the planner enumerates by default (``allow=`` narrows or widens it)
# --------------------------------------------------------------------------------------

DEFAULT_ALLOW: dict[str, tuple] = {
    "precision": ("fp32", "bf16-mixed", "bf16"),
    "checkpointing": ("none", "every-k", "full"),
    "ckpt_every": (2,),  # allow={"ckpt_every": (2, 4)} for more (each k costs traces at depths k and 2k)
    "optimizer": ("adamw", "adamw-fused", "adam8bit", "offload-adamw"),
    "adapter": ("full", "lora", "qlora"),
    "attention": ("sdpa",),
    "micro_batch": None,  # every divisor of batch_size
}
_ALLOWED_VALUES: dict[str, tuple] = {
    "precision": PRECISIONS, "checkpointing": ("none", "every-k", "full"), "optimizer": OPTIMIZERS,
    "adapter": ADAPTERS, "attention": ATTENTIONS,
}

# Stack.precision -> memlab.estimate's dtype recipe
_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16-pure"}
# Stack.optimizer -> (memlab.estimate optimizer, optimizer_impl, optimizer_kwargs)
_OPTIMIZER = {
    "adamw": ("adamw", "auto", None),  # PyTorch's default on CUDA: the foreach implementation
    "adamw-fused": ("adamw", "fused", None),
    "adam8bit": ("adamw8bit", "auto", None),
    "offload-adamw": ("offload-adamw", "auto", {"offload_gradients": True}),
}
# Device memory by optimizer, at equal everything else, where it is ordered whatever the model:
# the foreach AdamW (PyTorch's CUDA default) holds at least what the fused one does (its step's
# moment-sized temporaries; the same on a CPU, where both loop), and every optimizer holds at least
# what the offloaded one does (state, master weights and gradients on the host). 8-bit AdamW is
# ordered against neither AdamW: tensors under 4,096 elements keep fp32 moments, and bf16 weights
# have 2-byte AdamW moments, so on a small model it can hold more.
_OPT_GE = {("adamw", "adamw-fused")} | {(o, "offload-adamw") for o in OPTIMIZERS}


def _opt_ge(a: str, b: str) -> bool:
    return a == b or (a, b) in _OPT_GE


def fidelity_tier(stack: Stack) -> int:
    """How far the stack's update is from the fp32-master AdamW update of every weight.

    0: the same update (fp32, mixed precision, checkpointing, accumulation, CPU-offloaded AdamW --
    which keeps fp32 master weights on the host even for bf16 weights on the device, as ZeRO-Offload
    does); 1: the same parameters, a rounded update (pure bf16 weights and AdamW state without a
    master copy; 8-bit AdamW moments, Dettmers et al. 2022); 2: LoRA (other parameters are trained:
    Hu et al. 2021); 3: QLoRA (LoRA on an NF4-quantized base: Dettmers et al. 2023).
    """
    if stack.adapter == "qlora":
        return 3
    if stack.adapter == "lora":
        return 2
    if stack.optimizer == "adam8bit" or (stack.precision == "bf16" and stack.optimizer != "offload-adamw"):
        return 1
    return 0


_TIER_TEXT = {0: "exact AdamW update", 1: "rounded update", 2: "LoRA", 3: "QLoRA"}


# --------------------------------------------------------------------------------------
# The cost model: seconds per optimizer step (one effective batch), relative to the ideal
# --------------------------------------------------------------------------------------


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


def _cost_model_for(gpu: Any) -> tuple[CostModel, str | None]:
    from memlab import gpus

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
    * Eager attention writes and reads the b x h x T x T probabilities (forward, backward) at HBM
      bandwidth.
    """
    sixteen = stack.precision != "fp32"
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
    pb = 2 if stack.precision == "bf16" else 4          # weights (and their gradients) in bytes
    if stack.optimizer == "offload-adamw":
        terms["pcie"] = (stack.grad_accum * pb + pb) * trainable / cost.pcie
        terms["host step"] = (28 + 8 * (stack.grad_accum - 1)) * trainable / cost.host
    else:
        sb = 1 if stack.optimizer == "adam8bit" else pb
        per = 2 * pb + pb + 4 * sb + (2 * sb if stack.optimizer == "adamw" else 0)
        if stack.grad_accum > 1:
            per += 2 * pb * (stack.grad_accum - 1)   # accumulating into .grad: read + write per extra micro-batch
        terms["optimizer"] = per * trainable / cost.hbm
    ideal = stack.effective_batch * T * (6 * N + 3 * att) / (cost.flops_16bit * cost.mfu)
    return sum(terms.values()) / ideal, terms


# --------------------------------------------------------------------------------------
# The model: a preset, a config.json, or a transformers config
# --------------------------------------------------------------------------------------

_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


def _resolve_config(model: Any, config_overrides: Mapping[str, Any] | None) -> tuple[str, Any]:
    from memlab import estimate as E
    from memlab.models import PRESETS, preset_config

    overrides = dict(config_overrides or {})
    if isinstance(model, str):
        if model in PRESETS:
            return model, preset_config(model, **overrides)
        if model.endswith(".json") or "/" in model:
            cfg = E.load_config(model)
            for k, v in overrides.items():
                setattr(cfg, k, v)
            return model, cfg
        import difflib

        close = difflib.get_close_matches(model.lower(), sorted(PRESETS), n=1, cutoff=0.6)
        raise ValueError(f"model={model!r} is invalid; allowed: a preset ({', '.join(sorted(PRESETS))}), "
                         f"the path of a transformers config.json, or a transformers config"
                         f"{f' (did you mean {close[0]}?)' if close else ''}")
    if E._is_hf_config(model):
        cfg = copy.deepcopy(model)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return type(cfg).__name__, cfg
    raise TypeError(f"model={type(model).__name__} is invalid; allowed: a preset name, a config.json path or a "
                    f"transformers config (the planner rebuilds the model with adapters and checkpointing)")


def _layers(cfg: Any) -> tuple[str, int]:
    for f in _LAYER_FIELDS:
        v = getattr(cfg, f, None)
        if isinstance(v, int) and v > 0:
            return f, v
    raise ValueError(f"the config {type(cfg).__name__} has no layer count ({', '.join(_LAYER_FIELDS)})")


def _at_depth(cfg: Any, depth: int) -> Any:
    f, n = _layers(cfg)
    out = copy.deepcopy(cfg)
    setattr(out, f, depth)
    v = getattr(out, "layer_types", None)
    if isinstance(v, (list, tuple)) and len(v) == n:
        out.layer_types = list(v[:1]) * depth
    return out


def _linear_targets(model: Any) -> list[str]:
    from torch import nn

    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] != "lm_head"})


def _adapter_spec(stack: Stack, lora_r: int) -> Any:
    """The planner's LoRA/QLoRA as a :class:`memlab.adapters.AdapterSpec` (None for a full fine-tune):
    rank ``lora_r``, alpha 2 x r, every linear layer but the head, fp32 adapters -- the same adapters
    ``memlab estimate --adapter`` builds (one builder: :func:`memlab.adapters.apply_adapter`)."""
    from memlab import adapters

    if stack.adapter == "full":
        return None
    return adapters.adapter_spec(stack.adapter, recipe=_DTYPE[stack.precision], lora_r=lora_r)


def _builder(cfg: Any, stack: Stack, lora_r: int) -> Callable[[], Any]:
    """A callable that builds ``stack``'s model from ``cfg`` (called inside the estimator's fake mode)."""
    import torch

    def build():
        import warnings

        from transformers import AutoModelForCausalLM
        from transformers.modeling_layers import GradientCheckpointingLayer

        from memlab import adapters

        spec = _adapter_spec(stack, lora_r)
        if spec is not None:
            dtype = adapters.base_dtype(_DTYPE[stack.precision])
        else:
            dtype = torch.bfloat16 if stack.precision == "bf16" else torch.float32
        attn = "sdpa" if stack.attention == "flash" else stack.attention
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
        if spec is not None:
            adapters.apply_adapter(model, spec, _DTYPE[stack.precision])
        if stack.checkpointing != "none":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.gradient_checkpointing_enable()
            if stack.checkpointing == "every-k":
                layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
                for i, layer in enumerate(layers):
                    layer.gradient_checkpointing = i % stack.ckpt_every == 0
        return model

    build.__name__ = f"{type(cfg).__name__}+{stack.adapter}"
    return build


def model_shape(cfg: Any, lora_r: int = 16) -> ModelShape:
    """What :func:`stack_cost` needs of a transformers config: parameter counts at depths 1 and 2
    on the meta device, extrapolated by layer count."""
    import torch
    from torch import nn

    _, L = _layers(cfg)
    counts: dict[int, dict[str, int]] = {}
    for depth in (1, 2):
        c: dict[str, int] = {}
        for adapter in ("full", "lora"):  # QLoRA: the same adapters on the same layers, quantized
            with torch.device("meta"):
                m = _builder(_at_depth(cfg, depth), Stack(precision="bf16-mixed", adapter=adapter), lora_r)()
            c[adapter] = sum(p.numel() for p in m.parameters() if p.requires_grad)
            if adapter == "full":
                c["all"] = sum(p.numel() for p in m.parameters())
                lin = [(n, mod) for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
                c["matmul"] = sum(mod.weight.numel() for _, mod in lin)
                c["head"] = sum(mod.weight.numel() for n, mod in lin if n.rsplit(".", 1)[-1] == "lm_head")
        c["qlora"] = c["lora"]
        c["quantized"] = c["matmul"] - c["head"]  # memlab.lora.qlora_model: every nn.Linear but lm_head
        counts[depth] = c
    ext = {k: counts[1][k] + (counts[2][k] - counts[1][k]) * (L - 1) for k in counts[1]}
    d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or getattr(cfg, "d_model")
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head")
    return ModelShape(n_layers=L, d_model=int(d), n_heads=int(heads), matmul_params=ext["matmul"],
                  block_matmul_params=ext["matmul"] - ext["head"], all_params=ext["all"],
                  trainable={a: ext[a] for a in ADAPTERS}, quantized=ext["quantized"])


# --------------------------------------------------------------------------------------
# Estimating one stack (traced on fake tensors by memlab.estimate)
# --------------------------------------------------------------------------------------


def _affine_estimate(a: Any, b: Any, d1: int, d2: int, n: int) -> Any | None:
    """The estimate at depth ``n`` from estimates at depths d1 < d2, when affine (else None)."""
    from memlab.estimate import CATEGORIES

    if list(a.phase_breakdowns) != list(b.phase_breakdowns) or set(a.host_breakdown) != set(b.host_breakdown):
        return None

    def lin(x: int, y: int) -> int:
        slope, rem = divmod(y - x, d2 - d1)
        if rem:
            raise ArithmeticError
        return x + slope * (n - d1)

    try:
        phase_bd = {ph: {k: lin(a.phase_breakdowns[ph][k], b.phase_breakdowns[ph][k]) for k in CATEGORIES}
                    for ph in b.phase_breakdowns}
        host = {k: lin(a.host_breakdown[k], b.host_breakdown[k]) for k in b.host_breakdown}
        n_params = lin(a.n_params, b.n_params)
        end = {k: lin(a.breakdown_end[k], b.breakdown_end[k]) for k in CATEGORIES}
    except ArithmeticError:
        return None
    phases = {ph: sum(bd.values()) for ph, bd in phase_bd.items()}
    if not phases or any(v < 0 for v in phases.values()):
        return None
    peak = max(phases.values())
    phase = next(ph for ph, v in phases.items() if v == peak)
    return dataclasses.replace(
        b, n_params=n_params, peak_bytes=peak, breakdown=phase_bd[phase], breakdown_end=end, peak_phase=phase,
        phase_peaks=phases, phase_breakdowns=phase_bd, host_breakdown=host, host_bytes=sum(host.values()),
        tracker=None, extrapolated_from=(d1, d2))


def estimate_stack(model: Any, stack: Stack, *, seq_len: int, device: str = "cuda",
                   config_overrides: Mapping[str, Any] | None = None, lora_r: int = 16,
                   extrapolate: bool = True, loss: str = "auto") -> Any:
    """memlab.estimate's traced estimate (a :class:`memlab.estimate.MemoryEstimate`) of one
    micro-batch step of ``stack`` (batch ``stack.micro_batch`` x ``seq_len``).

    A full fine-tune with checkpointing "none" or "full" is the estimator's own case (a preset
    traced at two depths and extrapolated by layer count). LoRA, QLoRA and "every-k" are traced on
    a model built by a callable (memlab.lora / memlab.quant applied to the fake model, checkpointing
    switched on layer by layer), at two depths that are multiples of k and extrapolated the same way
    (checked against the full trace in tests/test_plan.py); ``extrapolate=False`` traces every layer.
    ``loss``: the estimator's (``"auto"``: transformers' own loss, as the Trainer computes it;
    ``"memlab"``: :func:`memlab.models.lm_loss`, the loss :class:`memlab.train.BudgetTrainer` runs).
    """
    name, cfg = _resolve_config(model, config_overrides)
    return _estimate(name, cfg, stack, seq_len=seq_len, device=device, lora_r=lora_r, extrapolate=extrapolate, loss=loss)


_CACHE: dict[tuple, Any] = {}
_CACHE_MAX = 512
_SOURCES_HASH: list[str] = []


def trace_cache_dir() -> Path | None:
    """Where traced estimates persist across runs: ``$MEMLAB_CACHE_DIR`` (``none`` turns the disk cache
    off), else ``$XDG_CACHE_HOME/memlab/traces``, else ``~/.cache/memlab/traces``."""
    env = os.environ.get("MEMLAB_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "none", "off") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memlab" / "traces"


def _versions() -> str:
    """Everything outside the arguments that changes a trace: the versions of memlab, torch and
    transformers, and the source of the memlab modules a trace runs (edited code re-traces)."""
    if not _SOURCES_HASH:
        import hashlib
        import importlib.metadata as md

        import torch
        import transformers

        h = hashlib.sha256()
        here = Path(__file__).resolve().parent
        for mod in ("estimate.py", "plan.py", "profiler.py", "lora.py", "quant.py", "models.py", "accounting.py"):
            f = here / mod
            h.update(f.read_bytes() if f.exists() else b"-")
        try:
            ver = md.version("memlab")
        except md.PackageNotFoundError:
            ver = "?"
        _SOURCES_HASH.append(f"memlab {ver} src {h.hexdigest()[:16]} torch {torch.__version__} "
                             f"transformers {transformers.__version__}")
    return _SOURCES_HASH[0]


def _disk_path(key: tuple) -> Path | None:
    import hashlib

    d = trace_cache_dir()
    if d is None:
        return None
    return d / (hashlib.sha256(repr((key, _versions())).encode()).hexdigest()[:32] + ".pkl")


def _estimate(name: str, cfg: Any, stack: Stack, *, seq_len: int, device: str, lora_r: int,
              extrapolate: bool = True, loss: str = "auto") -> Any:
    """The traced estimate of ``stack``'s micro-batch step, cached by (config, stack, seq_len, ...):
    the accumulation count does not change a micro-batch's peak. Cached in memory and on disk
    (:func:`trace_cache_dir`, keyed also by the versions and memlab's source), so a second
    identical ``memlab plan`` reads its traces instead of tracing again."""
    import pickle

    key = (cfg.to_json_string(use_diff=False), dataclasses.replace(stack, grad_accum=1), seq_len, device, lora_r,
           extrapolate, loss)
    if key in _CACHE:
        return _CACHE[key]
    path = _disk_path(key)
    est = None
    if path is not None and path.exists():
        try:
            with open(path, "rb") as f:
                est = pickle.load(f)
        except Exception:  # noqa: BLE001  (a torn or stale file: trace again)
            est = None
    if est is None:
        est = _trace(cfg, stack, seq_len=seq_len, device=device, lora_r=lora_r, extrapolate=extrapolate, loss=loss)
        if path is not None:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # the tracker (the trace's timeline, a local class) stays in memory; the numbers go to disk
                on_disk = dataclasses.replace(est, tracker=None) if dataclasses.is_dataclass(est) else est
                with open(tmp, "wb") as f:
                    pickle.dump(on_disk, f)
                os.replace(tmp, path)
            except Exception:  # noqa: BLE001  (read-only home, unpicklable: the cache is only a speed-up)
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = est
    return est


_QUANT_WARM = False


def _warm_quant() -> None:
    """Build memlab.quant's cached codebooks once, for real and outside any trace: built inside the
    first traced step, they would count in that trace only (2 KiB, enough to bend an extrapolation)."""
    global _QUANT_WARM
    if not _QUANT_WARM:
        import torch

        from memlab.quant import Linear4bit

        with torch.no_grad():
            Linear4bit.from_linear(torch.nn.Linear(64, 64))(torch.zeros(1, 64))
        _QUANT_WARM = True


def _trace(cfg: Any, stack: Stack, *, seq_len: int, device: str, lora_r: int, extrapolate: bool,
           loss: str = "auto") -> Any:
    from memlab.estimate import estimate_training_memory

    if stack.adapter == "qlora":
        _warm_quant()

    opt, impl, okw = _OPTIMIZER[stack.optimizer]
    kw = dict(batch_size=stack.micro_batch, seq_len=seq_len, dtype=_DTYPE[stack.precision], optimizer=opt,
              optimizer_impl=impl, optimizer_kwargs=okw, device=device, allow_longer_seq=False, loss=loss)
    if stack.checkpointing in ("none", "full"):  # the estimator's own route, adapters included (memlab.adapters)
        ad = _adapter_spec(stack, lora_r)
        return estimate_training_memory(cfg, checkpointing=stack.checkpointing == "full",
                                        attn_implementation=stack.attention, extrapolate=extrapolate,
                                        adapter=ad, **kw)
    _, L = _layers(cfg)
    unit = stack.ckpt_every if stack.checkpointing == "every-k" else 1

    def at(depth: int):
        return estimate_training_memory(_builder(_at_depth(cfg, depth), stack, lora_r), checkpointing=False,
                                        extrapolate=False, **kw)

    if extrapolate and L % unit == 0:
        traced: dict[int, Any] = {}
        # from the second unit on: with a frozen embedding the first layer's input needs no
        # gradient, so the first layer differs from the others (measured: QLoRA on a tiny Llama)
        for d1, d2 in ((2 * unit, 3 * unit), (3 * unit, 4 * unit)):
            if d2 >= L:
                break
            for d in (d1, d2):
                if d not in traced:
                    traced[d] = at(d)
            est = _affine_estimate(traced[d1], traced[d2], d1, d2, L)
            if est is not None:
                return est
    return at(L)


# --------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, by trial division up to sqrt(n)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _check_allow(allow: Mapping[str, Any] | None, batch_size: int) -> dict[str, tuple]:
    out = dict(DEFAULT_ALLOW)
    out["micro_batch"] = tuple(_divisors(batch_size))
    if allow is None:
        return out
    if not isinstance(allow, Mapping):
        raise TypeError(f"allow={allow!r} is invalid; allowed: a dict such as {{'adapter': ['full', 'lora']}} "
                        f"with keys {', '.join(DEFAULT_ALLOW)}")
    for key, values in allow.items():
        if key not in DEFAULT_ALLOW:
            raise ValueError(f"allow key {key!r} is invalid; allowed: {', '.join(map(repr, DEFAULT_ALLOW))}")
        values = (values,) if isinstance(values, (str, int)) else tuple(values)
        if not values:
            raise ValueError(f"allow[{key!r}] is empty; allowed: at least one value")
        if key in _ALLOWED_VALUES:
            for v in values:
                if v not in _ALLOWED_VALUES[key]:
                    extra = (" ('selective' is not enumerated: the estimator cannot express it, and with flash "
                             "attention there is no T x T tensor for it to drop)" if v == "selective" else "")
                    raise ValueError(f"allow[{key!r}] value {v!r} is invalid; allowed: "
                                     f"{', '.join(map(repr, _ALLOWED_VALUES[key]))}{extra}")
        elif key == "micro_batch":
            for v in values:
                if type(v) is not int or v < 1 or batch_size % v:
                    raise ValueError(f"allow['micro_batch'] value {v!r} is invalid; allowed: divisors of "
                                     f"batch_size={batch_size}: {_divisors(batch_size)}")
        elif key == "ckpt_every":
            for v in values:
                if type(v) is not int or v < 2:
                    raise ValueError(f"allow['ckpt_every'] value {v!r} is invalid; allowed: ints >= 2")
        out[key] = values
    return out


def enumerate_stacks(batch_size: int, n_layers: int, allow: Mapping[str, Any] | None = None,
                     device: str = "cuda") -> tuple[list[Stack], list[str]]:
    """Every stack the planner considers, and notes on what it leaves out and why.

    LoRA and QLoRA run bf16 mixed precision (a bf16 base, fp32 adapters under autocast, as the
    QLoRA paper trains) with AdamW, fused or not: their optimizer state is AdamW's 8 bytes per adapter
    parameter (0.3 GiB for Llama-3-8B at r=16, 41.9M adapter parameters counted by peft; 1.5 GiB for
    Llama-2-70B), small next to the base, so 8-bit or offloaded states are not searched. "every-k" takes each k of ``allow['ckpt_every']`` that divides
    the layer count (nested sets: every-4 checkpoints a subset of every-2's layers).
    """
    a = _check_allow(allow, batch_size)
    notes: list[str] = []
    ks = [k for k in a["ckpt_every"] if n_layers % k == 0 and k < n_layers]
    ks = [k for k in ks if all(max(k, j) % min(k, j) == 0 for j in ks)]
    if "every-k" in a["checkpointing"] and len(ks) < len(a["ckpt_every"]):
        notes.append(f"every-k with k in {list(a['ckpt_every'])}: only {ks} divide {n_layers} layers and nest")
    ckpts: list[tuple[str, int]] = []
    for c in a["checkpointing"]:
        if c == "every-k":
            ckpts += [("every-k", k) for k in sorted(ks, reverse=True)]
        else:
            ckpts.append((c, 1))
    optimizers = list(a["optimizer"])
    if device != "cuda" and "offload-adamw" in optimizers:
        optimizers.remove("offload-adamw")
        notes.append("offload-adamw left out: on a CPU the host is the device")
    out: list[Stack] = []
    for adapter in a["adapter"]:
        for precision in a["precision"]:
            if adapter != "full" and precision not in ("bf16-mixed", "fp16-mixed"):
                continue
            for attention in a["attention"]:
                if attention == "flash" and (device != "cuda" or precision == "fp32"):
                    continue
                for ck, k in ckpts:
                    for opt in optimizers:
                        if adapter != "full" and opt not in ("adamw", "adamw-fused"):
                            continue
                        for mb in a["micro_batch"]:
                            out.append(Stack(precision=precision, checkpointing=ck, ckpt_every=k, optimizer=opt,
                                             adapter=adapter, attention=attention, micro_batch=mb,
                                             grad_accum=batch_size // mb))
    if any(ad != "full" for ad in a["adapter"]):
        notes.append("LoRA/QLoRA: bf16 base under bf16 autocast, fp32 adapters on every linear layer but lm_head, "
                     "AdamW / fused AdamW only (their AdamW state is 8 B per adapter parameter: 0.3 GiB for an 8B model at "
                     "r=16, small next to the base)")
    if "flash" in a["attention"] and device != "cuda":
        notes.append("flash attention left out: a CUDA kernel")
    return out, notes


def _ckpt_set(s: Stack, n_layers: int) -> frozenset:
    if s.checkpointing == "full":
        return frozenset(range(n_layers))
    if s.checkpointing == "every-k":
        return frozenset(range(0, n_layers, s.ckpt_every))
    return frozenset()


def _family(s: Stack) -> tuple:
    return (s.adapter, s.precision, s.attention)


def _needs_at_least(c: Stack, d: Stack, n_layers: int) -> bool:
    """True when ``c`` holds at least ``d``'s device memory by construction: the same family, a
    micro-batch at least as large, a subset of d's checkpointed layers, an optimizer that keeps
    at least as much."""
    return (_family(c) == _family(d) and c.micro_batch >= d.micro_batch
            and _ckpt_set(c, n_layers) <= _ckpt_set(d, n_layers)
            and _opt_ge(c.optimizer, d.optimizer))


@dataclass
class PlanRow:
    """One stack: its estimated peak (what is compared with the budget: the reserved estimate on
    a CUDA target, the tensor peak on a CPU), whether it fits, its relative cost and notes.

    ``status``: "traced" (estimated), "exceeds" (not traced: it needs at least the memory of a
    traced stack that does not fit), "dominated" (not traced: a stack of the same family needs no
    more memory and ranks no lower) or "not needed" (not traced: ranked below the stacks found).
    ``stack_id`` is its place in the order of the ranking key (the table's "rank")."""

    stack: Stack
    cost: float
    tier: int
    peak_bytes: int | None = None
    fits: bool | None = None
    status: str = "not needed"
    host_bytes: int = 0
    phase: str = ""
    notes: str = ""
    terms: dict[str, float] = field(default_factory=dict, repr=False)
    stack_id: int = 0  # its place in the ranking order (the table's "rank")
    key: tuple[int, float] = (0, 0.0)  # the ranking key: (fidelity tier, cost), or (0, cost) with prefer="cost"


def stack_label(s: Stack) -> str:
    """A short name: ``"qlora bf16-mixed adamw-fused ckpt all mb 4x4"`` (micro-batch x accumulation)."""
    ck = {"none": "no ckpt", "full": "ckpt all"}.get(s.checkpointing, f"ckpt 1/{s.ckpt_every}")
    ad = "" if s.adapter == "full" else f"{s.adapter} "
    at = "" if s.attention == "sdpa" else f" {s.attention}"
    return f"{ad}{s.precision} {s.optimizer} {ck}{at} mb {s.micro_batch}x{s.grad_accum}"


@dataclass
class PlanResult:
    """What :func:`plan` found. ``rows`` are ranked: the stacks that fit (by fidelity tier, then
    relative cost), then those traced that do not (by peak), then those ruled out without a trace,
    then those not needed. ``pick`` is the first row that fits, or None."""

    model: str
    n_params: int
    batch_size: int
    seq_len: int
    budget: int
    budget_label: str
    device: str
    cost_model: CostModel
    rows: list[PlanRow]
    notes: list[str]
    seconds: float
    traces: int
    prefer: str = "fidelity"

    @property
    def pick(self) -> PlanRow | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None

    @property
    def feasible(self) -> list[PlanRow]:
        return [r for r in self.rows if r.fits]

    @property
    def verdict(self) -> str:
        from memlab.accounting import format_bytes

        if self.pick is not None:
            p = self.pick
            host = f", needs {format_bytes(p.host_bytes)} of host memory for offloaded state"
            return (f"pick: {stack_label(p.stack)}: {format_bytes(p.peak_bytes)} estimated of {format_bytes(self.budget)}"
                    f"{host}, relative cost {p.cost:.2f} ({_TIER_TEXT[p.tier]})")
        traced = [r for r in self.rows if r.status == "traced"]
        if not traced:
            return f"nothing fits {format_bytes(self.budget)}: no stack was traced"
        low = min(traced, key=lambda r: r.peak_bytes)
        return (f"nothing fits {format_bytes(self.budget)}: the smallest estimate is {format_bytes(low.peak_bytes)} "
                f"({stack_label(low.stack)}); allow more (adapters, offload, checkpointing), a shorter sequence, or more GPUs (chapter 08)")

    def table(self, limit: int | None = 12) -> str:
        from memlab.accounting import format_bytes

        head = ("rank", "stack", "peak", "fits", "rel. cost", "tier", "host", "notes")
        rows = [head]
        shown = self.rows if limit is None else self.rows[:limit]
        for r in shown:
            rows.append((str(r.stack_id), stack_label(r.stack), format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-",
                         {True: "yes", False: "no", None: "?"}[r.fits], f"{r.cost:.2f}", str(r.tier),
                         format_bytes(r.host_bytes) if r.status == "traced" else "-", r.notes))
        widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
        lines = []
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if i in (1, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        if limit is not None and len(self.rows) > limit:
            lines.append(f"... {len(self.rows) - limit} more rows (table(limit=None) / --all)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def resolve_budget(budget: Any, gpu: Any = None, device: str = "cuda") -> tuple[int, str]:
    """(bytes, label) of :func:`plan`'s ``budget`` / ``gpu`` arguments (see there)."""
    from memlab import estimate as E
    from memlab import gpus
    from memlab.accounting import format_bytes

    if budget is None and gpu is None:
        raise ValueError("budget=None and gpu=None; allowed: a budget (bytes, '24GiB', '24GB') or a gpu "
                         f"({', '.join(gpus.gpu_names())})")
    if budget is not None:
        if isinstance(budget, str) and gpus.find_gpu(budget) is not None:
            label, usable = E.resolve_gpu(budget)
            return usable, label
        try:
            b = E.parse_size(budget)
        except ValueError:
            raise ValueError(f"budget={budget!r} is invalid; allowed: a number of bytes, a size with a unit "
                             f"('24GiB' = 24 x 2**30, '24GB' = 24 x 10**9) or a card "
                             f"({', '.join(gpus.gpu_names())})") from None
        text = f"{format_bytes(b)}"
        if isinstance(budget, str) and budget.strip().lower().endswith(("kb", "mb", "gb", "tb")):
            text += f" ({budget.strip()}, decimal units)"
        return b, text + " budget"
    try:
        label, usable = E.resolve_gpu(gpu)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return usable, label


DEFAULT_HOST_BUDGET = 64 * 2**30  # where the machine's memory cannot be read: a workstation's, change it


def host_available_bytes() -> tuple[int, str]:
    """(bytes, where from) of this machine's available memory: MemAvailable in /proc/meminfo (Linux),
    else psutil's ``virtual_memory().available`` if psutil is installed, else
    :data:`DEFAULT_HOST_BUDGET` (a stated default a learner can change)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine's MemAvailable (/proc/meminfo)"
    except OSError:
        pass
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.virtual_memory().available), "this machine's available memory (psutil)"
    except Exception:  # noqa: BLE001  (not installed, or no reading on this platform)
        return DEFAULT_HOST_BUDGET, "memlab.plan.DEFAULT_HOST_BUDGET (this machine's memory could not be read)"


def _allow_for_card(gpu: Any, allow: Mapping[str, Any] | None) -> tuple[Mapping[str, Any] | None, str | None]:
    """A card without bf16 (memlab.gpus.CAPABILITIES): its precisions are fp32 and fp16 mixed precision."""
    from memlab import gpus

    caps = gpus.capability(gpu) if gpu is not None else None
    if caps is None or caps.bf16:
        return allow, None
    asked = list((allow or {}).get("precision", []))
    bad = [p for p in asked if p in ("bf16-mixed", "bf16")]
    if bad:
        raise ValueError(f"allow['precision'] value {bad[0]!r} is invalid for gpu={gpu!r}: {caps.name} (compute "
                         f"capability {caps.sm[0]}.{caps.sm[1]}) has no bf16; allowed: 'fp32', 'fp16-mixed'")
    out = dict(allow or {})
    out.setdefault("precision", ["fp32", "fp16-mixed"])
    return out, (f"{caps.name}: compute capability {caps.sm[0]}.{caps.sm[1]}, no bf16 ({caps.source}): fp16 mixed "
                 "precision (fp16 autocast, fp32 master weights, dynamic loss scaling; chapter 03) instead of bf16")


def plan(
    model: Any,
    budget: int | str | None = None,
    *,
    batch_size: int,
    seq_len: int,
    gpu: str | None = None,
    allow: Mapping[str, Any] | None = None,
    device: str = "cuda",
    top: int = 5,
    prefer: str = "fidelity",
    cost: CostModel | None = None,
    lora_r: int = 16,
    config_overrides: Mapping[str, Any] | None = None,
    host_budget: int | str | None = "auto",
    loss: str = "auto",
    progress: bool = False,
) -> PlanResult:
    """The cheapest training stacks of ``model`` whose estimated peak fits ``budget``.

    ``model``: a preset of :data:`memlab.models.PRESETS`, a config.json path or a transformers
    config. ``budget``: bytes, a size (``"24GiB"``, ``"24GB"`` = 24 x 10**9) or a card name; or
    leave it out and name ``gpu``: the card's memory as its driver reports it, minus the CUDA
    context (:func:`memlab.estimate.resolve_gpu`). ``gpu`` also picks the cost constants
    (:data:`GPU_SPECS`). ``batch_size`` is the effective batch: a micro-batch m runs
    ``batch_size // m`` accumulation steps. ``device``: "cuda" compares the estimator's reserved
    bytes (tensors + cuBLAS workspaces, x the fragmentation margin) with the budget; "cpu" the
    traced tensor peak.

    Each stack's peak is traced by :func:`memlab.estimate.estimate_training_memory` on fake tensors
    (:func:`estimate_stack`), never a formula. Ranking: ``prefer="fidelity"`` orders by
    :func:`fidelity_tier` first (a full AdamW update before a rounded one, before LoRA, before
    QLoRA) and then by :func:`stack_cost`; ``prefer="cost"`` by the cost alone.

    The search traces as little as it can. Costs need no trace, so the candidates are visited
    cheapest first; a candidate that needs at least the memory of a traced stack that did not fit
    (same adapter, precision and attention; a micro-batch at least as large; a subset of its
    checkpointed layers; an optimizer that keeps at least as much) is ruled out untraced; the
    smallest stack of each family is traced first, so a family that cannot fit costs one trace;
    the search stops after ``top`` stacks that fit (the first of them is the cheapest that fits).
    ``loss`` is the estimator's (see :func:`estimate_stack`). ``host_budget`` (bytes or a size) also bounds the host memory of offloaded stacks
    (``MemoryEstimate.host_bytes``: fp32 master weights, gradient slots and moments); by default
    (``"auto"``) this machine's available memory (:func:`host_available_bytes`: MemAvailable from
    /proc/meminfo, or psutil, else :data:`DEFAULT_HOST_BUDGET`), ``None`` for no bound. A card
    without bf16 (``gpu``: T4, V100 ..., :data:`memlab.gpus.CAPABILITIES`) gets fp16 mixed precision
    instead of the bf16 precisions.
    """
    t0 = time.perf_counter()
    for arg, val in (("batch_size", batch_size), ("seq_len", seq_len), ("top", top), ("lora_r", lora_r)):
        if type(val) is not int or val < 1:
            raise ValueError(f"{arg}={val!r} is invalid; allowed: an int >= 1")
    from memlab.estimate import check_input_bounds

    check_input_bounds(batch_size, seq_len)  # before any work: a huge batch or sequence is refused here
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} is invalid; allowed: 'cuda', 'cpu'")
    if loss not in ("auto", "hf", "memlab"):
        raise ValueError(f"loss={loss!r} is invalid; allowed: 'auto', 'hf', 'memlab'")
    if prefer not in ("fidelity", "cost"):
        raise ValueError(f"prefer={prefer!r} is invalid; allowed: 'fidelity', 'cost'")
    if gpu is not None and device != "cuda":
        raise ValueError(f"gpu={gpu!r} with device={device!r}: a card is a CUDA target; allowed: device='cuda'")
    budget_bytes, budget_label = resolve_budget(budget, gpu, device)
    from memlab.accounting import format_bytes
    from memlab.estimate import parse_size

    host_budget_bytes, host_note = None, None
    if isinstance(host_budget, str) and host_budget == "auto":
        host_budget_bytes, where = host_available_bytes()
        host_note = (f"host budget {format_bytes(host_budget_bytes)}: {where} (offloaded stacks keep their optimizer "
                     f"on the host; change it with host_budget= / --host-budget SIZE, or 'none' for no bound)")
    elif host_budget is not None and not (isinstance(host_budget, str) and host_budget.lower() == "none"):
        try:
            host_budget_bytes = parse_size(host_budget)
        except ValueError:
            raise ValueError(f"host_budget={host_budget!r} is invalid; allowed: bytes, a size such as '128GiB', "
                             "'auto' (this machine's available memory) or None / 'none' (no bound)") from None
    if cost is None:
        cost, cost_note = _cost_model_for(gpu if gpu is not None else budget)
    else:
        cost_note = None
    name, cfg = _resolve_config(model, config_overrides)
    _, L = _layers(cfg)
    from memlab.estimate import _check_positions, _Spec

    _check_positions(_Spec(name, config=cfg), seq_len, False)
    shape = model_shape(cfg, lora_r)
    allow, card_note = _allow_for_card(gpu, allow)
    stacks, notes = enumerate_stacks(batch_size, L, allow, device)
    if card_note:
        notes.append(card_note)
    if host_note:
        notes.append(host_note)
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if device == "cuda" and heads and kv and kv < heads:
        # fp32 with grouped KV heads runs SDPA's math kernel on CUDA (T x T probabilities kept); the
        # estimator models that from the config, which a callable-built model (every-k) does not pass
        dropped = [s for s in stacks if s.precision == "fp32" and s.checkpointing == "every-k"]
        if dropped:
            stacks = [s for s in stacks if s not in dropped]
            notes.append(f"fp32 with every-k left out ({len(dropped)} stacks): with grouped KV heads CUDA runs the math "
                         f"attention kernel, which the estimator models only for a full fine-tune traced from the config")
    if not stacks:
        raise ValueError(f"allow={dict(allow or {})!r} leaves no stack to try (LoRA/QLoRA need bf16-mixed or "
                         f"fp16-mixed and adamw or adamw-fused; flash needs device='cuda' and 16-bit)")
    if cost_note:
        notes.append(cost_note)
    notes.append(f"cost constants: {cost.name}: {cost.source}; mfu {cost.mfu}, host {cost.host / 1e9:.0f} GB/s, "
                 f"kernel launch {cost.launch * 1e6:.0f} us x {cost.kernels_per_layer} per layer and pass (assumptions)")
    rows = []
    for s in stacks:
        c, terms = stack_cost(s, shape, seq_len, cost)
        tier = fidelity_tier(s)
        rows.append(PlanRow(stack=s, cost=c, tier=tier, terms=terms, key=(tier if prefer == "fidelity" else 0, c)))
    rows.sort(key=lambda r: r.key)

    failed: list[PlanRow] = []
    fitted: list[PlanRow] = []
    traces = 0

    def trace(r: PlanRow) -> None:
        nonlocal traces
        est = _estimate(name, cfg, r.stack, seq_len=seq_len, device=device, lora_r=lora_r, loss=loss)
        traces += 1
        need = est.reserved_bytes if device == "cuda" else est.peak_bytes
        r.peak_bytes, r.fits, r.status = int(need), need <= budget_bytes, "traced"
        r.host_bytes, r.phase = est.host_bytes, est.peak_phase
        r.notes = f"peak in {est.peak_phase}" + (", extrapolated" if est.extrapolated_from else "")
        (fitted if r.fits else failed).append(r)
        if r.fits and host_budget_bytes is not None and r.host_bytes > host_budget_bytes:
            # fits the device, not the host: the device-memory order says nothing about it
            fitted.remove(r)
            r.fits = False
            r.notes += f"; host {format_bytes(r.host_bytes)} > host budget {format_bytes(host_budget_bytes)}"

    def known(r: PlanRow) -> bool | None:
        """Whether r fits, as far as the traces so far decide it (None: not decided)."""
        if r.status == "traced":
            return r.fits
        for f in failed:
            if _needs_at_least(r.stack, f.stack, L):
                r.fits, r.status, r.notes = False, "exceeds", f"needs at least the peak of #{f.stack_id} (> budget): not traced"
                return False
        if any(_needs_at_least(d.stack, r.stack, L) for d in fitted):
            return True
        return None

    # 1. Dominated stacks: another of the same family needs no more memory and ranks no lower.
    live = []
    for i, r in enumerate(rows):
        r.stack_id = i + 1
        dom = next((d for d in rows[:i] if d.stack != r.stack and _needs_at_least(r.stack, d.stack, L)), None)
        if dom is not None:
            r.status, r.notes = "dominated", f"never better than #{dom.stack_id} (no less memory, no lower rank): not traced"
        else:
            live.append(r)
    lines: dict[tuple, list[PlanRow]] = {}
    for r in live:
        lines.setdefault((_family(r.stack), r.stack.optimizer, r.stack.checkpointing, r.stack.ckpt_every), []).append(r)
    for members in lines.values():
        members.sort(key=lambda r: r.stack.micro_batch)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(live), desc=f"plan {name}", unit="stack", leave=False)
    # 2. The floor of each family (the smallest micro-batch, the most checkpointing, the leanest
    # optimizer): every member needs at least its memory, so if it does not fit, none does (only
    # where offload-adamw is allowed: the one optimizer below all others).
    families: dict[tuple, list[PlanRow]] = {}
    for r in live:
        families.setdefault(_family(r.stack), []).append(r)
    for members in sorted(families.values(), key=lambda m: min(r.key for r in m)):
        floor = min(members, key=lambda r: (r.stack.micro_batch, -len(_ckpt_set(r.stack, L)),
                                             r.stack.optimizer != "offload-adamw"))
        if all(_needs_at_least(o.stack, floor.stack, L) for o in members):
            trace(floor)
    # 3. Cheapest first. A stack not yet decided is decided by tracing, in this order, the floor of
    # its family and optimizer (the smallest micro-batch, the most checkpointing), then its line (the
    # same family, optimizer and checkpointing; micro-batches ascending, monotone in memory): the
    # smallest micro-batch first, then by bisection.
    groups: dict[tuple, list[PlanRow]] = {}
    for r in live:
        groups.setdefault((_family(r.stack), r.stack.optimizer), []).append(r)
    found = 0
    for r in live:
        if found >= top:
            break
        while known(r) is None:
            group = groups[(_family(r.stack), r.stack.optimizer)]
            floor = min(group, key=lambda m: (m.stack.micro_batch, -len(_ckpt_set(m.stack, L))))
            if all(_needs_at_least(m.stack, floor.stack, L) for m in group) and known(floor) is None:
                trace(floor)
                continue
            line = lines[(_family(r.stack), r.stack.optimizer, r.stack.checkpointing, r.stack.ckpt_every)]
            open_ = [m for m in line if known(m) is None]
            trace(open_[0] if open_[0] is line[0] else open_[len(open_) // 2])
        if r.status != "traced" and known(r):
            trace(r)
        found += bool(r.fits)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for r in live:
        if r.status == "not needed":
            r.notes = "not traced: ranked below the stacks found"

    order = {"traced": 0, "exceeds": 1, "dominated": 2, "not needed": 3}
    feasible = sorted((r for r in rows if r.fits and r.status == "traced"), key=lambda r: r.key)
    over = sorted((r for r in rows if r.status == "traced" and not r.fits), key=lambda r: r.peak_bytes)
    rest = sorted((r for r in rows if r.status != "traced"), key=lambda r: (order[r.status], r.key))
    for r in rest:
        if r.status in ("dominated", "not needed"):
            r.fits = None
    n_params = shape.all_params
    return PlanResult(model=name, n_params=n_params, batch_size=batch_size, seq_len=seq_len, budget=budget_bytes,
                      budget_label=budget_label, device=device, cost_model=cost, rows=feasible + over + rest,
                      notes=notes, seconds=time.perf_counter() - t0, traces=traces, prefer=prefer)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


from memlab.cli_args import _allow_arg  # noqa: E402,F401  (the parser lives in memlab.cli_args, torch-free)


def main(argv: Sequence[str] | None = None) -> int:
    """``memlab plan MODEL --gpu CARD | --budget SIZE --batch-size B --seq-len T``: the ranked stacks."""
    from memlab.cli_args import plan_parser

    parser = plan_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    allow: dict[str, list] = {}
    for k, v in args.allow:
        allow.setdefault(k, []).extend(v)
    try:
        res = plan(args.model, args.budget, batch_size=args.batch_size, seq_len=args.seq_len, gpu=args.gpu,
                   allow=allow or None, device=args.device, top=args.top, prefer=args.prefer,
                   config_overrides=dict(args.overrides) or None, host_budget=args.host_budget,
                   progress=not args.no_progress)
    except (ValueError, TypeError, FileNotFoundError, OverflowError) as exc:
        print(f"memlab plan: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # torch refused a size: one line, not C++ frames
        print(f"memlab plan: error: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
        return 2
    target = f"{args.gpu} (CUDA)" if args.gpu else ("a CUDA GPU" if args.device == "cuda" else "the CPU")
    print(f"{res.model} ({res.n_params / 1e9:.2f}B params), effective batch {res.batch_size} x seq {res.seq_len}, "
          f"for {target}")
    print(f"budget: {res.budget_label} ({res.budget:,} bytes); compared: "
          + ("reserved estimate (tensors + cuBLAS workspaces, x fragmentation margin)" if res.device == "cuda"
             else "traced tensor peak"))
    print(f"ranking: {'fidelity tier, then relative cost' if res.prefer == 'fidelity' else 'relative cost'} "
          f"(1.00 = the effective batch's 16-bit forward + backward at the cost model's MFU)\n")
    print(res.table(limit=None if args.all else 12))
    print()
    for n in res.notes:
        print(f"note: {n}")
    print(f"\n{res.traces} stacks traced on fake tensors in {res.seconds:.1f} s (of {len(res.rows)} candidates)")
    print(res.verdict)
    return 0 if res.pick is not None else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
