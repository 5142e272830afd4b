"""Chapter 08's checks report a stub that raises on a rank of a launch as todo and leave no rank
running, and name what is wrong. memlab's own answers pass: tests/course/test_course.py."""
from __future__ import annotations

import multiprocessing

import pytest
import torch.distributed as dist

from memlab import distributed as D
from memlab.course.grading import check

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

IDS = ["08.shard_flat", "08.reduce_scatter", "08.zero1_step", "08.predict_rank_bytes"]


def test_stub_is_todo_even_inside_the_ranks():
    def stub(*a, **k):
        raise NotImplementedError("exercise 08.x: replace this line with your code")

    for e in IDS:
        r = check(e, stub, quiet=True)
        assert r.status == "todo", (e, r.status, r.message)
    assert not multiprocessing.active_children()


def test_messages_name_the_problem():
    r = check("08.shard_flat", lambda flat, rank, ws: flat.chunk(ws)[rank], quiet=True)
    assert r.status in ("fail", "error") and "shard_flat(arange of" in r.message

    def crashes(flat_grad, group=None):
        raise KeyError("oops")

    r = check("08.reduce_scatter", crashes, quiet=True)
    assert r.status == "error" and "on rank" in r.message and "KeyError" in r.message
    r = check("08.predict_rank_bytes", lambda m, ws, s: {"parameters": 0, "gradients": 0, "optimizer": 0}, quiet=True)
    assert r.status == "fail" and "measured" in r.message and "stage 0, parameters" in r.message


def test_zero1_step_that_all_reduces_fails_on_the_bytes_it_sends():
    # the same parameters as a reduce-scatter, bit for bit: only CommCounter's count tells them apart
    def all_reduce_step(flat_param, flat_grad, optimizer):
        ws, rank = dist.get_world_size(), dist.get_rank()
        total = flat_grad.clone()  # the caller's gradient is left as it was (the hygiene probe checks it)
        dist.all_reduce(total)
        a, b = D.shard_range(flat_param.numel(), rank, ws)
        optimizer.param_groups[0]["params"][0].grad = total[a:b] / ws
        optimizer.step()
        D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)

    r = check("08.zero1_step", all_reduce_step, quiet=True)
    assert r.status == "fail" and "3.00 ring passes" in r.message and "all-reduce x1" in r.message, r.message


def _comm_worker(rank, world_size):
    import torch

    out = {}
    x = torch.ones(8)
    counter = D.CommCounter(world_size)
    with counter:
        dist.all_gather([torch.empty(8) for _ in range(world_size)], x)  # the list form: 2 x 32 B gathered
        dist.barrier()
    out["counted"] = (dict(counter.sent), dict(counter.calls))
    try:
        with D.CommCounter(world_size):
            dist.all_to_all_single(torch.empty(8), x)
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_comm_counter_counts_the_list_all_gather_and_refuses_what_it_does_not_know():
    out = D.launch(_comm_worker, 2, timeout=60)[0]
    assert out["counted"] == ({"all-gather": 32.0}, {"all-gather": 1, "barrier": 1})
    assert "c10d::alltoall_base_" in out["refused"] and "not one it can count" in out["refused"]


def test_a_fail_on_the_ranks_states_the_smallest_failing_input_of_every_launch():
    """Issue 40.6: cases run on the ranks are not shrunk, but the one reported is the smallest that fails over every
    launch (world size), not the first launch's, and the message starts with it."""
    def reduce_scatter(flat_grad, group=None):  # the sum, not the mean: wrong on every case of more than one rank
        import torch

        ws = dist.get_world_size(group)
        rank = dist.get_rank(group)
        n = -(-flat_grad.numel() // ws)
        padded = torch.zeros(n * ws, dtype=flat_grad.dtype)
        padded[:flat_grad.numel()] = flat_grad
        out = torch.empty(n, dtype=flat_grad.dtype)
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out

    r = check("08.reduce_scatter", reduce_scatter, quiet=True)
    assert r.status == "fail", r
    assert r.message.startswith("on the smallest failing input of those run on the ranks") and "numel=1," in r.message, r.message
    assert not multiprocessing.active_children()
