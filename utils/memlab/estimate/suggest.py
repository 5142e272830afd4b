"""What would make it fit: each technique of the course re-estimated (traced) or, where the estimator
cannot express it, a byte formula; and the ``memlab estimate`` command that reproduces a traced row."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from memlab.core import vocab
from memlab.core.vocab import Recipe
from memlab.estimate.api import estimate_training_memory
from memlab.estimate.recipes import FRAGMENTATION_MARGIN, LOSS_ALIASES, MIXED
from memlab.estimate.result import MemoryEstimate


@dataclass
class Suggestion:
    """One technique and the peak it leads to (``how``: "traced", re-estimated, or "formula")."""

    technique: str
    peak_bytes: int
    how: str  # "traced" (re-ran the estimator) or "formula"
    chapter: str = ""
    detail: str = ""
    phase: str = ""
    fwd_bwd_peak: int = 0
    extra_bytes: int = 0  # extras on the target (cuBLAS workspaces), counted in allocated/reserved
    command: str = ""  # the memlab estimate command that reproduces a traced row ("" for a formula)
    reserved_replay_bytes: int = 0  # a traced row's reserved figure by the caching allocator's model (0: none)

    def saving(self, base: MemoryEstimate) -> int:
        """Bytes saved against ``base``: ``base.peak_bytes - self.peak_bytes``."""
        return base.peak_bytes - self.peak_bytes

    @property
    def reserved_bytes(self) -> int:
        """The reserved estimate on a CUDA target (a traced row: the caching allocator's replay; a formula row: with
        extras and the fragmentation margin), else the peak."""
        alloc = self.peak_bytes + self.extra_bytes
        if self.reserved_replay_bytes:
            return max(self.reserved_replay_bytes, alloc)
        return int(math.ceil(alloc * FRAGMENTATION_MARGIN)) if self.extra_bytes else alloc


# QLoRA (Dettmers et al. 2023, section 3): NF4 weights take 4 bits per parameter; double
# quantization brings the quantization constants to 0.127 bits per parameter.
QLORA_BITS_PER_PARAM = 4 + 0.127


def estimate_command(model: Any, **kw: Any) -> str:
    """The shell-quoted ``memlab estimate`` command line for keywords of :func:`estimate_training_memory`
    (defaults left out, recipes and optimizers in their canonical spelling; a model that is no name or
    path shows as ``MODEL``)."""
    import shlex

    from memlab.estimate import adapters

    out = ["memlab", "estimate", model if isinstance(model, str) else "MODEL"]
    flags = (("batch_size", "--batch-size", None), ("seq_len", "--seq-len", None), ("dtype", "--dtype", Recipe.BF16_MIXED.value),
             ("optimizer", "--optimizer", "adamw"), ("optimizer_impl", "--optimizer-impl", "auto"),
             ("device", "--device", "cuda"), ("loss", "--loss", "auto"), ("attn_implementation", "--attn", "auto"),
             ("world_size", "--world-size", 1), ("zero_stage", "--zero-stage", 0), ("gpu", "--gpu", None))
    canon = {"dtype": lambda v: vocab.canonical_recipe(v, argument="dtype"), "optimizer": vocab.canonical_optimizer,
             "loss": lambda v: LOSS_ALIASES.get(v, v)}
    for key, flag, default in flags:
        if key in kw and canon.get(key, lambda v: v)(kw[key]) != default:
            out += [flag, str(canon.get(key, lambda v: v)(kw[key]))]
    for key in ("checkpointing", "offload_checkpoints", "optimizer_in_backward"):
        if kw.get(key):
            out.append("--" + key.replace("_", "-"))
    if isinstance(kw.get("step"), str):
        out += ["--step", kw["step"]]
    if kw.get("allow_longer_seq"):
        out.append("--allow-longer-seq")
    if kw.get("extrapolate") is False:
        out.append("--no-extrapolate")
    if (kw.get("optimizer_kwargs") or {}).get("offload_gradients"):
        out.append("--offload-gradients")
    for k, v in (kw.get("config_overrides") or {}).items():
        out += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    ad = adapters.adapter_spec(kw.get("adapter"), recipe=canon["dtype"](kw.get("dtype", Recipe.BF16_MIXED.value)),
                                **{k: kw[k] for k in ("lora_r", "lora_alpha", "target_modules", "lora_dropout",
                                                      "adapter_dtype") if k in kw})
    if ad is not None:
        out += ad.cli_args()
    return " ".join(shlex.quote(x) for x in out)


def _fwd_bwd(est: MemoryEstimate) -> int:
    return max(est.phase_peaks.get("forward", 0), est.phase_peaks.get("backward", 0))


def suggestions(base: MemoryEstimate, model: Any, *, config_overrides: Mapping[str, Any] | None = None,
                **run_kwargs: Any) -> list[Suggestion]:
    """Techniques that lower ``base``'s peak, each with its estimated peak.

    Options the estimator has (checkpointing, the fused linear and the chunked cross-entropy, offloaded checkpoint
    inputs, the optimizer step in backward, 8-bit AdamW, the fused AdamW where the foreach one's
    temporaries set the peak, pure bf16, a smaller batch or sequence) are re-estimated ("traced"); the others use a byte formula ("formula"): CPU-offloaded AdamW (chapter 04)
    removes the optimizer state and the fp32 master copy from the GPU; LoRA (chapter 06) keeps
    the frozen weights in 16 bits with no gradients or optimizer state for them; QLoRA stores
    them in NF4. LoRA and QLoRA (rank 16, every linear layer but the head, :mod:`memlab.estimate.adapters`)
    are traced where ``base`` is a full fine-tune, QLoRA with the same adapters where it is a LoRA run; each traced row carries the ``memlab estimate``
    command that reproduces it (``Suggestion.command``).

    ``model``, ``config_overrides`` and ``run_kwargs`` (device, loss, attention, adapter settings ...) are
    what ``base`` was estimated with. The suggestions come in the order they were tried.
    """
    common = dict(batch_size=base.batch_size, seq_len=base.seq_len, dtype=base.dtype,
                  optimizer=base.optimizer, checkpointing=base.checkpointing,
                  config_overrides=config_overrides, **run_kwargs)
    out: list[Suggestion] = []
    extra = sum(base.extras.values())

    def traced(technique: str, chapter: str, **change: Any) -> MemoryEstimate:
        kw = {**common, **change}
        est = estimate_training_memory(model, **kw)
        out.append(Suggestion(technique, est.peak_bytes, "traced", chapter,
                              ", ".join(f"{k}={v}" for k, v in change.items()), est.peak_phase, _fwd_bwd(est), extra,
                              command=estimate_command(model, **kw), reserved_replay_bytes=est.reserved_replay_bytes))
        return est

    if not base.checkpointing:
        traced("gradient checkpointing", "02", checkpointing=True)
    if base.loss in ("hf", "chunked"):  # a transformers model's loss: the logits and their fp32 copies go
        traced("fused linear cross-entropy (logits never materialised)", "09", loss="fused")
    if base.loss == "hf":  # the logits made a chunk of tokens at a time (memlab.loss.chunked_cross_entropy)
        traced("chunked cross-entropy (logits a chunk of tokens at a time)", "09", loss="chunked")
    if base.checkpointing and not base.offload_checkpoints and base.device.startswith("cuda"):
        traced("offloaded checkpoint inputs (host memory)", "09", offload_checkpoints=True)
    if not base.optimizer_in_backward and base.optimizer != "offload-adamw" and run_kwargs.get("grad_accum", 1) == 1 \
            and base.world_size == 1 and base.zero_stage == 0:
        traced("optimizer step in backward (no whole gradient; no accumulation)", "09", optimizer_in_backward=True)
    if base.optimizer == "adamw" and base.optimizer_impl == "foreach" and base.peak_phase == "optimizer":
        traced("fused AdamW (no foreach temporaries)", "01", optimizer_impl="fused")
    if base.optimizer == "adamw":
        traced("8-bit AdamW (bitsandbytes)", "06", optimizer="adamw8bit")
    if base.dtype != Recipe.BF16_PURE:
        traced("pure bf16 weights and AdamW state (no fp32 master copy)", "03", dtype=Recipe.BF16_PURE.value)
    if not base.checkpointing and base.optimizer == "adamw":
        traced("gradient checkpointing + 8-bit AdamW", "02+06", checkpointing=True, optimizer="adamw8bit")
    if base.batch_size > 1:
        traced(f"batch size {base.batch_size // 2} (x2 gradient accumulation)", "", batch_size=base.batch_size // 2)
    if base.seq_len > 1:
        traced(f"sequence length {base.seq_len // 2}", "", seq_len=base.seq_len // 2)

    # Formulas, from the traced breakdowns.
    P = base.n_params
    opt_at_peak = base.breakdown.get("optimizer", 0)
    # fp32 weights that become 16-bit on the GPU (an adapter's frozen base is 16-bit already)
    master = 2 * P if base.dtype in MIXED and not base.adapter else 0
    out.append(Suggestion("CPU-offloaded AdamW (optimizer state and fp32 master weights in CPU RAM)",
                          max(base.peak_bytes - opt_at_peak - master, 0), "formula", "04",
                          "peak - optimizer state at peak" + (" - 2 bytes/param (fp32 weights kept as 16-bit)" if master else ""),
                          extra_bytes=extra))
    if base.adapter:
        if base.adapter.startswith("lora"):  # the same adapters on an NF4 base (QLoRA, chapter 06)
            traced("QLoRA (the same adapters on NF4 frozen weights)", "06", adapter="qlora")
        return out
    # LoRA / QLoRA traced (memlab.estimate.adapters): a 16-bit recipe (bf16 mixed for an fp32 run), AdamW on the adapters
    ad_kw = dict(dtype=Recipe.BF16_MIXED.value if base.dtype == Recipe.FP32 else base.dtype,
                 optimizer="adamw" if base.optimizer == "offload-adamw" else base.optimizer, optimizer_kwargs=None)
    try:
        traced("LoRA on 16-bit frozen weights (rank 16, all linear layers)", "06", adapter="lora", **ad_kw)
        traced("QLoRA (NF4 frozen weights, rank 16, all linear layers)", "06", adapter="qlora", **ad_kw)
    except ValueError:  # a model without linear layers to adapt
        pass
    return out


