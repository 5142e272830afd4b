"""The caching allocator's model (memlab.estimate.caching_allocator, memlab.estimate.allocator_replay): cases
derived by hand from the rules of PyTorch's CUDACachingAllocator.cpp, the log a tracked step fills, and the
estimator's reserved figure against the H100's measured max_memory_reserved (results/h100/estimator_probe.json)."""
from __future__ import annotations

import json
import pathlib

import pytest

from memlab.core import gpus
from memlab.estimate.allocator_replay import AllocationLog, estimate_reserved, replay, training_events
from memlab.estimate.caching_allocator import (AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorModel,
                                               allocation_size, round_size)

MiB = 2**20
ROOT = pathlib.Path(__file__).resolve().parents[2]


def allocs(*sizes):
    return [("alloc", i, s) for i, s in enumerate(sizes)]


# ---------------------------------------------------------------- rounding and segment sizes
@pytest.mark.parametrize("size, rounded", [(1, 512), (512, 512), (513, 1024), (MiB + 1, MiB + 512)])
def test_requests_round_to_512_bytes(size, rounded):
    assert round_size(size) == rounded


@pytest.mark.parametrize("size, segment", [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB),
                                           (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB)])
def test_segment_sizes(size, segment):
    assert allocation_size(size) == segment


def test_a_request_just_over_1_mib_takes_a_20_mib_segment():
    r = replay(allocs(MiB + 1))
    assert (r.max_reserved, r.max_allocated, r.segments) == (20 * MiB, MiB + 512, 1)
    r = replay(allocs(MiB))
    assert (r.max_reserved, r.max_allocated) == (2 * MiB, MiB)


def test_small_requests_pack_into_2_mib_segments():
    assert replay(allocs(*[1000] * 2048)).max_reserved == 2 * MiB  # 2048 blocks of 1024 B
    assert replay(allocs(*[1000] * 2049)).max_reserved == 4 * MiB


def test_large_pool_split_only_when_more_than_1_mib_remains():
    r = replay(allocs(19 * MiB + 1))  # 1 MiB - 512 would remain: not split, the whole block is allocated
    assert (r.max_reserved, r.max_allocated) == (20 * MiB, 20 * MiB)
    r = replay(allocs(18 * MiB))  # 2 MiB remain: split
    assert r.max_allocated == 18 * MiB
    r = replay(allocs(9 * MiB, 9 * MiB, 9 * MiB))  # 20 = 9 + 9 + 2: the third needs a second segment
    assert (r.max_reserved, r.max_allocated, r.segments) == (40 * MiB, 27 * MiB, 2)


def test_freed_blocks_merge_and_are_reused():
    r = replay([("alloc", 0, 9 * MiB), ("free", 0), ("alloc", 1, 5 * MiB), ("alloc", 2, 5 * MiB),
                ("alloc", 3, 9 * MiB)])
    assert (r.max_reserved, r.segments) == (20 * MiB, 1)


def test_best_fit_takes_the_smallest_block_that_fits():
    # two cached blocks: 4 MiB (the rest of a 20 MiB segment after 6 and 10) and 12 MiB (a 12 MiB segment); 3 MiB
    # takes the 4 MiB one, so 12 MiB still fits without a new segment
    seq = [("alloc", "a", 6 * MiB), ("alloc", "x", 10 * MiB), ("alloc", "b", 12 * MiB), ("free", "b"),
           ("alloc", "c", 3 * MiB), ("alloc", "d", 12 * MiB)]
    r = replay(seq)
    assert (r.max_reserved, r.segments) == (32 * MiB, 2)


def test_large_requests_get_their_own_segment_rounded_to_2_mib():
    r = replay(allocs(100 * MiB + 1, 100 * MiB + 1))
    assert (r.max_reserved, r.segments) == (2 * 102 * MiB, 2)


# ---------------------------------------------------------------- options
def test_max_split_size_keeps_oversize_blocks_whole():
    seq = [("alloc", 0, 200 * MiB), ("free", 0), ("alloc", 1, 50 * MiB)]
    assert replay(seq).max_reserved == 200 * MiB  # split
    assert replay(seq, "max_split_size_mb:100").max_reserved == 250 * MiB  # an oversize block serves no small request
    big = [("alloc", 0, 200 * MiB), ("free", 0), ("alloc", 1, 150 * MiB)]
    assert replay(big, "max_split_size_mb:100").max_reserved == 350 * MiB  # 200 >= 150 + 20: not taken
    near = [("alloc", 0, 200 * MiB), ("free", 0), ("alloc", 1, 190 * MiB)]
    r = replay(near, "max_split_size_mb:100")
    assert (r.max_reserved, r.max_allocated) == (200 * MiB, 200 * MiB)  # taken whole, not split


def test_full_card_frees_the_cache_and_retries():
    seq = [("alloc", 0, 60 * MiB), ("free", 0), ("alloc", 1, 70 * MiB)]
    assert replay(seq).max_reserved == 130 * MiB
    r = replay(seq, capacity_bytes=100 * MiB)
    assert (r.max_reserved, r.retries) == (70 * MiB, 1)
    with pytest.raises(AllocatorOutOfMemory, match="capacity_bytes=104,857,600"):
        replay([("alloc", 0, 60 * MiB), ("alloc", 1, 70 * MiB)], capacity_bytes=100 * MiB)


def test_max_split_size_frees_oversize_blocks_first():
    seq = [("alloc", 0, 200 * MiB), ("alloc", 1, 30 * MiB), ("free", 0), ("alloc", 2, 210 * MiB)]
    # 230 + 210 > 300: the cached 200 MiB block (oversize) is released, not enough alone; then the whole cache
    r = replay(seq, "max_split_size_mb:100", capacity_bytes=300 * MiB)
    assert (r.max_reserved, r.retries) == (240 * MiB, 1)
    keep = [("alloc", 0, 200 * MiB), ("alloc", 1, 30 * MiB), ("free", 0), ("alloc", 2, 150 * MiB)]
    r = replay(keep, "max_split_size_mb:100", capacity_bytes=300 * MiB)  # the oversize 200 is freed for 150
    assert (r.max_reserved, r.retries) == (230 * MiB, 1)


def test_expandable_segments_grow_one_segment_by_pages():
    assert replay(allocs(6 * MiB, 6 * MiB, 6 * MiB, 6 * MiB)).max_reserved == 40 * MiB  # 20 = 6 + 6 + 6 + 2 then anew
    r = replay(allocs(6 * MiB, 6 * MiB, 6 * MiB, 6 * MiB), "expandable_segments:True")
    assert r.max_reserved == 40 * MiB  # 24 MiB in pages of 20 MiB
    # 50 MiB + 50 MiB: two segments of 50 without, 100 MiB mapped in 20 MiB pages with
    assert replay(allocs(50 * MiB, 50 * MiB), "expandable_segments:True").max_reserved == 100 * MiB
    assert replay(allocs(51 * MiB, 51 * MiB)).max_reserved == 104 * MiB
    assert replay(allocs(51 * MiB, 51 * MiB), "expandable_segments:True").max_reserved == 120 * MiB
    # the gap a freed block leaves is reused with any remainder split off
    seq = [("alloc", 0, 30 * MiB), ("alloc", 1, 10 * MiB), ("free", 0), ("alloc", 2, 28 * MiB),
           ("alloc", 3, 2 * MiB - 100)]
    assert replay(seq, "expandable_segments:True").max_reserved == 40 * MiB
    # the small pool has its own segment, in 2 MiB pages
    assert replay(allocs(1000, 1000, 30 * MiB), "expandable_segments:True").max_reserved == 42 * MiB


def test_expandable_segments_unmap_free_pages_on_a_full_card():
    seq = [("alloc", 0, 60 * MiB), ("alloc", 1, 30 * MiB), ("free", 0), ("alloc", 2, 5000),
           ("alloc", 3, 100 * MiB)]
    r = replay(seq, "expandable_segments:True", capacity_bytes=180 * MiB)
    assert r.retries == 1 and r.max_reserved <= 180 * MiB


def test_roundup_power2_divisions():
    cfg = AllocatorConfig(roundup_power2_divisions=4)
    assert round_size(1200 * MiB + 1, cfg) == 1280 * MiB  # steps of 256 MiB between 1 and 2 GiB
    assert round_size(1024 * MiB, cfg) == 1024 * MiB  # a power of two stays
    assert round_size(1000, cfg) == 1024  # below 512 x divisions: plain rounding
    per = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert round_size(300 * MiB + 1, per) == 300 * MiB + 512  # up to 512 MiB: 1 division
    assert round_size(600 * MiB, per) == 768 * MiB  # [512 MiB, 1 GiB): 2 divisions
    assert round_size(1200 * MiB + 1, per) == 1280 * MiB
    gap = AllocatorConfig.parse("roundup_power2_divisions:[256:2,1024:4]")  # 512 MiB - 1 GiB: left at 0
    assert round_size(300 * MiB + 1, gap) == 384 * MiB and round_size(600 * MiB, gap) == 600 * MiB
    assert round_size(1200 * MiB + 1, gap) == 1280 * MiB and round_size(3000 * MiB, gap) == 3000 * MiB


@pytest.mark.parametrize("conf, name", [("foo:1", "conf"), ("expandable_segments:yes", "expandable_segments"),
                                        ("max_split_size_mb:10", "max_split_size_mb"),
                                        ("max_split_size_mb:20", "max_split_size_mb"),
                                        ("max_non_split_rounding_mb:5", "max_non_split_rounding_mb"),
                                        ("roundup_power2_divisions:3", "roundup_power2_divisions")])
def test_bad_config_is_named(conf, name):
    with pytest.raises(ValueError, match=f"{name}=.* is invalid; allowed"):
        AllocatorConfig.parse(conf)


@pytest.mark.parametrize("events, match", [([("alloc", 0)], r"events\[0\]"), ([("free", 0)], "a free of a live key"),
                                           ([("alloc", 0, 1), ("alloc", 0, 1)], "not live"),
                                           ([("alloc", 0, -1)], r"events\[0\].*nbytes")])
def test_bad_events_are_named(events, match):
    with pytest.raises(ValueError, match=match):
        replay(events)


def test_model_statistics_and_handles():
    m = CachingAllocatorModel()
    empty = m.malloc(0)  # a null pointer: no block, nothing counted
    assert (m.allocated, m.reserved) == (0, 0)
    m.free(empty)
    h = m.malloc(3000)
    assert (m.allocated, m.requested, m.reserved) == (3072, 3000, 2 * MiB)
    m.free(h)
    assert (m.allocated, m.reserved, m.max_allocated) == (0, 2 * MiB, 3072)
    assert m.release_cached() == 2 * MiB and m.reserved == 0
    with pytest.raises(ValueError, match="handle=.* is invalid"):
        m.free(h)


def test_streams_do_not_share_cached_blocks():
    seq = [("alloc", 0, 9 * MiB, 0), ("free", 0), ("alloc", 1, 9 * MiB, 1)]
    assert replay(seq).max_reserved == 40 * MiB
    assert replay([(*e[:3], 0) if e[0] == "alloc" else e for e in seq]).max_reserved == 20 * MiB


def test_nvidia_smi_adds_the_named_context():
    est = estimate_reserved(allocs(MiB + 1))
    assert est.nvidia_smi_bytes == 20 * MiB + gpus.CONTEXT_RESERVE_BYTES
    assert est.context_source == gpus.CONTEXT_RESERVE_SOURCE
    own = estimate_reserved(allocs(MiB + 1), context_bytes=500 * MiB, context_source="measured here")
    assert own.nvidia_smi_bytes == 520 * MiB and "measured here" in own.describe()
    with pytest.raises(ValueError, match="context_bytes=-1 is invalid"):
        estimate_reserved([], context_bytes=-1)


# ---------------------------------------------------------------- a traced step's events
class _Log(AllocationLog):
    def __init__(self, initial, events):
        super().__init__()
        self.initial, self.events = initial, events


def test_training_events_rebuild_the_run():
    # params 0 (40 MiB), Adam state 1, 2 (40 MiB each) and a host step count 3 (4 B); the step: an activation 10,
    # the gradient 11 (kept to the next step), the activation freed, the optimizer's temporary 12
    log = _Log([(0, 40 * MiB, "parameters"), (1, 40 * MiB, "optimizer"), (2, 40 * MiB, "optimizer"),
                (3, 4, "optimizer")],
               [("alloc", 10, 30 * MiB), ("alloc", 11, 40 * MiB), ("free", 10), ("mark", "optimizer"),
                ("alloc", 12, 40 * MiB), ("free", 12)])
    ev = training_events(log, steps=2)
    kinds = [(e[0], e[1]) for e in ev]
    assert kinds[0] == ("alloc", ("p", 0)) and ("alloc", ("p", 3)) not in kinds  # the step count stays on the host
    assert kinds.index(("alloc", ("p", 1))) > kinds.index(("free", (0, 10)))  # state made in the first step
    assert kinds.index(("free", (0, 11))) < kinds.index(("alloc", (1, 10)))  # gradients freed before step 2
    r = replay(ev)
    assert r.max_allocated == 200 * MiB and r.max_reserved >= r.max_allocated
    with pytest.raises(ValueError, match="steps=0 is invalid"):
        training_events(log, steps=0)


def test_the_tracker_logs_every_storage_of_a_step():
    torch = pytest.importorskip("torch")
    from memlab.estimate.attention import make_tracker

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    tracker = make_tracker(model, opt, False, log_allocations=True)
    log = tracker.allocation_log
    with tracker:
        log.start((s.storage, s.category) for s in tracker.live_storages())
        x = torch.randn(32, 64)
        model(x).square().mean().backward()
        del x
    allocated = {e[1]: e[2] for e in log.events if e[0] == "alloc"}
    freed = {e[1] for e in log.events if e[0] == "free"}
    assert len(log.initial) == 4 and sum(n for _, n, _ in log.initial) == 4 * (64 * 256 + 256 + 256 * 64 + 64)
    assert freed <= set(allocated) | {i for i, _, _ in log.initial}
    alive = sum(n for i, n in allocated.items() if i not in freed)
    assert alive == 4 * (64 * 256 + 256 + 256 * 64 + 64)  # what is left: the four gradients
    assert make_tracker(model, opt, False).allocation_log is None


# ---------------------------------------------------------------- against the H100's measured reserved memory
def _h100_rows():
    return json.loads((ROOT / "results/h100/estimator_probe.json").read_text())["fragmentation"]


@pytest.mark.parametrize("row", _h100_rows(), ids=lambda r: f"{r['model']}-{'amp' if r['amp'] else 'fp32'}")
def test_reserved_against_the_h100(row):
    """The estimate's reserved figure comes from the replay (stated in the notes) and lands within 15% of what the
    H100 reserved; the allocated estimate of these runs is itself 7% under (the gap is the tracer's, not the
    allocator model's): the model's reserved/allocated ratio is checked within 7% of the measured one."""
    from memlab.estimate import estimate_training_memory
    from memlab.models import TinyGPT, TinyGPTConfig, tiny_llama

    if row["model"].startswith("tinygpt"):
        build = lambda: TinyGPT(TinyGPTConfig(n_layer=6, n_embd=512, n_head=8, block_size=512))  # noqa: E731
    else:
        build = lambda: tiny_llama(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,  # noqa: E731
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                                   vocab_size=32000)
    est = estimate_training_memory(build, batch_size=8, seq_len=512, dtype="bf16-mixed" if row["amp"] else "fp32",
                                   optimizer="adamw", device="cuda", gpu="h100-80gb")
    assert est.reserved_replay_bytes and any("caching allocator" in n for n in est.notes)
    assert est.reserved_bytes == max(est.reserved_replay_bytes, est.allocated_bytes)
    assert abs(est.reserved_bytes / row["max_reserved"] - 1) < 0.15
    ratio = est.reserved_bytes / est.allocated_bytes
    assert abs(ratio / row["ratio"] - 1) < 0.07


# ---------------------------------------------------------------- the estimate's reserved figure, extrapolated and sharded
def _est(alloc: int, replay_bytes: int):
    from memlab.estimate import MemoryEstimate

    return MemoryEstimate(model="m", n_params=1, batch_size=1, seq_len=1, dtype="fp32", optimizer="adamw",
                          checkpointing=False, peak_bytes=alloc, breakdown={}, device="cuda",
                          reserved_replay_bytes=replay_bytes)


@pytest.mark.parametrize("cached, expected", [((90, 103, 119), 119 + 13 * 7),  # grows: the smaller step a layer
                                              ((520, 1683, 1356), 1356),  # does not: the deepest kept
                                              ((50, 50, 50), 50)])
def test_cached_bytes_extrapolated_by_depth(cached, expected):
    from memlab.estimate.extrapolate import REPLAY_NOTE, _extrapolate_reserved

    traced = [(d, _est(1000 * MiB, (1000 + c) * MiB)) for d, c in zip((3, 4, 5), cached)]
    full = _est(3000 * MiB, 0)
    full.notes = [REPLAY_NOTE + " of the 5-layer trace"]
    _extrapolate_reserved(full, traced, 12)
    assert full.reserved_replay_bytes == 3000 * MiB + -(-expected // 2) * 2 * MiB
    assert full.reserved_bytes == full.reserved_replay_bytes
    assert len([n for n in full.notes if n.startswith(REPLAY_NOTE)]) == 1  # the shallow trace's note replaced
    none = _est(3000 * MiB, 0)
    _extrapolate_reserved(none, [(3, _est(1, 0)), (4, _est(1, 5 * MiB))], 12)
    assert none.reserved_replay_bytes == 0 and none.reserved_bytes == -(-3000 * MiB * 114 // 100)  # the margin


def test_sharded_estimate_keeps_the_cached_bytes():
    from memlab.estimate import estimate_training_memory, shard_estimate
    from memlab.models import TinyGPT, TinyGPTConfig

    est = estimate_training_memory(lambda: TinyGPT(TinyGPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=64)),
                                   batch_size=1, seq_len=16, device="cuda")
    cached = est.reserved_replay_bytes - est.allocated_bytes
    for stage in (1, 2):
        out = shard_estimate(est, 4, stage)
        assert out.allocated_bytes < est.allocated_bytes
        assert out.reserved_replay_bytes == -(-(out.allocated_bytes + cached) // (2 * MiB)) * 2 * MiB
    assert est.reserved_replay_bytes - est.allocated_bytes == cached  # the single-rank estimate is not changed
