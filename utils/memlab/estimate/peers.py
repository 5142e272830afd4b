"""The rules of thumb practitioners use, side by side with memlab's traced estimate.

``memlab estimate MODEL --compare`` (and :func:`compare`) answers one question -- this model, this
batch, this recipe -- four ways:

* **accelerate** ``accelerate estimate-memory`` ("Training using Adam" column): the largest of the
  model, gradient, Adam and step components of a model-size formula
  (:func:`accelerate_estimate`; Hugging Face Accelerate docs, "Model memory
  estimator", https://huggingface.co/docs/accelerate/usage_guides/model_size_estimator). Activations
  are not counted: the docs say the figure is for batch size 1 with no activations.
* **DeepSpeed** ZeRO model-state estimators (``estimate_zero2_model_states_mem_needs`` for stages
  0-2 with one GPU's share, ``estimate_zero3_model_states_mem_needs`` for stage 3;
  https://deepspeed.readthedocs.io/en/latest/memory.html): fp16 weights and gradients plus sharded
  fp32 master weights and Adam moments (:func:`deepspeed_zero_estimate`); "model
  states" only, no activations.
* **18 bytes per parameter**: Hugging Face's "Model training anatomy"
  (https://huggingface.co/docs/transformers/model_memory_anatomy): weights 4 bytes per parameter in
  fp32 training, 6 in mixed precision (an fp32 and a 16-bit copy); gradients 4; AdamW 8 (8-bit AdamW
  2, SGD with momentum 4); activations "depend on many factors" and are left out -- 18 bytes per
  parameter for mixed-precision AdamW, 16 for fp32.

Each rule is written here from its documentation (formulas, not code), so a learner can see what each
one leaves out: the activations (often most of the peak), the optimizer step's temporaries, the logits
upcast to fp32, autocast's 16-bit weight copies, and -- for LoRA/QLoRA, which none of them model -- the
frozen base. The rules answer for a full fine-tune whatever the recipe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.core import vocab
from memlab.core.units import format_bytes
from memlab.core.validation import check_choice

__all__ = ["PeerAnswer", "bytes_per_param_rule", "peer_answers", "compare", "format_compare",
           "accelerate_estimate", "deepspeed_zero_estimate", "ANATOMY_URL", "ACCELERATE_URL", "DEEPSPEED_URL"]

ANATOMY_URL = "https://huggingface.co/docs/transformers/model_memory_anatomy"
ACCELERATE_URL = "https://huggingface.co/docs/accelerate/usage_guides/model_size_estimator"
DEEPSPEED_URL = "https://deepspeed.readthedocs.io/en/latest/memory.html"


@dataclass(frozen=True)
class PeerAnswer:
    tool: str
    bytes: int
    what: str  # what the figure counts
    source: str


def bytes_per_param_rule(n_params: int, dtype: str = "bf16-mixed", optimizer: str = "adamw") -> int:
    """Model states by the "Model training anatomy" rule: (weights + gradients + optimizer) bytes per parameter.

    Weights 4 (fp32) or 6 (mixed: fp32 + 16-bit copies; 2 for pure bf16), gradients 4 (2 for pure
    bf16), AdamW 8 (2 for 8-bit AdamW, 0 for SGD without momentum; 4 for pure bf16 AdamW). ``dtype``
    and ``optimizer`` in any spelling of :mod:`memlab.core.vocab`.

    Raises:
        ValueError: an unknown recipe or optimizer.
    """
    R = vocab.Recipe
    opt = vocab.optimizer(optimizer).value
    dtype = vocab.recipe(dtype, argument="dtype")
    weights = {R.FP32: 4, R.BF16_MIXED: 6, R.FP16_MIXED: 6, R.BF16_PURE: 2}[dtype]
    grads = 2 if dtype == R.BF16_PURE else 4
    state = {"adamw": 4 if dtype == R.BF16_PURE else 8, "offload-adamw": 0, "sgd": 0, "adamw8bit": 2,
             "paged-adamw32bit": 8, "paged-adamw8bit": 2}[opt]
    return int(n_params) * (weights + grads + state)


def peer_answers(est: Any) -> list[PeerAnswer]:
    """accelerate's, DeepSpeed's and the bytes-per-parameter rule's answers to the question a
    :class:`memlab.estimate.MemoryEstimate` asks."""
    P = est.n_params
    G = max(int(getattr(est, "world_size", 1)), 1)
    stage = int(getattr(est, "zero_stage", 0))
    acc_dtype = est.dtype
    ds_stage = 3 if stage == 3 else 2
    ds = deepspeed_zero_estimate(P, stage=ds_stage, num_gpus=G if stage else 1,
                                 largest_layer_params=est.largest_layer_params,
                                 cpu_offload=est.optimizer == "offload-adamw")
    ds_what = (f"model states, ZeRO-{ds_stage} formula over {G if stage else 1} GPU(s)"
               + (" (stage 0/1 have no estimator of their own: the stage-2 one)" if stage in (0, 1) else ""))
    return [
        PeerAnswer("accelerate estimate-memory", accelerate_estimate(P, acc_dtype),
                   "largest of model / gradients / Adam / step, batch 1, no activations", ACCELERATE_URL),
        PeerAnswer("DeepSpeed ZeRO estimator", ds["gpu"], ds_what, DEEPSPEED_URL),
        PeerAnswer("bytes-per-parameter rule", bytes_per_param_rule(P, est.dtype, est.optimizer),
                   "weights + gradients + optimizer state, no activations "
                   f"({bytes_per_param_rule(1, est.dtype, est.optimizer)} bytes/param)", ANATOMY_URL),
    ]


def compare(est: Any) -> list[dict]:
    """memlab's allocated estimate beside each peer's answer: rows (tool, bytes, ratio to memlab's, what it
    counts, source), memlab's first."""
    ours = est.allocated_bytes
    rows = [dict(tool="memlab estimate (traced)", bytes=ours, ratio=1.0,
                 what="every tensor of the step, traced" + (" + cuBLAS workspaces" if est.extras else ""),
                 source="memlab.estimate")]
    for p in peer_answers(est):
        rows.append(dict(tool=p.tool, bytes=p.bytes, ratio=p.bytes / ours if ours else float("nan"),
                         what=p.what, source=p.source))
    return rows


def format_compare(est: Any) -> str:
    """:func:`compare` as the text ``memlab estimate --compare`` prints: the table and what the rules leave out."""
    rows = compare(est)
    lines = ["the same question by the rules of thumb (their formulas, from their documentation):"]
    w = max(len(r["tool"]) for r in rows)
    for r in rows:
        lines.append(f"  {r['tool']:<{w}}  {format_bytes(r['bytes']):>11}  {r['ratio']:>5.2f}x  {r['what']}")
    lines.append("  sources: " + "; ".join(f"{r['tool']}: {r['source']}" for r in rows[1:]))
    if getattr(est, "adapter", ""):
        lines.append("  none of the rules models adapters: they answer for a full fine-tune of the same model")
    lines.append(f"  what they leave out here: the activations (up to {format_bytes(est.max_activation_bytes)} during "
                 f"the step; the peak is in {est.peak_phase}), optimizer-step temporaries, the fp32 logits")
    return "\n".join(lines)


def accelerate_estimate(n_params: int, dtype: str = "bf16-mixed") -> int:
    """Training bytes by ``accelerate estimate-memory`` ("Training using Adam" column).

    accelerate 1.x (``accelerate/commands/estimate.py``, ``estimate_training_usage``) takes the
    model's fp32 size S = 4 bytes x n_params and reports the *largest* of its components:
    in fp32, model S, gradients S, Adam 2S and "step" 4S -> 4S = 16 bytes/param; in
    fp16/bf16, model S, gradients 1.5S, Adam 2S, step 2S -> 2S = 8 bytes/param. Activations
    are not counted (the docs say so: batch size 1, no activations). ``dtype``: any spelling of
    :mod:`memlab.core.vocab`.

    Raises:
        ValueError: an unknown recipe.
    """
    s = 4 * int(n_params)
    return 4 * s if vocab.recipe(dtype, argument="dtype") == vocab.Recipe.FP32 else 2 * s


def deepspeed_zero_estimate(
    n_params: int,
    *,
    stage: int = 2,
    num_gpus: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = False,
    cpu_offload_params: bool = False,
    largest_layer_params: int = 0,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> dict[str, int]:
    """Per-GPU and per-CPU bytes of the *model states* by DeepSpeed's estimators.

    The formulas of ``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/
    stage_1_and_2.py) and ``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/
    stage3.py), documented at https://deepspeed.readthedocs.io/en/latest/memory.html. With
    G = num_gpus x num_nodes and P = n_params:

    * ZeRO-2 without offload: GPU 4P + 16P/G (fp16 weights and gradients, plus the fp32 master
      weights and Adam moments sharded over G); CPU 4P x gpus per node x buffer factor.
      With offload: GPU 2P; CPU P x max(4G, 16) x buffer factor.
    * ZeRO-3 without offload: GPU 4L + 18P/G, with L the largest layer's parameters.
      Offloading the optimizer: GPU 4L + 2P/G; offloading the parameters too: GPU 4L.

    Activations and temporaries are outside these formulas ("model states" only).

    Args:
        n_params: the model's parameters (P).
        stage: 2 or 3.
        num_gpus, num_nodes: G = num_gpus x num_nodes.
        cpu_offload, cpu_offload_params: offload the optimizer (and, stage 3, the parameters).
        largest_layer_params: L, for stage 3.
        zero_init, additional_buffer_factor: DeepSpeed's arguments of the same names.

    Returns:
        ``{"gpu": bytes per GPU, "cpu": bytes of host memory}``.

    Raises:
        ValueError: a stage other than 2 or 3.
    """
    check_choice("stage", stage, (2, 3))
    P, G = int(n_params), num_gpus * num_nodes
    if stage == 2:
        if cpu_offload:
            gpu = 2 * P
            cpu = P * max(4 * G, 16) * additional_buffer_factor
        else:
            gpu = 4 * P + int(16 * P / G)
            cpu = P * 4 * num_gpus * additional_buffer_factor
        return {"gpu": int(gpu), "cpu": int(cpu)}
    L = 4 * int(largest_layer_params)
    per_node = 1 / num_nodes
    if cpu_offload:
        if cpu_offload_params:
            gpu = L
            cpu = P * (18 * per_node if zero_init else max(4 * num_gpus, 18 * per_node)) * additional_buffer_factor
        else:
            gpu = L + int(2 * P / G)
            cpu = P * (16 * per_node if zero_init else max(4 * num_gpus, 16 * per_node)) * additional_buffer_factor
    else:
        gpu = L + int(18 * P / G)
        cpu = (largest_layer_params if zero_init else P) * 4 * num_gpus * additional_buffer_factor
    return {"gpu": int(gpu), "cpu": int(cpu)}
