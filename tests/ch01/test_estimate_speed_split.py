"""Two processes at once give the answers of one (issue 42, point 1).

* :func:`memlab.core.forking.in_two`: each item runs once, in this process or a forked child; the one done first
  takes the other's items not yet started (from the end of its list); a child that dies leaves its items out.
* :func:`memlab.estimate.extrapolate.extrapolate_by_depth` with ``jobs=2`` (the deepest depth traced in a child)
  gives every number of the estimate traced in one process, and ``memlab estimate`` does it by default.
* No grandchild: a forked child, and a process with a helper running, do not fork again (``spare_cpu``).
"""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from memlab.core import forking
from memlab.estimate import estimate_training_memory, extrapolate, suggest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")

SMALL = dict(num_hidden_layers=8, hidden_size=64, intermediate_size=160, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=1000)


def _where(item):
    if item == "slow":
        time.sleep(2.0)
    elif item == "t1":  # the child's own item: long enough for this process, however loaded, to claim its first
        time.sleep(0.5)  # (an instant one let the child take all four once, on a loaded 2-core CI machine)
    return item, os.getpid()


def test_each_item_runs_once_and_the_free_process_takes_what_is_left():
    me = os.getpid()
    done = forking.in_two(_where, ["slow", "m2", "m3"], ["t1"])
    assert sorted(done) == ["m2", "m3", "slow", "t1"]
    assert all(done[k][0] == k for k in done)
    assert done["slow"][1] == me  # this process started on its own first item
    child = done["t1"][1]
    assert child != me
    # while this process slept on "slow", the child finished "t1" and took the rest of this process's list
    assert done["m3"][1] == child and done["m2"][1] == child


def test_an_error_comes_back_as_the_exception_and_a_dead_child_leaves_its_items_out():
    me = os.getpid()

    def fn(item):
        if item == "bad":
            time.sleep(1.0)  # (the child takes its own item meanwhile)
            raise ValueError("bad item")
        if os.getpid() != me:
            os._exit(3)  # as a child killed would
        return item

    done = forking.in_two(fn, ["bad", "a"], ["b"])
    assert isinstance(done["bad"], ValueError) and "bad item" in str(done["bad"])
    assert done == {"bad": done["bad"], "a": "a"}  # the child's item is the caller's to run


def test_in_two_checks_its_items():
    with pytest.raises(ValueError, match=r"mine=\[1\], theirs=\[1\] is invalid; allowed: at most 128 items, all different"):
        forking.in_two(lambda i: i, [1], [1])
    assert forking.in_two(lambda i: (i, os.getpid()), [1, 2], []) == {1: (1, os.getpid()), 2: (2, os.getpid())}


def _spare_in_child(item):
    if item == "here":
        time.sleep(1.0)  # (the child takes its own item meanwhile)
    return forking.spare_cpu(), forking._HELPERS, os.getpid()


def test_no_grandchild():
    # in the child (marked by single_threaded_child) and in this process while the child runs, no second fork
    # (on a loaded machine the child may finish its item and take this process's before it starts: whichever
    # process ran an item, it could not fork; this process counted its one helper while the child lived)
    done = forking.in_two(_spare_in_child, ["here"], ["there"])
    for spare, helpers, pid in done.values():
        assert spare is False
        assert helpers == (1 if pid == os.getpid() else 0), (helpers, pid, os.getpid())
    assert forking._HELPERS == 0


def test_the_rows_each_process_starts_on():
    # the child starts on the last rows (about half the work), each process the slowest of its own first
    seen = {}

    def fake_in_two(fn, mine, theirs):
        seen.update(mine=mine, theirs=theirs)
        return {}

    w = [1.2, 1, 1, 2, 1, 1, 1, 1, 1, 2.5, 2.5]
    orig = suggest.in_two
    suggest.in_two = fake_in_two
    try:
        suggest._traced_in_two(lambda i: i, list(range(11)), w)
    finally:
        suggest.in_two = orig
    assert seen["theirs"] == [9, 10, 6, 7, 8]
    assert seen["mine"] == [3, 0, 1, 2, 4, 5]


def _numbers(est):
    d = dataclasses.asdict(dataclasses.replace(est, tracker=None, seconds=0.0))
    return d


@pytest.mark.parametrize("kw", [dict(), dict(checkpointing=True, optimizer="adamw8bit"),
                                dict(adapter="qlora", loss="fused"), dict(device="cpu", optimizer_in_backward=True)])
def test_depths_in_two_processes_give_the_estimate_of_one(kw, monkeypatch):
    args = dict(batch_size=2, seq_len=64, config_overrides=SMALL, **kw)
    monkeypatch.setattr(extrapolate, "spare_cpu", lambda: False)
    one = estimate_training_memory("llama-2-7b", **args)
    calls = []
    real = extrapolate.traced_in_two

    def spy(trace_at, mine, theirs):
        out = real(trace_at, mine, theirs)
        calls.append((mine, theirs, {d: type(e.tracker).__name__ for d, e in out.items()}))
        return out

    monkeypatch.setattr(extrapolate, "spare_cpu", lambda: True)
    monkeypatch.setattr(extrapolate, "traced_in_two", spy)
    two = estimate_training_memory("llama-2-7b", **args)
    assert calls and calls[0][:2] == ([4], [5])
    assert "TracedTimeline" in calls[0][2].values()  # one depth came back from the child
    assert one.extrapolated_from == two.extrapolated_from == (3, 4)
    assert _numbers(two) == _numbers(one)


def test_extrapolate_by_depth_jobs_is_checked():
    for jobs in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"jobs={jobs!r} is invalid; allowed: None .* an int >= 1"):
            extrapolate.extrapolate_by_depth(lambda d: None, 8, [(3, 4)], jobs=jobs)


def test_no_fork_once_cuda_is_initialised(monkeypatch):
    # a child forked after CUDA initialised fails its first CUDA call (the H200 run of 2026-11-28): both items
    # then run in this process
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert forking.spare_cpu() is False
    done = forking.in_two(lambda i: os.getpid(), [1], [2])
    assert done == {1: os.getpid(), 2: os.getpid()}
