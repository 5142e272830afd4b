"""``memlab estimate --validate``: the estimate against published, measured peaks of real fine-tunes.

Each figure was read from its source (the URL in ``source``) with the settings the source states;
``metric`` says what the source measured, since the three metrics differ by design:

* ``allocated``: ``torch.cuda.max_memory_allocated`` -- compared with the estimate's
  ``allocated_bytes`` (traced tensors + cuBLAS workspaces);
* ``reserved``: what the caching allocator held (``max_memory_reserved``);
* ``unstated``: a peak printed without saying how (often ``nvidia-smi``, which adds the CUDA context
  and the allocator's cache) -- compared with ``allocated_bytes`` too, and flagged.

``differs`` lists what the estimate cannot reproduce of the source's run. Figures that no
setting of the estimator can reproduce are kept in :data:`NOT_COMPARABLE` with the reason, and
are not in the error table. Everything here is offline: the figures are stored, the models are
built from their published dimensions on fake tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Llama-3.2-3B's dimensions, from https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
LLAMA_3_2_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, head_dim=128)


@dataclass(frozen=True)
class Figure:
    name: str
    source: str
    measured_bytes: int
    metric: str  # "allocated", "reserved" or "unstated"
    as_published: str
    model: Any  # a preset name or a dict of LlamaConfig fields
    settings: dict = field(default_factory=dict)
    gpu: str = ""
    differs: str = ""


FIGURES: tuple[Figure, ...] = (
    Figure(
        name="PEFT method comparison: full fine-tuning, Llama-3.2-3B",
        source="https://github.com/huggingface/peft/blob/main/method_comparison/MetaMathQA/results/"
               "full-finetuning--llama-3.2-3B-lr_0.00001.json",
        measured_bytes=37_241_225_216,
        metric="allocated",
        as_published='"cuda_memory_max": 37241225216 (train_info)',
        model=LLAMA_3_2_3B,
        settings=dict(batch_size=4, seq_len=768, dtype="bf16-pure", optimizer="adamw"),
        gpu="NVIDIA L40S, torch 2.7.1, transformers 4.52.4",
        differs="cuda_memory_max is torch.cuda.max_memory_allocated() over the whole run minus what was allocated "
                "before the model loaded (method_comparison/MetaMathQA/run.py), so an evaluation pass (generation, "
                "batch 50) counts if it peaked higher; MetaMathQA batches are padded to their longest sample, at most "
                "max_seq_length=768 (the estimate uses 768); gradient clipping (max norm 1.0) adds foreach norm "
                "temporaries; attention left to transformers (sdpa)",
    ),
    Figure(
        name="universal-llm-trainer: full fine-tuning, Llama 3 8B",
        source="https://github.com/ljm565/universal-llm-trainer (README, 'GPU memory and training speed')",
        measured_bytes=78 * 2**30,
        metric="unstated",
        as_published="Peak Mem. 78 GiB (model 16 GiB), H100 x 1",
        model="llama-3-8b",
        settings=dict(batch_size=2, seq_len=8192, dtype="bf16-pure", optimizer="adamw", checkpointing=True),
        gpu="H100 80GB, torch 2.5.1, transformers 4.49.0",
        differs="the metric is not stated (78 GiB on an 80 GB card is likely nvidia-smi or reserved memory, "
                "which add the CUDA context and the allocator cache); gradient clipping not stated",
    ),
)

NOT_COMPARABLE: tuple[tuple[str, str, str], ...] = (
    ("torchtune README: Llama 3.1 8B full fine-tune on 1x RTX 4090, batch 2 x 2048, 18.9 GiB",
     "https://github.com/pytorch/torchtune/blob/main/README.md",
     "recipes/configs/llama3_1/8B_full_single_device.yaml steps the optimizer inside backward (optimizer_in_bwd: "
     "gradients never all alive), keeps bitsandbytes PagedAdamW8bit state in paged (unified) memory and uses "
     "LinearCrossEntropyLoss (no full logits); the README adds torch.compile: none of these is a setting of the estimator"),
    ("litgpt resource tables: LoRA Llama 2 7B, micro-batch 1, 21.30 GB (A100 40GB)",
     "https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md",
     "LoRA is a byte formula in the estimator's suggestions, not a traced step; Alpaca samples vary in length"),
)


def validate() -> list[dict]:
    """One row per figure: the estimate next to the published peak, and the signed error."""
    from transformers import LlamaConfig

    from memlab.estimate import estimate_training_memory

    rows = []
    for fig in FIGURES:
        model = LlamaConfig(**fig.model) if isinstance(fig.model, dict) else fig.model
        est = estimate_training_memory(model, device="cuda", **fig.settings)
        ours = est.allocated_bytes if fig.metric in ("allocated", "unstated") else est.reserved_bytes
        rows.append(dict(figure=fig, estimate=est, compared_bytes=ours,
                         error=(ours - fig.measured_bytes) / fig.measured_bytes))
    return rows


def main(model_filter: str | None = None) -> int:
    from memlab.accounting import format_bytes

    rows = validate()
    if model_filter:
        rows = [r for r in rows if model_filter.lower() in r["figure"].name.lower()]
    print("memlab estimate --validate: the estimate against published peaks of real fine-tunes (offline)\n")
    for i, r in enumerate(rows, 1):
        f, est = r["figure"], r["estimate"]
        s = f.settings
        print(f"{i}. {f.name}")
        print(f"   source: {f.source}")
        print(f"   published: {f.as_published} [{f.metric}] on {f.gpu}")
        print(f"   settings: batch {s['batch_size']} x {s['seq_len']}, {s['dtype']}, {s['optimizer']}"
              f"{', checkpointing' if s.get('checkpointing') else ''}; attention: {est.attention}")
        print(f"   estimate: {format_bytes(est.peak_bytes)} tensors + {format_bytes(est.allocated_bytes - est.peak_bytes)} "
              f"cuBLAS = {format_bytes(r['compared_bytes'])} allocated (peak in {est.peak_phase})")
        print(f"   differs: {f.differs}")
        print(f"   error: {100 * r['error']:+.1f}%\n")
    if rows:
        worst = max(rows, key=lambda r: abs(r["error"]))
        widths = max(len(r["figure"].name) for r in rows)
        print(f"{'figure':<{widths}}  {'metric':<9}  {'published':>10}  {'estimate':>10}  error")
        for r in rows:
            print(f"{r['figure'].name:<{widths}}  {r['figure'].metric:<9}  {format_bytes(r['figure'].measured_bytes):>10}  "
                  f"{format_bytes(r['compared_bytes']):>10}  {100 * r['error']:+.1f}%")
        alloc = [r for r in rows if r["figure"].metric == "allocated"]
        if alloc:
            w = max(alloc, key=lambda r: abs(r["error"]))
            print(f"\nworst error on allocated figures: {100 * w['error']:+.1f}% ({w['figure'].name}); target: within 3%")
        print(f"worst error on all figures: {100 * worst['error']:+.1f}% ({worst['figure'].name})")
    print("\ncollected but not comparable (not in the table):")
    for name, url, why in NOT_COMPARABLE:
        print(f"  - {name} ({url}): {why}")
    return 0
