"""Checks for chapter 08, beyond one GPU (ZeRO from scratch).

08.shard_flat          rank r's shard of a flat buffer: zero-padded to a multiple of the world size,
                       the r-th of N equal contiguous pieces
08.reduce_scatter      this rank's shard of the mean of every rank's flat gradient, with collectives, on 4 and 5
                       gloo processes and subgroups of them (3 ranks out of order, 2, one alone), any length, four
                       dtypes, views at an offset; bitwise on power-of-two groups, else within a sum's rounding;
                       in one ring pass (CommCounter)
08.zero1_step          one ZeRO-1 step: reduce-scatter the gradients, step on this rank's shard, all-gather (2-5
                       gloo processes, 1-3 steps, any length, fp32/fp64/bf16), against AdamW and plain SGD on one
                       process (SGD shows a gradient scale that AdamW hides); at most 2 ring passes sent per step,
                       counted by CommCounter: an all-reduce, which gives the same numbers, sends 3)
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
from memlab.course.checks import (Case, Space, differential, expect, expect_type, flags, ints, layouts, make_tensor, one_of,
                                  register)
from memlab.course.grading.cases import note_failure, state_input

WORLD_SIZE = 2


def _launch(worker, world_size: int, *args: Any) -> list[Any]:
    """Run ``worker`` on ``world_size`` processes; a learner's stub (NotImplementedError) stays a todo, any other
    exception on a rank becomes this process's error with the rank's last lines."""
    with D.CommCounter(1):  # its first use imports torch._dynamo (seconds): once here, not in every forked rank
        torch.zeros(1).add_(1)
    try:
        return D.launch(worker, world_size, *args, timeout=50)
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


# ----------------------------------------------------------------------------- shared by 08.reduce_scatter, 08.zero1_step
def _grid_values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gradient values on a grid of quarters in [-4, 4]: exact in every dtype, and their sums over up to 5 ranks are
    exact in any order (gloo's ring adds in its own order), so a sum is bitwise whatever the route."""
    return (make_tensor((numel,), torch.int64, "contiguous", seed, low=-16, high=17).double() / 4).to(dtype)


def _judged(case: Any, edges: list, judge: Any, *args: Any) -> None:
    """``judge(case, *args)`` on a case drawn earlier and run later on the ranks (differential cannot see it fail):
    a failure is recorded as the edge's or, for a case of the space (swept or drawn), as drawn."""
    try:
        judge(case, *args)
    except BaseException as exc:
        note_failure(case, edges)
        edge = case in [Case(**{**e, "seed": e.get("seed", 0)}) for e in edges]
        raise state_input(exc, case, "the hand-picked input" if edge else
                          "the smallest failing input of those run on the ranks")


def _placed(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` as the caller's buffer: contiguous, or a view 3 elements into a larger one (a flat gradient often is)."""
    if layout == "offset":
        return torch.cat([t.new_full((3,), 7), t])[3:]
    return t


def _within_mean_rounding(name: str, got: torch.Tensor, want: torch.Tensor, ws: int, scale: torch.Tensor) -> None:
    """Bitwise when the world size is a power of two (the sum is exact, so is / N); else within what summing N
    terms rounds (N ulps of ``scale``, the mean of the magnitudes): dividing each gradient by N first and then summing
    is the mean too."""
    _tensor_equal_shape(name, got, want)
    if ws & (ws - 1) == 0:
        _tensor_equal(name, got, want)
        return
    eps = torch.finfo(want.dtype).eps
    bound = ws * eps * scale.double() + torch.finfo(want.dtype).tiny
    err = (got.double() - want.double()).abs()
    bad = (err > bound) | torch.isnan(got.double())
    if bool(bad.any()):
        i = int(bad.nonzero()[0][0])
        raise AssertionError(f"{name}: {int(bad.sum())} of {want.numel()} entries differ by more than summing {ws} "
                             f"terms rounds (first at [{i}]: got {got[i].item()!r}, expected {want[i].item()!r})")


def _tensor_equal_shape(name: str, got: Any, want: torch.Tensor) -> None:
    expect_type(name, got, torch.Tensor)
    expect(tuple(got.shape) == tuple(want.shape),
           f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)} (pad to a multiple of the world size, keep 1/N)")
    expect(got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype} (keep the gradient's dtype)")


def _passes(counter: Any, ws: int, nbytes: int) -> float:
    """Bytes sent, in ring passes over a buffer of ``nbytes``: (N-1)/N x nbytes each; a group of one sends none."""
    return counter.total / ((ws - 1) / ws * nbytes) if ws > 1 else (0.0 if counter.total == 0 else float("inf"))


# ----------------------------------------------------------------------------- 08.reduce_scatter
# The groups a case runs on: the default group of a 4- or 5-rank launch, or a subgroup of it (ranks not in order,
# a group of one). Every rank of the launch creates every subgroup (torch.distributed requires it).
RS_GROUPS = {"all 5 ranks": (5, None), "all 4 ranks": (4, None), "ranks [1, 3, 4] of 5": (5, (1, 3, 4)),
             "ranks [0, 2] of 5": (5, (0, 2)), "ranks [0, 1, 2] of 4": (4, (0, 1, 2)), "rank [3] alone of 4": (4, (3,))}


def _rs_grad(case: Any, group_rank: int) -> torch.Tensor:
    return _grid_values(case.numel, case.dtype, 1000 * case.seed + group_rank)


def _rs_worker(rank: int, world_size: int, fn: Any, cases: list) -> list:
    torch.manual_seed(1234 + rank)  # differently seeded ranks: only the gradients passed in may matter
    groups = {name: (dist.new_group(list(members)) if members is not None else None, members)
              for name, (size, members) in RS_GROUPS.items() if size == world_size}
    out = []
    for case in cases:
        group, members = groups[case.group]
        if members is not None and rank not in members:
            out.append(None)
            continue
        ws, r = dist.get_world_size(group), dist.get_rank(group)
        flat = _placed(_rs_grad(case, r), case.layout)
        counter = D.CommCounter(ws)
        try:
            with counter:
                got = fn(flat, group) if group is not None else fn(flat)
        except AssertionError as exc:  # a probe of the harness, on this rank
            raise AssertionError(f"{exc} ({case})") from None
        out.append((got, _passes(counter, ws, D.padded_size(case.numel, ws) * flat.element_size()), dict(counter.calls)))
    return out


def _rs_expected(case: Any, ws: int, group_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this group rank's shard of the mean, the mean of the magnitudes) for ``case`` on ``ws`` ranks."""
    grads = [_rs_grad(case, r).double() for r in range(ws)]
    mean = (sum(grads) / ws).to(case.dtype)
    return D.shard_flat(mean, group_rank, ws), D.shard_flat(sum(g.abs() for g in grads) / ws, group_rank, ws)


def _reduce_scatter_reference():
    def reduce_scatter(flat_grad: torch.Tensor, group=None) -> torch.Tensor:
        pad = D.padded_size(flat_grad.numel(), dist.get_world_size(group)) - flat_grad.numel()
        return D.reduce_scatter_flat(torch.cat([flat_grad, flat_grad.new_zeros(pad)]), group)
    return reduce_scatter


def _check_rs_case(case: Any, rank: int, result: Any) -> None:
    size, members = RS_GROUPS[case.group]
    ws = len(members) if members is not None else size
    r = members.index(rank) if members is not None else rank
    g, passes, calls = result
    want, scale = _rs_expected(case, ws, r)
    name = (f"rank {r} of {ws} ({case.group}; group={'None' if members is None else 'a subgroup'}), a {case.dtype} "
            f"gradient of {case.numel} elements ({case})")
    _within_mean_rounding(name, g, want, ws, scale)
    sent = ", ".join(f"{k} x{v}" for k, v in calls.items()) or "no collective"
    expect(passes <= 1 + 1e-9,
           f"{name}: sent {passes:.2f} ring passes over the padded buffer ({sent}), expected 1: a reduce-scatter "
           "sends (N-1)/N of the buffer; an all-reduce (2 passes) or an all-gather of every rank's gradient "
           "(N-1 of them) gives the same numbers for more bytes" + (
               "; on a group of one rank nothing needs sending" if ws == 1 else ""))


@register("08.reduce_scatter", reference=_reduce_scatter_reference, title="reduce-scatter the gradients")
def check_reduce_scatter(fn) -> None:
    """Grade exercise ``08.reduce_scatter``: reduce-scatter the gradients."""
    expect(callable(fn), f"reduce_scatter: expected a function, got {type(fn).__name__}")
    cases: list = []
    edges = [dict(group="ranks [0, 2] of 5", numel=n, dtype=torch.float32, layout="contiguous") for n in (8, 10, 7)]
    # any length (shorter than the group too), four dtypes, a view at an offset, world sizes 1-5 and subgroups
    space = Space(group=one_of(*RS_GROUPS), numel=ints(1, 150),
                  dtype=one_of(torch.float32, torch.bfloat16, torch.float16, torch.float64),
                  layout=layouts("contiguous", "offset"))
    differential(space, cases.append, edges=edges, examples=24)  # drawn here, run on the ranks in one launch per size
    results = []
    for size in sorted({RS_GROUPS[c.group][0] for c in cases}):
        mine = [c for c in cases if RS_GROUPS[c.group][0] == size]
        ranks = _launch(_rs_worker, size, fn, mine)
        results += [(c, rank, got[i]) for i, c in enumerate(mine) for rank, got in enumerate(ranks) if got[i] is not None]
    # the smallest failing case of every launch first (cases run in other processes are not shrunk)
    for case, rank, got in sorted(results, key=lambda r: (r[0].numel, RS_GROUPS[r[0].group][0])):
        _judged(case, edges, _check_rs_case, rank, got)


# ----------------------------------------------------------------------------- 08.zero1_step
# AdamW hides a constant scale of the gradient (m / sqrt(v)); plain SGD shows it (averaging twice, a sum)
_OPTIMIZERS = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1),
               "SGD": lambda ps: torch.optim.SGD(ps, lr=0.5)}


def _zero_grad(case: Any, step: int, rank: int) -> torch.Tensor:
    return _grid_values(case.numel, case.dtype, 1000 * case.seed + 100 * step + rank)


def _zero_start(case: Any) -> torch.Tensor:
    return torch.linspace(-1, 1, case.numel, dtype=torch.float64).to(case.dtype)


def _zero_worker(rank: int, world_size: int, fn: Any, cases: list) -> list:
    torch.manual_seed(1234 + rank)  # differently seeded ranks
    out = []
    for case in cases:
        n_pad = D.padded_size(case.numel, world_size)
        flat = torch.zeros(n_pad, dtype=case.dtype)
        flat[:case.numel] = _zero_start(case)
        a, b = D.shard_range(case.numel, rank, world_size)
        shard = torch.nn.Parameter(flat[a:b])
        opt = _OPTIMIZERS[case.optim]([shard])
        counter = D.CommCounter(world_size)
        for step in range(case.steps):
            grad = torch.zeros(n_pad, dtype=case.dtype)
            grad[:case.numel] = _zero_grad(case, step, rank)
            try:
                with counter:
                    fn(flat, grad, opt)
            except AssertionError as exc:  # a probe of the harness, on this rank
                raise AssertionError(f"{exc} ({case})") from None
        # bytes sent per step in ring passes over the padded buffer: (N-1)/N x its bytes each
        passes = _passes(counter, world_size, n_pad * flat.element_size()) / case.steps
        out.append((flat[:case.numel].clone(), passes, dict(counter.calls)))
    return out


def _zero_expected(case: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(the parameters after the steps of ``case.optim`` on one process with the mean gradient, the gradients' scale)."""
    p = torch.nn.Parameter(_zero_start(case))
    opt = _OPTIMIZERS[case.optim]([p])
    for step in range(case.steps):
        grads = [_zero_grad(case, step, r).double() for r in range(case.ws)]
        p.grad = (sum(grads) / case.ws).to(case.dtype)
        opt.step()
    return p.detach().clone(), p.detach().abs().double() + opt.param_groups[0]["lr"]


def _zero1_reference():
    def zero1_step(flat_param: torch.Tensor, flat_grad: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        shard = optimizer.param_groups[0]["params"][0]
        ws, rank = dist.get_world_size(), dist.get_rank()
        a, b = D.shard_range(flat_param.numel(), rank, ws)
        shard.grad = D.reduce_scatter_flat(flat_grad)  # this rank's shard of the mean, in a new buffer
        optimizer.step()
        D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)
    return zero1_step


def _check_zero_case(case: Any, rank: int, result: Any) -> None:
    got, passes, calls = result
    want, scale = _zero_expected(case)
    name = (f"rank {rank} of {case.ws}, {case.optim}, {case.numel} {case.dtype} parameters: the parameters after "
            f"{case.steps} step(s) ({case})")
    expect_type(name, got, torch.Tensor)
    try:
        _within_mean_rounding(name, got, want, case.ws, 16 * scale)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; expected {case.optim} on one process with the mean gradient: every rank must "
                             f"hold every updated parameter (all-gather after the step), and the gradient is the mean: "
                             f"summed once, divided by N once") from None
    sent = ", ".join(f"{k} x{v // case.steps}" for k, v in calls.items()) or "no collective"
    expect(passes <= 2 + 1e-9,
           f"rank {rank} of {case.ws} ({case}): sent {passes:.2f} ring passes over the flat buffer per step ({sent}), "
           f"expected 2: ZeRO-1 reduce-scatters the gradient (a rank needs only its shard of the mean; an all-reduce "
           f"costs 2 passes by itself) and all-gathers the updated shards (1 pass)")


@register("08.zero1_step", reference=_zero1_reference, mutates=("flat_param", "flat_grad", "optimizer"), title="the ZeRO-1 step")
def check_zero1_step(fn) -> None:
    """Grade exercise ``08.zero1_step``: the ZeRO-1 step."""
    expect(callable(fn), f"zero1_step: expected a function, got {type(fn).__name__}")
    cases: list = []
    edges = [dict(ws=2, numel=11, optim=o, dtype=torch.float32, steps=3) for o in _OPTIMIZERS]
    # world sizes 2, 3, 4 and 5, any length (padding, shorter than the world), AdamW and SGD, fp32/fp64/bf16, 1-3 steps
    space = Space(ws=one_of(3, 5, 2, 4), numel=ints(1, 60), optim=one_of(*_OPTIMIZERS),
                  dtype=one_of(torch.float32, torch.float64, torch.bfloat16), steps=ints(1, 3))
    differential(space, cases.append, edges=edges, examples=16)  # drawn here, run on the ranks in one launch per size
    results = []
    for ws in sorted({c.ws for c in cases}):
        mine = [c for c in cases if c.ws == ws]
        ranks = _launch(_zero_worker, ws, fn, mine)
        results += [(c, rank, got[i]) for i, c in enumerate(mine) for rank, got in enumerate(ranks)]
    # the smallest failing case of every launch first (cases run in other processes are not shrunk)
    for case, rank, got in sorted(results, key=lambda r: (r[0].numel, r[0].steps, r[0].ws)):
        _judged(case, edges, _check_zero_case, rank, got)


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
    models: dict = {}

    def run(case) -> None:
        kw = dict(hidden_size=case.hidden, intermediate_size=case.inter, num_hidden_layers=case.layers,
                  vocab_size=case.vocab, **({"tie_word_embeddings": True} if case.tied else {}))
        key = tuple(sorted(kw.items()))
        if key not in models:
            torch.manual_seed(0)
            models[key] = tiny_llama(**kw)
        model = models[key]
        what = next((w for w, m in PREDICT_MODELS if m == kw), None)
        if what is not None and case.ws == WORLD_SIZE:  # the lab's models on 2 ranks: against the measurement
            want = measured_rank_bytes(kw)[D.STAGES.index(case.stage)]
            against = "measured on rank 0 at the optimizer step"
        else:  # any other model or world size: against the formula the measurement equals on the lab's models
            what = f"a tiny Llama {kw} on {case.ws} ranks"
            want = _predict_reference()(model, case.ws, case.stage)
            against = "at the optimizer step (the formula that equals the measurement on 2 ranks)"
        stage = case.stage
        got = fn(model, case.ws, stage)
        expect_type(f"predict_rank_bytes(model, {case.ws}, stage={stage})", got, dict)
        for key in ("parameters", "gradients", "optimizer"):
            expect(key in got, f"stage {stage}: the prediction has no {key!r} (keys: parameters, gradients, optimizer)")
            expect_type(f"stage {stage}, {key}", got[key], int)
            expect(got[key] == want[key],
                   f"{what}, stage {stage}, {key}: predicted {got[key]:,} B, expected {want[key]:,} B {against} "
                   f"({got[key] - want[key]:+,} B; the count is exact, so the prediction must be)")

    lab = dict(hidden=PREDICT_MODEL["hidden_size"], inter=PREDICT_MODEL["intermediate_size"],
               layers=PREDICT_MODEL["num_hidden_layers"], vocab=PREDICT_MODEL["vocab_size"], ws=WORLD_SIZE)
    edges = [dict(lab, tied=tied, stage=stage) for tied in (False, True) for stage in D.STAGES]
    # any world size 1-8 (uneven shards, padding), widths, depths, odd vocabularies, tied or not, every stage
    space = Space(hidden=one_of(64, 32, 96), inter=one_of(160, 88), layers=ints(1, 3), vocab=one_of(131, 256, 97),
                  tied=flags(), ws=ints(1, 8), stage=one_of(*D.STAGES))
    differential(space, run, edges=edges, examples=20)
