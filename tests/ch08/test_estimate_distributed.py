"""memlab estimate --world-size N --zero-stage 0|1|2|3 against ranks measured with 2 gloo processes on CPU.

Measured: memlab.distributed.train_rank (tiny Llama, fp32 AdamW, a batch of 2 x 32 per rank) under
stage 0 (data parallel), 1 and 2 (memlab's ZeroOptimizer) and 3 (FSDP2), the last step tracked on
each rank. Estimated: stages 0-2, the same step traced once on fake tensors and sharded by stage
(memlab.estimate.shard_estimate); stage 3, the step traced with FSDP2 itself (fully_shard on fake
tensors under a fake process group, tracked as memlab.distributed.rank_tracker tracks a real rank).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from memlab import distributed as D
from memlab.cli.estimate import main
from memlab.estimate import estimate_training_memory, fsdp_units, shard_estimate
from memlab.models import TinyGPT, TinyGPTConfig, tiny_llama, tiny_llama_config

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

BATCH, SEQ = 2, 32  # per rank
# the default tiny Llama (4 layers): FSDP's modelled units of the fallback (root + 2 layers) need more than
# 2 layers to be a fair model (on a 2-layer model of width 64 that estimate is 10% high, measured)
MODEL: dict = {}
KW = dict(batch_size=BATCH, seq_len=SEQ, dtype="fp32", optimizer="adamw", device="cpu", loss="memlab", extrapolate=False)


def _stages(rank, world_size):
    return [D.train_rank(rank, world_size, s, steps=2, batch_size=BATCH * world_size, seq_len=SEQ, model_kwargs=MODEL)
            for s in D.STAGES]


@pytest.fixture(scope="module")
def measured():
    return D.launch(_stages, 2, timeout=300)


@pytest.fixture(scope="module")
def estimates():
    cfg = tiny_llama_config(**MODEL)
    base = estimate_training_memory(cfg, **KW)
    return base, {s: estimate_training_memory(cfg, world_size=2, zero_stage=s, **KW) for s in D.STAGES}


@pytest.mark.parametrize("stage", D.STAGES)
def test_per_rank_estimate_matches_the_measured_ranks(measured, estimates, stage):
    _, est = estimates
    e = est[stage]
    for rank in (0, 1):
        m = measured[rank][stage]
        # the model state at the end of the step: exact up to the optimizer's step counters (4 bytes per
        # parameter tensor, one per shard here) and the flat buffer's padding
        for key in ("parameters", "optimizer"):
            assert abs(e.breakdown_end[key] - m["at_end"][key]) <= 1024, (stage, key, e.breakdown_end, m["at_end"])
        if stage in (1, 2):  # persistent gradient buffers (stage 0 and FSDP2 free them at zero_grad)
            assert e.breakdown_end["gradients"] == m["at_end"]["gradients"]
        # the peak: stages 0 and 1 exact up to the step counters (measured: 0 and 74 bytes); stage 2 within
        # 2%: gloo's work objects keep the last reduced gradient pieces alive for a moment (measured on this
        # CPU: 74 B to 100 KiB under the estimate, varying run to run); stage 3 (traced with FSDP2) never
        # above the rank and at most 4% under it: measured equal to the byte on 26 rank-steps on this CPU,
        # but a rank whose gloo buffers are released late holds more for a moment (seen once by the lead:
        # the modelled estimate 1.7% under a rank that it is 1.9% over otherwise, i.e. that rank 3.6% higher)
        if stage == 3:
            assert -0.04 * m["peak_bytes"] <= e.peak_bytes - m["peak_bytes"] <= 1024, (e.peak_bytes, m["peak_bytes"])
            continue
        tol = {0: 0.0001, 1: 0.0001, 2: 0.02}[stage]
        assert abs(e.peak_bytes - m["peak_bytes"]) <= tol * m["peak_bytes"], (stage, e.peak_bytes, m["peak_bytes"])


def test_traced_stage_3_matches_the_ranks_more_tightly_than_the_modelled_units(measured, estimates):
    """FSDP2 traced on fake tensors against the FSDP2 ranks (fp32 AdamW, 2 x 32 tokens per rank, the 4-layer
    tiny Llama), measured on this 2-core CPU: traced 10,219,556 B, equal to the byte to both ranks' peak
    (10,219,556 B, the same in 26 rank-steps); the modelled units (root + 2 layers, + 1 layer of gradients,
    the fallback) 10,415,766 B, +1.9%. Compared with the lower of the two ranks: the ranks hold the same
    tensors, and a late gloo release can only raise one rank's peak for a moment."""
    base, est = estimates
    m = min(measured[rank][3]["peak_bytes"] for rank in (0, 1))
    traced = est[3]
    assert "traced with FSDP2" in " ".join(traced.notes) and traced.tracker is not None
    modelled = shard_estimate(base, 2, 3, units=fsdp_units(tiny_llama_config(**MODEL), "fp32"))
    assert abs(traced.peak_bytes - m) <= 0.001 * m, (traced.peak_bytes, m)
    assert abs(traced.peak_bytes - m) < abs(modelled.peak_bytes - m), (traced.peak_bytes, modelled.peak_bytes, m)
    assert traced.peak_phase == measured[0][3]["peak_phase"] == "backward"


def test_stage_0_of_one_rank_is_the_single_process_estimate(estimates):
    base, est = estimates
    assert est[0].peak_bytes == base.peak_bytes and est[0].breakdown == base.breakdown


def test_each_stage_shards_more(estimates):
    base, est = estimates
    end = [est[s].breakdown_end for s in D.STAGES]
    assert end[1]["optimizer"] == -(-base.breakdown_end["optimizer"] // 2)
    assert end[2]["gradients"] == -(-base.breakdown_end["gradients"] // 2) < end[1]["gradients"]
    # FSDP2 shards each parameter on dim 0 in torch.chunk's pieces (rank 0's is the larger); buffers (RoPE's
    # inverse frequencies) are not sharded
    with torch.device("meta"):
        model = tiny_llama(**MODEL)
    chunks = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters())
    buffers = base.breakdown_end["parameters"] - sum(p.numel() * p.element_size() for p in model.parameters())
    assert end[3]["parameters"] == chunks + buffers
    assert est[0].peak_bytes > est[1].peak_bytes > est[2].peak_bytes > est[3].peak_bytes
    assert "ZeRO stage 3, per rank of 2" in est[3].describe()


def test_extrapolated_estimates_shard_the_phase_peaks():
    kw = dict(batch_size=1, seq_len=64, dtype="bf16", device="cuda")
    one = estimate_training_memory("llama-2-7b", **kw)
    z2 = estimate_training_memory("llama-2-7b", world_size=8, zero_stage=2, **kw)
    z3 = estimate_training_memory("llama-2-7b", world_size=8, zero_stage=3, **kw)
    assert z2.extrapolated_from and z2.breakdown_end["optimizer"] == -(-one.breakdown_end["optimizer"] // 8)
    # traced FSDP2: AdamW's moments sharded (llama-2-7b's dims divide by 8), its step counters (4 bytes per
    # parameter tensor) kept whole on every rank
    n_tensors = 2 + 9 * 32 + 1
    moments = one.breakdown_end["optimizer"] - 4 * n_tensors
    assert z3.extrapolated_from == (3, 4) and z3.breakdown_end["optimizer"] == moments // 8 + 4 * n_tensors
    assert z3.peak_bytes < one.peak_bytes / 4


def test_fsdp_trace_extrapolates_exactly_by_layer_count():
    """The sharded stack traced at 3 and 4 layers and extrapolated equals the trace of all 12. With 1 and 2
    layers it would not (FSDP2 gathers other units at the backward peak there: 7% high for 4 Llama-2-70B
    layers, measured); and the phase "other" must be extrapolated run by run: with this large a vocabulary its
    peak moves from before the forward pass (the root's gathered embedding) to the gap between backward and
    the optimizer step (every layer's gradient shard) as layers are added (extrapolating the phase's peak
    says 16,740,924 B instead of 19,523,392 B, measured). Llama-2-70B, batch 1 x 256, 8 ranks: the
    extrapolation equals the trace of all 80 layers (peak, every phase, the end), 7 s against 106 s here."""
    cfg = tiny_llama_config(num_hidden_layers=12, vocab_size=1024)
    kw = dict(batch_size=1, seq_len=16, dtype="bf16", device="cuda", world_size=2, zero_stage=3)
    ext = estimate_training_memory(cfg, extrapolate=True, **kw)
    full = estimate_training_memory(cfg, extrapolate=False, **kw)
    assert ext.extrapolated_from == (3, 4) and not full.extrapolated_from
    assert (ext.peak_bytes, ext.phase_peaks, ext.breakdown_end) == (full.peak_bytes, full.phase_peaks, full.breakdown_end)
    assert ext.phase_peaks["other"] == 19_523_392


def test_the_trace_leaves_no_process_group_and_falls_back_beside_one():
    assert not dist.is_initialized()
    estimate_training_memory(tiny_llama_config(**MODEL), world_size=2, zero_stage=3, **KW)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        est = estimate_training_memory(tiny_llama_config(**MODEL), world_size=2, zero_stage=3, **KW)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()
    assert any("already initialised" in n and "modelled" in n for n in est.notes), est.notes


def test_a_callable_model_is_traced_when_fsdp_finds_its_layers():
    cfg = TinyGPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    est = estimate_training_memory(lambda: TinyGPT(cfg), world_size=2, zero_stage=3, **KW)
    assert "traced with FSDP2" in " ".join(est.notes)
    with pytest.raises(ValueError, match="decoder stack"):  # no layers for fully_shard, no units to model
        estimate_training_memory(lambda: nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)), world_size=2,
                                 zero_stage=3, **KW)


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=0), "world_size=0"), (dict(zero_stage=4), "zero_stage=4"),
    (dict(zero_stage=1, optimizer="offload-adamw"), "offload-adamw"),
])
def test_bad_zero_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_training_memory("gpt2", batch_size=1, seq_len=8, **kwargs)


def test_zero_stage_3_needs_units(estimates):
    base, _ = estimates
    with pytest.raises(ValueError, match="units"):
        shard_estimate(base, 2, 3)


def test_cli_world_size_and_zero_stage(capsys):
    assert main(["gpt2", "--seq-len", "64", "--world-size", "8", "--zero-stage", "3", "--gpu", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 3, per rank of 8" in out and "verdict:" in out
    with pytest.raises(SystemExit) as info:
        main(["gpt2", "--zero-stage", "5"])
    assert info.value.code == 2 and "--zero-stage" in capsys.readouterr().err
