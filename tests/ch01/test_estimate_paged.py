"""Paged optimizers (bitsandbytes' PagedAdamW32bit / PagedAdamW8bit, issue 38): their moments of large tensors live in
CUDA unified memory, outside PyTorch's allocator; the estimate reports them apart from the allocated figure."""
from __future__ import annotations

import pytest
import torch

from memlab import estimate as E
from memlab.estimate.optim import bnb_state_bytes, paged_state_bytes
from memlab.models import tiny_llama_config


def _model():
    m = torch.nn.Sequential(torch.nn.Linear(400, 300), torch.nn.Linear(300, 10), torch.nn.Linear(10, 10))
    m[2].requires_grad_(False)
    return m


def test_paged_state_split_by_bitsandbytes_rules():
    m = _model()
    # 32-bit: two fp32 moments; the 400 x 300 weight (120,000 elements) is paged, the rest is not
    assert paged_state_bytes(m, "paged-adamw32bit") == (2 * 4 * (300 + 3000 + 10), 2 * 4 * 120_000)
    # 8-bit: the big weight's uint8 moments paged, their fp32 absmax (one per 256) not; fp32 moments below 4,096
    absmax = 2 * 4 * -(-120_000 // 256)
    assert paged_state_bytes(m, "paged-adamw8bit") == (absmax + 2 * 4 * (300 + 3000 + 10), 2 * 120_000)
    alloc, paged = paged_state_bytes(m, "paged-adamw8bit")
    assert alloc + paged == bnb_state_bytes(m)  # the same state as AdamW8bit, split by where it lives
    with pytest.raises(ValueError, match="optimizer='adamw' is invalid"):
        paged_state_bytes(m, "adamw")


def _cfg(layers=2):
    return tiny_llama_config(hidden_size=320, intermediate_size=640, num_hidden_layers=layers, vocab_size=512,
                             max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=4)


@pytest.mark.parametrize("name, canonical", [("paged_adamw_32bit", "paged-adamw32bit"),
                                             ("paged_adamw_8bit", "paged-adamw8bit")])
def test_estimate_reports_paged_state_apart(name, canonical):
    kw = dict(batch_size=1, seq_len=16, device="cuda", dtype="bf16-mixed", extrapolate=False)
    est = E.estimate_training_memory(_cfg(), optimizer=name, **kw)
    sgd = E.estimate_training_memory(_cfg(), optimizer="sgd", **kw)
    from memlab.estimate.model import resolve_model

    model = resolve_model(_cfg(), None).build("bf16-mixed", None)
    alloc, paged = paged_state_bytes(model, canonical)
    assert est.optimizer == canonical and est.optimizer_impl == "bitsandbytes, paged"
    assert paged > 0 and est.paged_bytes == paged
    assert est.allocated_bytes == sgd.allocated_bytes + alloc  # only the small tensors' state is allocator memory
    assert est.reserved_bytes >= est.allocated_bytes
    assert "paged optimizer state" in est.table() and any("unified memory" in n for n in est.notes)


def test_paged_state_extrapolates_by_depth():
    kw = dict(batch_size=1, seq_len=16, device="cuda", optimizer="paged_adamw_32bit")
    deep = E.estimate_training_memory(_cfg(8), **kw)
    whole = E.estimate_training_memory(_cfg(8), extrapolate=False, **kw)
    assert deep.extrapolated_from and deep.paged_bytes == whole.paged_bytes > 0


def test_paged_optimizers_are_refused_under_zero():
    with pytest.raises(ValueError, match="optimizer='paged-adamw8bit' is not modelled"):
        E.estimate_training_memory(_cfg(), batch_size=1, seq_len=16, device="cuda", optimizer="paged_adamw_8bit",
                                   world_size=2, zero_stage=1)
