"""Checks for chapter 08, beyond one GPU (ZeRO from scratch).

08.shard_flat          rank r's shard of a flat buffer: zero-padded to a multiple of the world size,
                       the r-th of N equal contiguous pieces
08.reduce_scatter      this rank's shard of the mean of every rank's flat gradient, with collectives
                       (run on 2 gloo processes)
08.zero1_step          one ZeRO-1 step: reduce-scatter the gradients, step on this rank's shard,
                       all-gather (2 gloo processes, 3 steps, bit for bit against AdamW on one process;
                       at most 2 ring passes sent per step, counted by CommCounter: an all-reduce,
                       which gives the same numbers, sends 3)
08.predict_rank_bytes  predict the parameter / gradient / optimizer bytes one rank holds under ZeRO
                       stages 0-3; graded on the error (1%) against ranks measured on 2 processes

The references live in memlab.distributed; tests/test_distributed.py proves them against
single-process training and FSDP2.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from memlab import distributed as D
from memlab.checks import expect, expect_type, register

WORLD_SIZE = 2


def _launch(worker, *args: Any) -> list[Any]:
    """Run ``worker`` on 2 processes; a learner's stub (NotImplementedError) stays a todo, any other
    exception on a rank becomes this process's error with the rank's last lines."""
    try:
        return D.launch(worker, WORLD_SIZE, *args, timeout=50)
    except D.RankError as exc:
        tb = exc.remote_traceback or str(exc)
        last = [line for line in tb.strip().splitlines() if line.strip()][-1:]
        if "NotImplementedError" in tb and last and last[0].startswith("NotImplementedError"):
            raise NotImplementedError(last[0].partition(":")[2].strip() or "not implemented yet") from None
        raise RuntimeError(f"on rank {exc.rank}: {' '.join(last) if last else exc}") from None


def _tensor_equal(name: str, got: Any, want: torch.Tensor) -> None:
    expect_type(name, got, torch.Tensor)
    expect(tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    expect(got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}")
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        i = int(bad[0][0]) if bad.numel() else 0
        raise AssertionError(f"{name}: {len(bad)} of {want.numel()} entries differ (first at [{i}]: got "
                             f"{got.reshape(-1)[i].item()!r}, expected {want.reshape(-1)[i].item()!r})")


# ----------------------------------------------------------------------------- 08.shard_flat
@register("08.shard_flat", reference=lambda: D.shard_flat, title="shard a flat buffer")
def check_shard_flat(fn) -> None:
    expect(callable(fn), f"shard_flat: expected a function, got {type(fn).__name__}")
    for numel, ws in ((12, 2), (12, 4), (10, 4), (7, 3), (1, 2), (5, 8)):
        flat = torch.arange(1, numel + 1, dtype=torch.float32)
        shards = []
        for r in range(ws):
            got = fn(flat.clone(), r, ws)
            _tensor_equal(f"shard_flat(arange({numel}), rank={r}, world_size={ws})", got, D.shard_flat(flat, r, ws))
            shards.append(got)
        expect(torch.equal(torch.cat(shards)[:numel], flat),
               f"world_size={ws}: the shards in rank order, padding dropped, must give the buffer back")
    half = torch.arange(6, dtype=torch.bfloat16)
    _tensor_equal("shard_flat(bfloat16 buffer of 6, rank=1, world_size=4) (keep the dtype)", fn(half, 1, 4),
                  D.shard_flat(half, 1, 4))


# ----------------------------------------------------------------------------- 08.reduce_scatter
def _rs_worker(rank: int, world_size: int, fn: Any) -> list[torch.Tensor]:
    out = []
    for numel in (8, 10, 7):
        g = torch.Generator().manual_seed(100 * numel + rank)
        out.append(fn(torch.randn(numel, generator=g)))
    return out


def _rs_expected(rank: int, world_size: int) -> list[torch.Tensor]:
    out = []
    for numel in (8, 10, 7):
        grads = [torch.randn(numel, generator=torch.Generator().manual_seed(100 * numel + r)) for r in range(world_size)]
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        out.append(D.shard_flat(total, rank, world_size) / world_size)
    return out


def _reduce_scatter_reference():
    def reduce_scatter(flat_grad: torch.Tensor, group=None) -> torch.Tensor:
        pad = D.padded_size(flat_grad.numel(), dist.get_world_size(group)) - flat_grad.numel()
        return D.reduce_scatter_flat(torch.cat([flat_grad, flat_grad.new_zeros(pad)]), group)
    return reduce_scatter


@register("08.reduce_scatter", reference=_reduce_scatter_reference, title="reduce-scatter the gradients")
def check_reduce_scatter(fn) -> None:
    expect(callable(fn), f"reduce_scatter: expected a function, got {type(fn).__name__}")
    ranks = _launch(_rs_worker, fn)
    for rank, got in enumerate(ranks):
        for numel, g, want in zip((8, 10, 7), got, _rs_expected(rank, WORLD_SIZE)):
            name = f"rank {rank}, a gradient of {numel} elements"
            expect_type(name, g, torch.Tensor)
            expect(tuple(g.shape) == tuple(want.shape),
                   f"{name}: shape {tuple(g.shape)}, expected {tuple(want.shape)} (pad to a multiple of the world size, "
                   f"keep 1/N)")
            expect(torch.allclose(g, want, rtol=1e-6, atol=1e-7),
                   f"{name}: got {g.tolist()}, expected {want.tolist()} (the mean over ranks of this rank's piece)")


# ----------------------------------------------------------------------------- 08.zero1_step
ZERO_STEPS = 3
ZERO_NUMEL = 11


def _zero_grads(step: int, rank: int) -> torch.Tensor:
    return torch.randn(ZERO_NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank))


def _zero_worker(rank: int, world_size: int, fn: Any) -> tuple[torch.Tensor, float, dict[str, int]]:
    n_pad = D.padded_size(ZERO_NUMEL, world_size)
    flat = torch.zeros(n_pad)
    flat[:ZERO_NUMEL] = torch.linspace(-1, 1, ZERO_NUMEL)
    a, b = D.shard_range(ZERO_NUMEL, rank, world_size)
    shard = torch.nn.Parameter(flat[a:b])
    opt = torch.optim.AdamW([shard], lr=0.1)
    counter = D.CommCounter(world_size)
    for step in range(ZERO_STEPS):
        grad = torch.zeros(n_pad)
        grad[:ZERO_NUMEL] = _zero_grads(step, rank)
        with counter:
            fn(flat, grad, opt)
    # bytes sent per step in ring passes over the padded fp32 buffer: (N-1)/N x 4 x n_pad bytes each
    passes = counter.total / ZERO_STEPS / ((world_size - 1) / world_size * 4 * n_pad)
    return flat[:ZERO_NUMEL].clone(), passes, dict(counter.calls)


def _zero_expected() -> torch.Tensor:
    p = torch.nn.Parameter(torch.linspace(-1, 1, ZERO_NUMEL))
    opt = torch.optim.AdamW([p], lr=0.1)
    for step in range(ZERO_STEPS):
        g = _zero_grads(step, 0) + _zero_grads(step, 1)
        p.grad = g / WORLD_SIZE
        opt.step()
    return p.detach().clone()


def _zero1_reference():
    def zero1_step(flat_param: torch.Tensor, flat_grad: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        shard = optimizer.param_groups[0]["params"][0]
        ws, rank = dist.get_world_size(), dist.get_rank()
        a, b = D.shard_range(flat_param.numel(), rank, ws)
        shard.grad = D.reduce_scatter_flat(flat_grad)  # this rank's shard of the mean, in a new buffer
        optimizer.step()
        D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)
    return zero1_step


@register("08.zero1_step", reference=_zero1_reference, title="the ZeRO-1 step")
def check_zero1_step(fn) -> None:
    expect(callable(fn), f"zero1_step: expected a function, got {type(fn).__name__}")
    ranks = _launch(_zero_worker, fn)
    want = _zero_expected()
    for rank, (got, passes, calls) in enumerate(ranks):
        name = f"rank {rank}: the parameters after {ZERO_STEPS} steps"
        expect_type(name, got, torch.Tensor)
        expect(torch.equal(got, want),
               f"{name}: max abs diff {(got - want).abs().max().item():.3g} from AdamW on one process with the mean "
               f"gradient; every rank must hold every updated parameter (all-gather after the step)")
        sent = ", ".join(f"{k} x{v // ZERO_STEPS}" for k, v in calls.items()) or "no collective"
        expect(passes <= 2 + 1e-9,
               f"rank {rank}: sent {passes:.2f} ring passes over the flat buffer per step ({sent}), expected 2: "
               f"ZeRO-1 reduce-scatters the gradient (a rank needs only its shard of the mean; an all-reduce costs "
               f"2 passes by itself) and all-gathers the updated shards (1 pass)")


# ----------------------------------------------------------------------------- 08.predict_rank_bytes
PREDICT_MODEL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, vocab_size=131)
_MEASURED: dict[str, Any] = {}


def _predict_worker(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [D.train_rank(rank, world_size, s, steps=2, batch_size=2, seq_len=8, model_kwargs=PREDICT_MODEL)
            for s in D.STAGES]


def measured_rank_bytes() -> list[dict[str, Any]]:
    """Rank 0's results of :func:`memlab.distributed.train_rank` for stages 0-3 on the check's model
    (measured once per process, then reused)."""
    if "ranks" not in _MEASURED:
        _MEASURED["ranks"] = D.launch(_predict_worker, WORLD_SIZE, timeout=50)[0]
    return _MEASURED["ranks"]


def _predict_reference():
    def predict_rank_bytes(model: torch.nn.Module, world_size: int, stage: int) -> dict[str, int]:
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        shard = D.padded_size(n, world_size) // world_size
        if stage == 0:
            return {"parameters": 4 * n, "gradients": 0, "optimizer": 8 * n + 4 * len(params)}
        if stage in (1, 2):
            return {"parameters": 4 * shard * world_size, "gradients": 4 * shard * (world_size if stage == 1 else 1),
                    "optimizer": 8 * shard + 4}
        local = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) for p in params)
        return {"parameters": 4 * local, "gradients": 0, "optimizer": 8 * local + 4 * len(params)}
    return predict_rank_bytes


@register("08.predict_rank_bytes", reference=_predict_reference, title="predict the bytes per rank", timeout=120)
def check_predict_rank_bytes(fn) -> None:
    from memlab.models import tiny_llama

    expect(callable(fn), f"predict_rank_bytes: expected a function, got {type(fn).__name__}")
    torch.manual_seed(0)
    model = tiny_llama(**PREDICT_MODEL)
    measured = measured_rank_bytes()
    for stage, m in zip(D.STAGES, measured):
        got = fn(model, WORLD_SIZE, stage)
        expect_type(f"predict_rank_bytes(model, 2, stage={stage})", got, dict)
        for key in ("parameters", "gradients", "optimizer"):
            expect(key in got, f"stage {stage}: the prediction has no {key!r} (keys: parameters, gradients, optimizer)")
            want = m["bytes"][key]
            err = abs(got[key] - want) / max(want, 1)
            expect((want == 0 and got[key] == 0) or (want > 0 and err <= 0.01),
                   f"stage {stage}, {key}: predicted {got[key]:,} B, measured {want:,} B on rank 0 after the step "
                   f"(error {100 * err:.1f}%; allowed: 1%)")
