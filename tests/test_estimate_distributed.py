"""memlab estimate --world-size N --zero-stage 0|1|2|3 against ranks measured with 2 gloo processes on CPU.

Measured: memlab.distributed.train_rank (tiny Llama, fp32 AdamW, a batch of 2 x 32 per rank) under
stage 0 (data parallel), 1 and 2 (memlab's ZeroOptimizer) and 3 (FSDP2), the last step tracked on
each rank. Estimated: the same step traced once on fake tensors, sharded by stage
(memlab.estimate.shard_estimate).
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from memlab import distributed as D
from memlab.estimate import estimate_training_memory, main, shard_estimate
from memlab.models import tiny_llama_config

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

BATCH, SEQ = 2, 32  # per rank
# the default tiny Llama (4 layers): FSDP's modelled units (root + 2 layers) need more than 2 layers to be
# a fair model (on a 2-layer model of width 64 the stage-3 estimate is 10% high, measured)
MODEL: dict = {}


def _stages(rank, world_size):
    return [D.train_rank(rank, world_size, s, steps=2, batch_size=BATCH * world_size, seq_len=SEQ, model_kwargs=MODEL)
            for s in D.STAGES]


@pytest.fixture(scope="module")
def measured():
    return D.launch(_stages, 2, timeout=300)


@pytest.fixture(scope="module")
def estimates():
    kw = dict(batch_size=BATCH, seq_len=SEQ, dtype="fp32", optimizer="adamw", device="cpu", loss="memlab",
              extrapolate=False)
    cfg = tiny_llama_config(**MODEL)
    base = estimate_training_memory(cfg, **kw)
    return base, {s: estimate_training_memory(cfg, world_size=2, zero_stage=s, **kw) for s in D.STAGES}


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
        # CPU: 74 B to 100 KiB under the estimate, varying run to run); stage 3 within 5%: FSDP's unsharded
        # units are modelled (measured -1.7% to +1.9%, varying with when gloo releases its buffers)
        tol = {0: 0.0001, 1: 0.0001, 2: 0.02, 3: 0.05}[stage]
        assert abs(e.peak_bytes - m["peak_bytes"]) <= tol * m["peak_bytes"], (stage, e.peak_bytes, m["peak_bytes"])


def test_stage_0_of_one_rank_is_the_single_process_estimate(estimates):
    base, est = estimates
    assert est[0].peak_bytes == base.peak_bytes and est[0].breakdown == base.breakdown


def test_each_stage_shards_more(estimates):
    base, est = estimates
    end = [est[s].breakdown_end for s in D.STAGES]
    assert end[1]["optimizer"] == -(-base.breakdown_end["optimizer"] // 2)
    assert end[2]["gradients"] == -(-base.breakdown_end["gradients"] // 2) < end[1]["gradients"]
    assert end[3]["parameters"] == -(-base.breakdown_end["parameters"] // 2)
    assert est[0].peak_bytes > est[1].peak_bytes > est[2].peak_bytes > est[3].peak_bytes
    assert "ZeRO stage 3, per rank of 2" in est[3].describe()


def test_extrapolated_estimates_shard_the_phase_peaks():
    kw = dict(batch_size=1, seq_len=64, dtype="bf16", device="cuda")
    one = estimate_training_memory("llama-2-7b", **kw)
    z3 = estimate_training_memory("llama-2-7b", world_size=8, zero_stage=3, **kw)
    assert z3.extrapolated_from and z3.breakdown_end["optimizer"] == -(-one.breakdown_end["optimizer"] // 8)
    assert z3.peak_bytes < one.peak_bytes / 4


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
