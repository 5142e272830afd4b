"""Checks for chapter 08, beyond one GPU (ZeRO from scratch).

08.shard_flat          rank r's shard of a flat buffer: zero-padded to a multiple of the world size,
                       the r-th of N equal contiguous pieces
08.reduce_scatter      this rank's shard of the mean of every rank's flat gradient, with collectives
                       (run on 2 gloo processes, differently seeded), bitwise, in one ring pass (CommCounter)
08.zero1_step          one ZeRO-1 step: reduce-scatter the gradients, step on this rank's shard,
                       all-gather (2 gloo processes, 3 steps, bit for bit against AdamW and plain SGD on one
                       process (SGD shows a gradient scale that AdamW hides);
                       at most 2 ring passes sent per step, counted by CommCounter: an all-reduce,
                       which gives the same numbers, sends 3)
08.predict_rank_bytes  predict the parameter / gradient / optimizer bytes one rank holds under ZeRO
                       stages 0-3 at the optimizer step (the model state at the peak: the paper's formula),
                       exactly, against ranks measured on 2 processes (an odd vocabulary; tied embeddings)

The references live in memlab.distributed, tested against single-process training and FSDP2.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from memlab import distributed as D
from memlab.course.checks import Space, differential, expect, expect_type, ints, layouts, make_tensor, one_of, register

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
        if last and ("AssertionError" in last[0] or "HygieneError" in last[0]):  # a check or probe that failed on the rank
            raise AssertionError(f"on rank {exc.rank}: {last[0].partition(':')[2].strip()}") from None
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
    """Grade exercise ``08.shard_flat``: shard a flat buffer."""
    expect(callable(fn), f"shard_flat: expected a function, got {type(fn).__name__}")
    def run(case) -> None:
        numel, ws = case.numel, case.ws
        flat = (torch.arange(1, numel + 1, dtype=torch.float32) if case.values == "arange" else
                make_tensor((numel,), case.dtype, case.layout, case.seed, low=-100, high=100)).to(case.dtype)
        if case.layout == "offset" and case.values == "arange":  # a view into a larger buffer, as a flat parameter often is
            flat = torch.cat([torch.zeros(3, dtype=case.dtype), flat])[3:]
        shards = []
        for r in range(ws):
            got = fn(flat, r, ws)
            _tensor_equal(f"shard_flat({case.values} of {numel} {case.dtype} ({case.layout}), rank={r}, world_size={ws})",
                          got, D.shard_flat(flat, r, ws))
            shards.append(got)
        expect(torch.equal(torch.cat(shards)[:numel], flat),
               f"world_size={ws}, {numel} elements: the shards in rank order, padding dropped, must give the buffer back")

    edges = [dict(numel=n, ws=w, dtype=torch.float32, values="arange", layout="contiguous") for n, w in
             ((12, 2), (12, 4), (10, 4), (7, 3), (1, 2), (5, 8))]
    edges.append(dict(numel=6, ws=4, dtype=torch.bfloat16, values="arange", layout="contiguous"))  # keep the dtype
    # any size (smaller than the world too), world sizes 1-9, every dtype a flat buffer has, a view at an offset
    space = Space(numel=ints(1, 300), ws=ints(1, 9), dtype=one_of(torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64),
                  values=one_of("arange", "random"), layout=layouts("contiguous", "offset"))
    differential(space, run, edges=edges, examples=30)


# ----------------------------------------------------------------------------- 08.reduce_scatter
def _rs_worker(rank: int, world_size: int, fn: Any) -> list[tuple[torch.Tensor, float, dict[str, int]]]:
    torch.manual_seed(1234 + rank)  # differently seeded ranks: only the gradients passed in may matter
    out = []
    for numel in RS_SIZES:
        g = torch.Generator().manual_seed(100 * numel + rank)
        counter = D.CommCounter(world_size)
        with counter:
            got = fn(torch.randn(numel, generator=g))
        # bytes sent in ring passes over the padded fp32 buffer, (N-1)/N x 4 x padded bytes each
        passes = counter.total / ((world_size - 1) / world_size * 4 * D.padded_size(numel, world_size))
        out.append((got, passes, dict(counter.calls)))
    return out


RS_SIZES = (8, 10, 7)


def _rs_expected(rank: int, world_size: int) -> list[torch.Tensor]:
    out = []
    for numel in RS_SIZES:
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
    """Grade exercise ``08.reduce_scatter``: reduce-scatter the gradients."""
    expect(callable(fn), f"reduce_scatter: expected a function, got {type(fn).__name__}")
    ranks = _launch(_rs_worker, fn)
    for rank, got in enumerate(ranks):
        for numel, (g, passes, calls), want in zip(RS_SIZES, got, _rs_expected(rank, WORLD_SIZE)):
            name = f"rank {rank}, a gradient of {numel} elements"
            expect_type(name, g, torch.Tensor)
            expect(tuple(g.shape) == tuple(want.shape),
                   f"{name}: shape {tuple(g.shape)}, expected {tuple(want.shape)} (pad to a multiple of the world size, "
                   f"keep 1/N)")
            expect(g.dtype == want.dtype, f"{name}: dtype {g.dtype}, expected {want.dtype}")
            expect(torch.equal(g, want),
                   f"{name}: got {g.tolist()}, expected {want.tolist()} (the mean over ranks of this rank's piece: the "
                   "sum of 2 numbers, then / 2, is exact, so the check is bitwise)")
            sent = ", ".join(f"{k} x{v}" for k, v in calls.items()) or "no collective"
            expect(passes <= 1 + 1e-9,
                   f"{name}: sent {passes:.2f} ring passes over the padded buffer ({sent}), expected 1: a reduce-scatter "
                   "sends (N-1)/N of the buffer; an all-reduce (2 passes) or an all-gather of every rank's gradient "
                   "(N-1 of them) gives the same numbers for more bytes")


# ----------------------------------------------------------------------------- 08.zero1_step
ZERO_STEPS = 3
ZERO_NUMEL = 11


def _zero_grads(step: int, rank: int) -> torch.Tensor:
    return torch.randn(ZERO_NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank))


def _zero_worker(rank: int, world_size: int, fn: Any, optim: str) -> tuple[torch.Tensor, float, dict[str, int]]:
    torch.manual_seed(1234 + rank)  # differently seeded ranks
    n_pad = D.padded_size(ZERO_NUMEL, world_size)
    flat = torch.zeros(n_pad)
    flat[:ZERO_NUMEL] = torch.linspace(-1, 1, ZERO_NUMEL)
    a, b = D.shard_range(ZERO_NUMEL, rank, world_size)
    shard = torch.nn.Parameter(flat[a:b])
    opt = _OPTIMIZERS[optim]([shard])
    counter = D.CommCounter(world_size)
    for step in range(ZERO_STEPS):
        grad = torch.zeros(n_pad)
        grad[:ZERO_NUMEL] = _zero_grads(step, rank)
        with counter:
            fn(flat, grad, opt)
    # bytes sent per step in ring passes over the padded fp32 buffer: (N-1)/N x 4 x n_pad bytes each
    passes = counter.total / ZERO_STEPS / ((world_size - 1) / world_size * 4 * n_pad)
    return flat[:ZERO_NUMEL].clone(), passes, dict(counter.calls)


# AdamW hides a constant scale of the gradient (m / sqrt(v)); plain SGD shows it (averaging twice, a sum)
_OPTIMIZERS = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1),
               "SGD": lambda ps: torch.optim.SGD(ps, lr=0.5)}


def _zero_expected(optim: str) -> torch.Tensor:
    p = torch.nn.Parameter(torch.linspace(-1, 1, ZERO_NUMEL))
    opt = _OPTIMIZERS[optim]([p])
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


@register("08.zero1_step", reference=_zero1_reference, mutates=("flat_param", "flat_grad", "optimizer"), title="the ZeRO-1 step")
def check_zero1_step(fn) -> None:
    """Grade exercise ``08.zero1_step``: the ZeRO-1 step."""
    expect(callable(fn), f"zero1_step: expected a function, got {type(fn).__name__}")
    for optim in _OPTIMIZERS:
        ranks = _launch(_zero_worker, fn, optim)
        want = _zero_expected(optim)
        for rank, (got, passes, calls) in enumerate(ranks):
            name = f"rank {rank}, {optim}: the parameters after {ZERO_STEPS} steps"
            expect_type(name, got, torch.Tensor)
            expect(torch.equal(got, want),
                   f"{name}: max abs diff {(got - want).abs().max().item():.3g} from {optim} on one process with the "
                   f"mean gradient; every rank must hold every updated parameter (all-gather after the step), and the "
                   f"gradient is the mean: summed once, divided by N once")
            sent = ", ".join(f"{k} x{v // ZERO_STEPS}" for k, v in calls.items()) or "no collective"
            expect(passes <= 2 + 1e-9,
                   f"rank {rank}: sent {passes:.2f} ring passes over the flat buffer per step ({sent}), expected 2: "
                   f"ZeRO-1 reduce-scatters the gradient (a rank needs only its shard of the mean; an all-reduce costs "
                   f"2 passes by itself) and all-gathers the updated shards (1 pass)")


# ----------------------------------------------------------------------------- 08.predict_rank_bytes
PREDICT_MODEL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, vocab_size=131)
PREDICT_MODELS = [("a tiny Llama with an odd vocabulary (131)", PREDICT_MODEL),
                  ("the same with tied embeddings (lm_head shares embed_tokens' weight)",
                   dict(PREDICT_MODEL, tie_word_embeddings=True))]
_MEASURED: dict[Any, Any] = {}


def _predict_worker(rank: int, world_size: int, model_kwargs: dict) -> list[dict[str, int]]:
    """What this rank holds at the optimizer step of the second training step, after ``optimizer.step()``
    and before ``zero_grad``: the model state at the peak of stages 0-2 (see the lecture)."""
    from memlab.models import lm_loss, tiny_llama

    out = []
    for stage in D.STAGES:
        torch.manual_seed(0)
        model = tiny_llama(**model_kwargs)
        if stage == 3:
            D.fsdp2_shard(model)
        opt: Any = (D.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3) if stage in (1, 2)
                    else torch.optim.AdamW(model.parameters(), lr=1e-3))
        g = torch.Generator().manual_seed(1 + rank)
        for i in range(2):
            x = torch.randint(0, model.config.vocab_size, (1, 8), generator=g)
            lm_loss(model, x, x).backward()
            if stage == 0:
                with torch.no_grad():
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(world_size)
            opt.step()
            if i == 1:
                out.append(D.rank_bytes(model, opt))
            opt.zero_grad(set_to_none=True)
    return out


def measured_rank_bytes(model_kwargs: dict | None = None) -> list[dict[str, int]]:
    """Rank 0's :func:`memlab.distributed.rank_bytes` for stages 0-3 at the optimizer step (after
    ``optimizer.step()``, before ``zero_grad``) of a tiny Llama built with ``model_kwargs``
    (default :data:`PREDICT_MODEL`), measured on 2 processes once per process, then reused: one
    dict per stage, category -> bytes.
    """
    kw = dict(PREDICT_MODEL if model_kwargs is None else model_kwargs)
    key = tuple(sorted(kw.items()))
    if key not in _MEASURED:
        _MEASURED[key] = D.launch(_predict_worker, WORLD_SIZE, kw, timeout=50)[0]
    return _MEASURED[key]


def _predict_reference():
    def predict_rank_bytes(model: torch.nn.Module, world_size: int, stage: int) -> dict[str, int]:
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        shard = D.padded_size(n, world_size) // world_size
        if stage == 0:
            return {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * len(params)}
        if stage in (1, 2):
            return {"parameters": 4 * shard * world_size, "gradients": 4 * shard * (world_size if stage == 1 else 1),
                    "optimizer": 8 * shard + 4}
        local = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) for p in params)
        return {"parameters": 4 * local, "gradients": 4 * local, "optimizer": 8 * local + 4 * len(params)}
    return predict_rank_bytes


@register("08.predict_rank_bytes", reference=_predict_reference, title="predict the bytes per rank", timeout=180)
def check_predict_rank_bytes(fn) -> None:
    """Grade exercise ``08.predict_rank_bytes``: predict the bytes per rank."""
    from memlab.models import tiny_llama

    expect(callable(fn), f"predict_rank_bytes: expected a function, got {type(fn).__name__}")
    for what, kw in PREDICT_MODELS:
        torch.manual_seed(0)
        model = tiny_llama(**kw)
        measured = measured_rank_bytes(kw)
        for stage, m in zip(D.STAGES, measured):
            got = fn(model, WORLD_SIZE, stage)
            expect_type(f"predict_rank_bytes(model, 2, stage={stage})", got, dict)
            for key in ("parameters", "gradients", "optimizer"):
                expect(key in got, f"stage {stage}: the prediction has no {key!r} (keys: parameters, gradients, optimizer)")
                expect_type(f"stage {stage}, {key}", got[key], int)
                want = m[key]
                expect(got[key] == want,
                       f"{what}, stage {stage}, {key}: predicted {got[key]:,} B, measured {want:,} B on rank 0 at the "
                       f"optimizer step ({got[key] - want:+,} B; the count is exact, so the prediction must be)")
