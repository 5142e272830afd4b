"""The estimator's answers on a fixed set of presets, adapters and settings, as plain JSON numbers: the fixture
``estimate_golden.json`` was written by the estimator *before* its speed-ups (issue 42), and
``test_estimate_golden.py`` checks that today's code gives the same numbers to the byte.

Regenerate (only when an answer is meant to change, and say why in the commit)::

    OMP_NUM_THREADS=1 .venv/bin/python tests/ch01/estimate_golden.py
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).with_name("estimate_golden.json")

CLI = dict(batch_size=1, seq_len=2048)  # memlab estimate's defaults (device cuda, bf16-mixed, AdamW)

#: (name, model, keywords of estimate_training_memory): every preset family, both adapter kinds, CPU and CUDA targets
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("llama-2-7b", "llama-2-7b", dict(CLI)),
    ("llama-2-70b", "llama-2-70b", dict(CLI)),
    ("llama-2-7b lora", "llama-2-7b", dict(CLI, adapter="lora")),
    ("llama-3-8b qlora", "llama-3-8b", dict(CLI, adapter="qlora", lora_r=8)),
    ("gpt2 b4 s512", "gpt2", dict(batch_size=4, seq_len=512)),
    ("qwen2.5-0.5b lora cpu", "qwen2.5-0.5b", dict(batch_size=2, seq_len=256, adapter="lora", device="cpu")),
    ("mistral-7b ckpt", "mistral-7b", dict(batch_size=2, seq_len=1024, checkpointing=True)),
    ("qwen2.5-0.5b cpu", "qwen2.5-0.5b", dict(batch_size=2, seq_len=256, device="cpu")),
    ("qwen2.5-7b bf16-pure 8bit", "qwen2.5-7b", dict(batch_size=1, seq_len=512, dtype="bf16-pure",
                                                     optimizer="adamw8bit")),
    ("llama-2-13b fused zero2", "llama-2-13b", dict(batch_size=2, seq_len=512, loss="fused", world_size=4,
                                                    zero_stage=2)),
]

#: the suggestions of ``memlab estimate llama-2-7b --gpu rtx4090`` (nine traced rows and the formula rows)
SUGGEST = ("llama-2-7b", dict(CLI, gpu="rtx4090"))


def numbers(est: Any) -> dict[str, Any]:
    """The numbers of a MemoryEstimate (everything but the wording and the time it took)."""
    return dict(n_params=est.n_params, peak_bytes=est.peak_bytes, breakdown=est.breakdown,
                breakdown_end=est.breakdown_end, max_activation_bytes=est.max_activation_bytes,
                largest_layer_params=est.largest_layer_params, peak_phase=est.peak_phase, phase_peaks=est.phase_peaks,
                phase_breakdowns=est.phase_breakdowns, extras=est.extras, extrapolated_from=list(est.extrapolated_from),
                host_bytes=est.host_bytes, host_breakdown=est.host_breakdown,
                reserved_replay_bytes=est.reserved_replay_bytes, fragmentation_bytes=est.fragmentation_bytes,
                paged_bytes=est.paged_bytes, optimizer_impl=est.optimizer_impl, loss=est.loss,
                allocated_bytes=est.allocated_bytes, reserved_bytes=est.reserved_bytes)


def one_case(model: str, kw: dict[str, Any]) -> dict[str, Any]:
    from memlab.estimate import estimate_training_memory

    return numbers(estimate_training_memory(model, **kw))


def suggest_rows() -> list[dict[str, Any]]:
    from memlab.estimate import estimate_training_memory, suggestions

    model, kw = SUGGEST
    base = estimate_training_memory(model, **kw)
    run = {k: v for k, v in kw.items() if k not in ("batch_size", "seq_len")}
    return [dict(technique=s.technique, peak_bytes=s.peak_bytes, how=s.how, phase=s.phase,
                 fwd_bwd_peak=s.fwd_bwd_peak, extra_bytes=s.extra_bytes, command=s.command,
                 reserved_replay_bytes=s.reserved_replay_bytes)
            for s in suggestions(base, model, **run)]


def compute() -> dict[str, Any]:
    return dict(cases={name: one_case(model, kw) for name, model, kw in CASES}, suggestions=suggest_rows())


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
