"""The rules of thumb practitioners use, side by side with memlab's traced estimate.

``memlab estimate MODEL --compare`` (and :func:`compare`) answers one question -- this model, this
batch, this recipe -- four ways:

* **accelerate** ``accelerate estimate-memory`` ("Training using Adam" column): the largest of the
  model, gradient, Adam and step components of a model-size formula
  (:func:`memlab.estimate.accelerate_estimate`; Hugging Face Accelerate docs, "Model memory
  estimator", https://huggingface.co/docs/accelerate/usage_guides/model_size_estimator). Activations
  are not counted: the docs say the figure is for batch size 1 with no activations.
* **DeepSpeed** ZeRO model-state estimators (``estimate_zero2_model_states_mem_needs`` for stages
  0-2 with one GPU's share, ``estimate_zero3_model_states_mem_needs`` for stage 3;
  https://deepspeed.readthedocs.io/en/latest/memory.html): fp16 weights and gradients plus sharded
  fp32 master weights and Adam moments (:func:`memlab.estimate.deepspeed_zero_estimate`); "model
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

__all__ = ["PeerAnswer", "bytes_per_param_rule", "peer_answers", "compare", "format_compare",
           "ANATOMY_URL", "ACCELERATE_URL", "DEEPSPEED_URL"]

ANATOMY_URL = "https://huggingface.co/docs/transformers/model_memory_anatomy"
ACCELERATE_URL = "https://huggingface.co/docs/accelerate/usage_guides/model_size_estimator"
DEEPSPEED_URL = "https://deepspeed.readthedocs.io/en/latest/memory.html"


@dataclass(frozen=True)
class PeerAnswer:
    tool: str
    bytes: int
    what: str  # what the figure counts
    source: str


def bytes_per_param_rule(n_params: int, dtype: str = "bf16", optimizer: str = "adamw") -> int:
    """Model states by the "Model training anatomy" rule: (weights + gradients + optimizer) bytes per
    parameter; weights 4 (fp32) or 6 (mixed: fp32 + 16-bit copies; 2 for pure bf16), gradients 4
    (2 for pure bf16), AdamW 8 (2 for 8-bit AdamW, 0 for SGD without momentum; 4 for pure bf16 AdamW)."""
    from memlab.estimate import OPTIMIZERS, _canonical_optimizer

    optimizer = _canonical_optimizer(optimizer)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is invalid; allowed: {', '.join(map(repr, OPTIMIZERS))}")
    weights = {"fp32": 4, "bf16": 6, "fp16": 6, "bf16-pure": 2}
    if dtype not in weights:
        raise ValueError(f"dtype={dtype!r} is invalid; allowed: {', '.join(map(repr, weights))}")
    grads = 2 if dtype == "bf16-pure" else 4
    opt = {"adamw": 4 if dtype == "bf16-pure" else 8, "offload-adamw": 0, "sgd": 0, "adamw8bit": 2}[optimizer]
    return int(n_params) * (weights[dtype] + grads + opt)


def peer_answers(est: Any) -> list[PeerAnswer]:
    """What each rule of thumb says for the question ``est`` (a :class:`memlab.estimate.MemoryEstimate`) asks."""
    from memlab.estimate import accelerate_estimate, deepspeed_zero_estimate

    P = est.n_params
    G = max(int(getattr(est, "world_size", 1)), 1)
    stage = int(getattr(est, "zero_stage", 0))
    acc_dtype = est.dtype if est.dtype in ("fp32", "bf16", "fp16", "bf16-pure") else "bf16"
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
    """Rows: memlab's allocated estimate, then each peer's answer with its ratio to memlab's."""
    ours = est.allocated_bytes
    rows = [dict(tool="memlab estimate (traced)", bytes=ours, ratio=1.0,
                 what="every tensor of the step, traced" + (" + cuBLAS workspaces" if est.extras else ""),
                 source="memlab.estimate")]
    for p in peer_answers(est):
        rows.append(dict(tool=p.tool, bytes=p.bytes, ratio=p.bytes / ours if ours else float("nan"),
                         what=p.what, source=p.source))
    return rows


def format_compare(est: Any) -> str:
    from memlab.accounting import format_bytes

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
