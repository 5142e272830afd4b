"""Chapter 08's checks pass on memlab's own answers, report a stub as todo (also when the stub raises
on a rank of a launch), and name what is wrong."""
from __future__ import annotations

import multiprocessing

import pytest
import torch.distributed as dist

from memlab import distributed as D
from memlab.grading import check, get_exercise

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

IDS = ["08.shard_flat", "08.reduce_scatter", "08.zero1_step", "08.predict_rank_bytes"]


@pytest.mark.parametrize("exercise", IDS)
def test_reference_passes(exercise):
    r = check(exercise, get_exercise(exercise).reference(), quiet=True)
    assert r.status == "pass", r.message


def test_stub_is_todo_even_inside_the_ranks():
    def stub(*a, **k):
        raise NotImplementedError("exercise 08.x: replace this line with your code")

    for e in IDS:
        r = check(e, stub, quiet=True)
        assert r.status == "todo", (e, r.status, r.message)
    assert not multiprocessing.active_children()


def test_messages_name_the_problem():
    r = check("08.shard_flat", lambda flat, rank, ws: flat.chunk(ws)[rank], quiet=True)
    assert r.status in ("fail", "error") and "shard_flat(arange(" in r.message

    def crashes(flat_grad, group=None):
        raise KeyError("oops")

    r = check("08.reduce_scatter", crashes, quiet=True)
    assert r.status == "error" and "on rank" in r.message and "KeyError" in r.message
    r = check("08.predict_rank_bytes", lambda m, ws, s: {"parameters": 0, "gradients": 0, "optimizer": 0}, quiet=True)
    assert r.status == "fail" and "measured" in r.message and "stage 0, parameters" in r.message
