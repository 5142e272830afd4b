"""The caching allocator's model (memlab.estimate.caching_allocator) against the real CUDA caching allocator, event by
event, on three real allocator traces (issue 38, point 4).

The data: tests/fixtures/snapshots/h200/{tinygpt_ch00,tinygpt_sdpa_ch05,tiny_llama_ch06}.pickle, CUDA memory snapshots
from an NVIDIA H200 (torch 2.11.0+cu130, PyTorch's default allocator settings, no expandable segments), made on
2026-11-28 in ONE process, in that order, by ``run_snapshot`` in tools/gpu_session.py: per case the model is built
and moved to CUDA, AdamW made, then ``reset_peak_memory_stats`` and ``_record_memory_history``, one forward,
backward and optimizer step, ``_dump_snapshot``, recording off, ``del model, opt`` (no ``empty_cache``). So
tinygpt_ch00 starts in a fresh process with only the parameters (and the batch) on the card, and each later trace
starts with the earlier cases' cached segments, and with the previous case's parameters and gradients still held
by its last output's graph until the new forward replaces it (they are freed inside the later trace).

The allocator's own ``max_memory_allocated`` after each step (``/ 2**20``, printed with one decimal) is read from
results/h200/2026-11-28/snapshots.log.

What was established (memlab.estimate.allocator_replay.compare_snapshot): starting from the state the snapshot
implies at the recording's start, the model hands out every block at the address the real allocator did (814, 379
and 632 allocations), opens the same 41 segments (20 of 20 MiB, 19 of 2 MiB, the two 32 MiB cuBLAS workspaces) at
the same allocations in tinygpt_ch00 and none in the other two, as the real allocator did, and ends with the same
blocks in the same 51 segments: 612 MiB reserved in all three. Its allocated peak is the allocator's to the printed
digit.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from memlab.estimate.allocator_replay import compare_snapshot, snapshot_start
from memlab.estimate.caching_allocator import CachingAllocatorModel, round_size
from memlab.profiler.explain import read_snapshot

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "fixtures" / "snapshots" / "h200"
LOG = ROOT / "results" / "h200" / "2026-11-28" / "snapshots.log"
NAMES = ("tinygpt_ch00", "tinygpt_sdpa_ch05", "tiny_llama_ch06")
PRINTED = 0.05  # the log prints MiB with one decimal: the true value lies within half a digit


def _measured_peaks() -> dict[str, float]:
    found = dict(re.findall(r"^(\w+): max_memory_allocated ([0-9.]+) MiB", LOG.read_text(), re.M))
    return {name: float(found[name]) for name in NAMES}


@pytest.fixture(scope="module")
def snapshots():
    return {name: read_snapshot(SNAPSHOTS / f"{name}.pickle") for name in NAMES}


@pytest.fixture(scope="module")
def compared(snapshots):
    return {name: compare_snapshot(snapshots[name]) for name in NAMES}


def test_the_log_holds_the_three_measured_peaks():
    assert _measured_peaks() == {"tinygpt_ch00": 559.9, "tinygpt_sdpa_ch05": 448.0, "tiny_llama_ch06": 228.6}


# ---------------------------------------------------------------- the state when recording began
@pytest.mark.parametrize("name, segments, reserved_mib, live", [
    ("tinygpt_ch00", 10, 110, 109),  # fresh process: 5 small + 5 large segments for the parameters and the batch
    ("tinygpt_sdpa_ch05", 51, 612, 261),  # every segment of the first case, cached
    ("tiny_llama_ch06", 51, 612, 150),
])
def test_the_start_is_rebuilt_from_the_trace_and_the_segments(snapshots, name, segments, reserved_mib, live):
    st = snapshot_start(snapshots[name])
    assert (len(st.segments), st.reserved_bytes, len(st.live)) == (segments, reserved_mib * MiB, live)


def test_the_first_snapshot_starts_with_nothing_freed_and_no_inferred_size(snapshots):
    st = snapshot_start(snapshots["tinygpt_ch00"])
    assert st.notes == []  # every block live at the start is still live at the end: its size is in the segments
    assert round(st.allocated_bytes / MiB, 2) == 98.09


@pytest.mark.parametrize("name, inferred", [("tinygpt_sdpa_ch05", 5), ("tiny_llama_ch06", 3)])
def test_blocks_freed_before_their_size_is_seen_keep_an_unsplit_remainder(snapshots, name, inferred):
    # the previous case's 3 and 4 MiB blocks sat in 4 and 5 MiB: the 1 MiB left was not split off (a large-pool
    # remainder is split only when more than 1 MiB); with 3 and 4 MiB instead, the replay diverges at the first
    # reuse and the allocated peak misses the log by 4 MiB
    st = snapshot_start(snapshots[name])
    assert len(st.notes) == inferred
    assert all("1,048,576 B up to the next known block kept whole" in n for n in st.notes)


# ---------------------------------------------------------------- event by event
@pytest.mark.parametrize("name, allocs", [("tinygpt_ch00", 814), ("tinygpt_sdpa_ch05", 379), ("tiny_llama_ch06", 632)])
def test_every_block_lands_at_the_real_address(compared, name, allocs):
    c = compared[name]
    assert (c.allocs, c.same_address) == (allocs, allocs), c.divergences[:3]
    assert c.divergences == []
    assert c.agrees, c.describe()


def test_the_first_trace_opens_the_same_segments_at_the_same_allocations(compared):
    c = compared["tinygpt_ch00"]
    assert c.model_segments == c.real_segments
    assert len(c.real_segments) == 41
    assert Counter(n for _, n in c.real_segments) == {20 * MiB: 20, 2 * MiB: 19, 32 * MiB: 2}


@pytest.mark.parametrize("name", ["tinygpt_sdpa_ch05", "tiny_llama_ch06"])
def test_later_traces_open_no_segment_in_either(compared, name):
    c = compared[name]
    assert c.real_segments == c.model_segments == []


@pytest.mark.parametrize("name, blocks", [("tinygpt_ch00", 446), ("tinygpt_sdpa_ch05", 256), ("tiny_llama_ch06", 222)])
def test_the_end_layout_and_reserved_bytes_agree(compared, name, blocks):
    c = compared[name]
    assert c.model_end_blocks == c.real_end_blocks
    assert len(c.real_end_blocks) == blocks
    assert c.model_end_segments == c.real_end_segments
    assert len(c.real_end_segments) == 51
    assert c.real_reserved == c.model_reserved == c.model_max_reserved == 612 * MiB


@pytest.mark.parametrize("name", NAMES)
def test_the_models_allocated_peak_is_the_allocators(compared, name):
    peak = compared[name].model_max_allocated / MiB
    assert abs(peak - _measured_peaks()[name]) <= PRINTED, peak


# ---------------------------------------------------------------- the estimator's route, and that the check can fail
def test_the_parameters_replayed_in_address_order_make_the_same_segments(snapshots):
    # the estimator's way: no real addresses, the blocks live at the start allocated one after another (in address
    # order, which is not quite the order .to("cuda") made them), then the trace
    s = snapshots["tinygpt_ch00"]
    st = snapshot_start(s)
    m = CachingAllocatorModel()
    live = {a: m.malloc(req) for a, _, req in st.live}
    assert (m.segments, m.reserved) == (10, 110 * MiB)
    assert sorted(n for _, n, _ in m.segment_layout()) == sorted(n for _, n, _ in st.segments)
    for e in s["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = m.malloc(e["size"])
        elif e["action"] == "free_completed":
            m.free(live.pop(e["addr"]))
    assert (m.segments, m.reserved, m.max_reserved) == (51, 612 * MiB, 612 * MiB)
    # a 1 MiB unsplit remainder lands on another 4 MiB parameter than on the card: the peak is 1 MiB over
    assert abs(m.max_allocated / MiB - _measured_peaks()["tinygpt_ch00"]) <= 1 + PRINTED


def test_a_wrong_split_rule_is_caught(snapshots, monkeypatch):
    # splitting large-pool blocks whenever 512 bytes remain (the small pool's rule) must break the agreement
    def split_at_512(self, b, size):
        return b.size - size >= 512

    monkeypatch.setattr(CachingAllocatorModel, "_should_split", split_at_512)
    c = compare_snapshot(snapshots["tinygpt_ch00"])
    assert not c.agrees
    assert c.divergences[0].startswith("event 1365: 3,145,728 B at 0x7fc452400000 in the real allocator")


# ---------------------------------------------------------------- the model's seeding, on its own
def test_seed_segment_holds_the_given_blocks_and_caches_the_gaps():
    m = CachingAllocatorModel()
    base = 1 << 40
    (h,) = m.seed_segment(base, 20 * MiB, False, [(base + 4 * MiB, 4 * MiB, 4 * MiB - 100)])
    assert (m.reserved, m.allocated, m.requested, m.segments) == (20 * MiB, 4 * MiB, 4 * MiB - 100, 0)
    assert m.block_layout() == [(base, 4 * MiB, False), (base + 4 * MiB, 4 * MiB, True),
                                (base + 8 * MiB, 12 * MiB, False)]
    assert m.address(m.malloc(3 * MiB)) == base  # best fit: the 4 MiB gap, not the 12 MiB one; 1 MiB left: unsplit
    m.free(h)  # merges with the 12 MiB gap after it
    assert m.block_layout() == [(base, 4 * MiB, True), (base + 4 * MiB, 16 * MiB, False)]


def test_a_new_segment_opens_at_the_given_address():
    m = CachingAllocatorModel()
    h = m.malloc(5 * MiB, segment_address=7 << 40)
    assert m.address(h) == 7 << 40
    assert m.segment_layout() == [(7 << 40, 20 * MiB, False)]
    assert m.address(m.malloc(1000)) > 7 << 40  # a made-up address: beyond every segment held


@pytest.mark.parametrize("kwargs, named", [
    (dict(address=0, size=2 * MiB, small=True, live=[(2 * MiB, 512, 1)]), "live"),
    (dict(address=0, size=2 * MiB + 1, small=True), "size"),
    (dict(address=0, size=2 * MiB, small=True, live=[(512, 512, 1), (0, 512, 1)]), "live block address"),
    (dict(address=0, size=2 * MiB, small=True, live=[(0, 100, 1)]), "live block size"),
])
def test_seed_segment_refuses_bad_layouts(kwargs, named):
    with pytest.raises(ValueError, match=named):
        CachingAllocatorModel().seed_segment(**kwargs)


def test_seed_segment_refuses_an_overlapping_segment():
    m = CachingAllocatorModel()
    m.seed_segment(0, 20 * MiB, False)
    with pytest.raises(ValueError, match="address"):
        m.seed_segment(2 * MiB, 2 * MiB, True)


def test_compare_snapshot_refuses_a_snapshot_without_a_trace():
    with pytest.raises(ValueError, match="trace"):
        compare_snapshot({"segments": [], "device_traces": [[]]})
    with pytest.raises(ValueError, match="snapshot"):
        compare_snapshot([])


def test_round_size_is_what_the_trace_omits(snapshots):
    # the trace's alloc events carry the bytes requested (orig_size), not the block: some are not 512-byte multiples
    sizes = [e["size"] for e in snapshots["tinygpt_ch00"]["device_traces"][0] if e["action"] == "alloc"]
    assert sum(1 for n in sizes if n % 512) == 35
    assert all(round_size(n) % 512 == 0 for n in sizes)
