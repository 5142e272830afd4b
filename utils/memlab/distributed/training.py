"""One training run per rank under ZeRO stage 0-3, and its single-process twin.

Shared by the tests, ``memlab bench distributed`` and chapter 08: the same tiny Llama, seed and
global batches everywhere, so that every stage can be compared with single-process training.
:func:`rank_peaks` measures one rank's peak over a step twice: by the CPU allocator's own events
(``torch.profiler``, :func:`memlab.profiler.allocator_peak`) and by the rank tracker.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from memlab.core.validation import check_choice, check_positive_int, invalid
from memlab.distributed.comm import CommCounter
from memlab.distributed.fsdp import fsdp2_shard
from memlab.distributed.ranks import rank_bytes, rank_tracker
from memlab.distributed.zero import STAGES, ZeroOptimizer

__all__ = ["global_batches", "single_process_losses", "train_rank", "rank_peaks"]


def global_batches(steps: int, batch_size: int, seq_len: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of a run: random token ids in ``[0, vocab)``, the same on every rank and in
    every process; ``steps`` pairs ``(inputs, targets)``, each ``(batch_size, seq_len)`` (each rank takes
    its ``batch_size / world_size`` rows)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch_size, seq_len), generator=g),
             torch.randint(0, vocab, (batch_size, seq_len), generator=g)) for _ in range(steps)]


def single_process_losses(steps: int = 3, *, batch_size: int = 4, seq_len: int = 32, world_size: int = 2,
                          lr: float = 1e-3, seed: int = 0, full_batch: bool = False,
                          model_kwargs: dict | None = None) -> dict[str, Any]:
    """The single-process twin of :func:`train_rank`: the same model, seed and global batches, AdamW.

    The gradient of the global batch is the sum of each rank's micro-batch gradient scaled by
    ``1/world_size``, accumulated in rank order: what the ranks compute, bit for bit.

    Args:
        world_size: the ranks whose micro-batches are replayed.
        full_batch: one forward on the whole batch instead (equal up to rounding).
        model_kwargs: passed to :func:`memlab.models.tiny_llama`.

    Returns:
        ``losses`` (the mean over micro-batches, as the ranks report it) and ``params`` (flat).
    """
    from memlab.models import lm_loss, tiny_llama

    torch.manual_seed(seed)
    model = tiny_llama(**(model_kwargs or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in global_batches(steps, batch_size, seq_len, model.config.vocab_size, seed + 1):
        if full_batch:
            loss = lm_loss(model, x, y)
            loss.backward()
        else:
            parts = []
            for xs, ys in zip(x.chunk(world_size), y.chunk(world_size)):
                part = lm_loss(model, xs, ys)
                (part / world_size).backward()
                parts.append(part.detach())
            loss = torch.stack(parts).sum() / world_size
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _rank_model(stage: int, lr: float, param_dtype: torch.dtype | None, cpu_offload: bool,
                model_kwargs: dict | None) -> tuple[nn.Module, Any, int, int]:
    # (model, optimizer, parameters, parameter tensors) of one rank under ``stage`` (seeded by the caller)
    from memlab.models import tiny_llama

    model = tiny_llama(**(model_kwargs or {}))
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    if stage == 3:
        fsdp2_shard(model, param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                    cpu_offload=cpu_offload)
    if stage in (1, 2):
        opt: Any = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, n_params, n_tensors


def _step(model: nn.Module, opt: Any, stage: int, world_size: int, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    # forward, backward, gradient averaging (stage 0: an all-reduce per gradient, as DDP), update
    from memlab.models import lm_loss

    loss = lm_loss(model, xs, ys)
    loss.backward()
    if stage == 0:
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(world_size)  # gloo has no AVG
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _full_params(model: nn.Module) -> torch.Tensor:
    # every parameter, flat; FSDP2's DTensors gathered in full
    flat = []
    for p in model.parameters():
        full = getattr(p, "full_tensor", None)
        flat.append((full() if callable(full) else p).detach().float().reshape(-1))
    return torch.cat(flat)


def train_rank(rank: int, world_size: int, stage: int, steps: int = 3, *, batch_size: int = 4, seq_len: int = 32,
               lr: float = 1e-3, seed: int = 0, param_dtype: torch.dtype | None = None, cpu_offload: bool = False,
               model_kwargs: dict | None = None, return_params: bool = False) -> dict[str, Any]:
    """Train :func:`memlab.models.tiny_llama` on this rank under ZeRO ``stage`` and report what the rank holds.

    Run it with :func:`memlab.distributed.launch`: ``launch(train_rank, 2, 1)``. Stage 0: data
    parallelism (each gradient all-reduced, a full AdamW on every rank); 1 and 2:
    :class:`ZeroOptimizer`; 3: FSDP2 (:func:`fsdp2_shard`). Every rank takes its
    ``batch_size / world_size`` rows of each global batch. The last step runs under
    :func:`rank_tracker` and a :class:`CommCounter`.

    Args:
        batch_size: rows per global batch, a multiple of ``world_size``.
        param_dtype: stage 3's compute dtype (a mixed-precision policy, reduced in fp32), or None.
        cpu_offload: stage 3 with FSDP2's CPU offload policy.
        model_kwargs: passed to :func:`memlab.models.tiny_llama`.
        return_params: also return the full flat parameters (gathered for stage 3).

    Returns:
        ``losses`` (the global batch's mean loss per step, the same on every rank), ``bytes``
        (:func:`rank_bytes` after the last step), ``peak_bytes``, ``at_peak`` and ``at_end`` (the
        tracker's breakdowns), ``peak_phase``, ``step_seconds`` (the median untracked step after
        the first; the first alone when ``steps`` is 2), ``n_params``, ``n_tensors`` (parameter
        tensors), ``comm_bytes`` / ``comm_calls`` (over the last step, the loss's all-reduce for
        reporting excluded), with ``return_params`` also ``params``.

    Raises:
        ValueError: an unknown stage, or a batch that does not split evenly over the ranks.
    """
    check_choice("stage", stage, STAGES)
    if batch_size % world_size:
        raise invalid("batch_size", batch_size, f"a multiple of world_size={world_size}")
    torch.manual_seed(seed)
    model, opt, n_params, n_tensors = _rank_model(stage, lr, param_dtype, cpu_offload, model_kwargs)
    losses, times = [], []
    tracker = rank_tracker(model, opt)
    counter = CommCounter(world_size)
    for i, (x, y) in enumerate(global_batches(steps, batch_size, seq_len, model.config.vocab_size, seed + 1)):
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        last = i == steps - 1
        if last:
            tracker.__enter__()
            counter.__enter__()
        t0 = time.perf_counter()
        try:
            loss = _step(model, opt, stage, world_size, xs, ys)
        finally:
            if last:
                counter.__exit__(None, None, None)
                tracker.__exit__(None, None, None)
        if not last:  # the tracked step is slower (the tracker's bookkeeping): not timed
            times.append(time.perf_counter() - t0)
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        losses.append((total / world_size).item())
    out = {
        "rank": rank, "stage": stage, "losses": losses, "bytes": rank_bytes(model, opt),
        "peak_bytes": tracker.peak_bytes, "at_peak": tracker.breakdown("peak"), "at_end": tracker.breakdown("end"),
        "peak_phase": tracker.peak_phase, "step_seconds": _median(times[1:] or times or [float("nan")]),
        "n_params": n_params, "n_tensors": n_tensors,
        "comm_bytes": dict(counter.sent), "comm_calls": dict(counter.calls),
    }
    if return_params:
        out["params"] = _full_params(model)
    return out


def rank_peaks(rank: int, world_size: int, stage: int, *, tries: int = 16, batch_size: int = 4, seq_len: int = 32,
               lr: float = 1e-3, seed: int = 0, param_dtype: torch.dtype | None = None, cpu_offload: bool = False,
               model_kwargs: dict | None = None) -> dict[str, Any]:
    """One rank's peak over one training step under ZeRO ``stage``, by the allocator's events and by the tracker.

    The model, batches and step are :func:`train_rank`'s. After a warm-up step (the optimizer
    state is made in the first), each rank counts what it holds when a step starts
    (:func:`rank_bytes`: parameters, gradient buffers, optimizer state) and adds the CPU allocator's
    rise over the step, replayed from ``torch.profiler``'s memory events with nothing else running
    (:func:`memlab.profiler.allocator_peak`): every block the step allocates, collective buffers and
    kernel scratch included. Then one more step runs under :func:`rank_tracker`.

    The profiler records the frees made on the threads it profiles. gloo's worker threads drop their
    reference to a collective's tensors just after it completes; a tensor whose last reference goes
    there is freed without an event, and the replay keeps it alive to the end (FSDP2's gather and
    reduce buffers, about 4 steps in 10 on a 2-core CPU). A step whose allocator does not come back to where it started is
    such a step: its peak is an upper bound. The step is repeated, up to ``tries`` times, until one
    comes back (``closed``); its replay is then exact.

    Args:
        tries: allocator-counted steps at most, until one is closed.
        (the rest as :func:`train_rank`)

    Returns:
        ``held`` (bytes at the start of the counted step), ``allocator_rise``, ``allocator_peak``
        (``held + allocator_rise``: the lowest over the tries when none is closed), ``closed``,
        ``tries`` (steps counted), ``tracker_peak`` (the tracker's peak over the last step),
        ``n_params``.

    Raises:
        ValueError: an unknown stage, a batch that does not split evenly, ``tries`` < 1.
    """
    from memlab.profiler import allocator_peak  # the profiler is heavy; a launch need not import it

    check_choice("stage", stage, STAGES)
    check_positive_int("tries", tries)
    if batch_size % world_size:
        raise invalid("batch_size", batch_size, f"a multiple of world_size={world_size}")
    torch.manual_seed(seed)
    model, opt, n_params, _ = _rank_model(stage, lr, param_dtype, cpu_offload, model_kwargs)
    (x0, y0), (x, y) = global_batches(2, batch_size, seq_len, model.config.vocab_size, seed + 1)
    _step(model, opt, stage, world_size, x0.chunk(world_size)[rank], y0.chunk(world_size)[rank])
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    best: tuple[int, int] | None = None  # (held, rise) of a closed step, else the lowest upper bound so far
    closed = False
    for k in range(1, tries + 1):
        held = sum(rank_bytes(model, opt).values())
        # the same batch tensors, made before, in every counted step and in the tracked one: neither counts them
        rise, end = allocator_peak(lambda: _step(model, opt, stage, world_size, xs, ys))
        if not closed and (end == 0 or best is None or held + rise < sum(best)):
            best, closed = (held, rise), end == 0
        # every rank runs as many steps as the others (their collectives pair up): go on until all have one closed
        still_open = torch.tensor([0 if closed else 1])
        dist.all_reduce(still_open)
        if still_open.item() == 0:
            break
    tracker = rank_tracker(model, opt)
    with tracker:
        _step(model, opt, stage, world_size, xs, ys)
    held, rise = best
    return {"held": held, "allocator_rise": rise, "allocator_peak": held + rise, "closed": closed, "tries": k,
            "tracker_peak": tracker.peak_bytes, "n_params": n_params}
