"""Estimates traced on CUDA fake tensors, to compare with the same estimates traced on CPU (kernel modelled).
A one-off probe of the H100 session of 2026-11-23, whose output is ../estimator_cuda_trace.json
(the same cases traced on CPU: ../estimator_cpu_trace_same_cases.json).

python3 results/h100/probes/gpu_estimator_check.py > out.json   (from the repository root, on a GPU machine)
"""
import json
import sys

sys.path.insert(0, "utils")
from memlab.estimate import estimate_training_memory  # noqa: E402
from memlab.models import tiny_llama_config  # noqa: E402

CASES = [
    ("llama-2-7b", dict(batch_size=8, seq_len=4096, dtype="bf16")),
    ("llama-2-7b", dict(batch_size=1, seq_len=2048, dtype="bf16")),
    ("llama-2-7b", dict(batch_size=8, seq_len=4096, dtype="bf16", attn_implementation="eager")),
    ("llama-3-8b", dict(batch_size=2, seq_len=8192, dtype="bf16-pure", checkpointing=True)),
    ("tiny-gqa-fp32", dict(batch_size=2, seq_len=256, dtype="fp32", attn_implementation="sdpa")),
    ("tiny-mha-fp32", dict(batch_size=2, seq_len=256, dtype="fp32", attn_implementation="sdpa")),
]


def model(name):
    if name == "tiny-gqa-fp32":
        return tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=2, vocab_size=4096)
    if name == "tiny-mha-fp32":
        return tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=8, vocab_size=4096)
    return name


out = []
for name, kw in CASES:
    e = estimate_training_memory(model(name), device="cuda", **kw)
    out.append(dict(model=name, kw=kw, traced_on=e.traced_on, peak=e.peak_bytes, breakdown=e.breakdown,
                    phase_peaks=e.phase_peaks, peak_phase=e.peak_phase, attention=e.attention,
                    extrapolated=list(e.extrapolated_from)))
print(json.dumps(out, indent=1))
