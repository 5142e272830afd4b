"""memlab explain against three real CUDA memory snapshots from an H200 (torch 2.11.0+cu130), each one training step
recorded by ``run_snapshot`` in tools/gpu_session.py, and the allocator's own peak counter printed beside each.

The measured peaks are data, not derived here: ``torch.cuda.max_memory_allocated() / 2**20`` printed with one decimal
right after each step, in the H200 run of 2026-11-28 (results/h200/2026-11-28/snapshots.log). One decimal means the
true value lies within 0.05 MiB of the printed one.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from memlab.profiler.explain import explain

MiB = 2**20
SNAPSHOTS = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots" / "h200"
# max_memory_allocated in MiB, printed with one decimal (results/h200/2026-11-28/snapshots.log, the H200 run of
# 2026-11-28)
MEASURED_PEAK_MIB = {"tinygpt_ch00": 559.9, "tinygpt_sdpa_ch05": 448.0, "tiny_llama_ch06": 228.6}
PRINTED = 0.05  # half of the last printed digit


@pytest.fixture(scope="module")
def explained():
    return {name: explain(SNAPSHOTS / f"{name}.pickle") for name in MEASURED_PEAK_MIB}


def test_a_snapshot_whose_blocks_are_all_known_gives_the_allocators_peak(explained):
    # every block alive at tinygpt_ch00's peak was made inside the recording or is still alive at its end
    e = explained["tinygpt_ch00"]
    assert e.allocated_upper_bytes == e.allocated_bytes
    assert abs(e.allocated_bytes / MiB - MEASURED_PEAK_MIB["tinygpt_ch00"]) <= PRINTED, e.allocated_bytes / MiB


@pytest.mark.parametrize("name", sorted(MEASURED_PEAK_MIB))
def test_the_allocators_peak_lies_in_the_reported_range(explained, name):
    e = explained[name]
    lo, hi = e.allocated_bytes / MiB, e.allocated_upper_bytes / MiB
    assert lo - PRINTED <= MEASURED_PEAK_MIB[name] <= hi + PRINTED, (lo, hi)


@pytest.mark.parametrize("name", ["tinygpt_sdpa_ch05", "tiny_llama_ch06"])
def test_blocks_older_than_the_recording_give_a_bound_not_a_wrong_number(explained, name):
    # these two steps ran after an earlier model in the same process: some of its large blocks were freed during the
    # recording, and the snapshot keeps only their requested sizes (each block may be up to 1 MiB larger)
    e = explained[name]
    assert e.allocated_bytes < e.allocated_upper_bytes <= e.allocated_bytes + 4 * MiB
    text = e.text()
    assert "up to" in text.splitlines()[1] and "before the recording began" in text


@pytest.mark.parametrize("name", sorted(MEASURED_PEAK_MIB))
def test_the_breakdowns_sum_to_the_allocated_figure(explained, name):
    e = explained[name]
    assert sum(e.by_category.values()) == e.allocated_bytes
    assert sum(e.by_source.values()) == e.allocated_bytes


@pytest.mark.parametrize("name", sorted(MEASURED_PEAK_MIB))
def test_cpp_only_blocks_are_named_and_the_cublas_workspace_is_recognised(explained, name):
    e = explained[name]
    places = set(e.by_source) | {b.where for b in e.largest}
    assert not any("torch::unwind" in p for p in places), places  # the unwinder is not where a block was made
    workspace = [b for b in e.largest if b.category == "cuBLAS workspace"]
    # two 32 MiB workspaces, one per cuBLAS handle (the main thread's and autograd's), named from their frames
    assert [b.size for b in workspace] == [32 * MiB, 32 * MiB], [(b.size, b.category, b.where) for b in e.largest]
    assert any(b.where.startswith("C++ only (no Python frame): the cuBLAS workspace") for b in workspace)
    assert e.by_category["cuBLAS workspace"] >= 64 * MiB


def test_cpp_only_blocks_of_the_backward_pass_are_named_by_their_cpp_frame(explained):
    e = explained["tinygpt_ch00"]
    cpp = {k: v for k, v in e.by_source.items() if k.startswith("C++ only (no Python frame)")}
    assert cpp and all("torch::unwind" not in k and "CachingAllocator" not in k for k in cpp), cpp
    # autograd runs the backward ops on its own C++ thread: their blocks carry only C++ frames
    assert any("Backward" in k for k in cpp), cpp
