"""A stack's peak, predicted on fake tensors and measured for real, and the lab's cheapest-stack planner."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from memlab.core.validation import check_positive_int
from memlab.plan import Stack
from memlab.profiler import MemoryTracker
from memlab.train.trainer import BudgetTrainer

__all__ = ["estimate_stack_peak", "cheapest_stack", "measure_stack_peak"]


def estimate_stack_peak(model_fn: Callable[[], nn.Module], stack: Stack, seq_len: int, *, steps: int = 2,
                        vocab_size: int = 256) -> int:
    """Predict :func:`measure_stack_peak` without running anything for real: the same trainer step,
    traced on fake tensors (``FakeTensorMode``: shapes only, nothing allocated) and counted by
    :class:`~memlab.profiler.MemoryTracker`; the highest tracked peak of the steps, in bytes. The
    lab's predict-then-measure reference.

    Args:
        model_fn: builds the model (called under ``FakeTensorMode``).
        steps: optimizer steps to trace (the second one holds the optimizer state).
        vocab_size: the token ids' range for the fake batches.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab.estimate.attention import UnpackedPositions

    check_positive_int("steps", steps)
    # the batches are unpacked: say so to transformers, which cannot read fake position ids (memlab.estimate)
    with FakeTensorMode(), UnpackedPositions():
        model = model_fn()
        E = stack.effective_batch

        def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randint(0, vocab_size, (E, seq_len)), torch.randint(0, vocab_size, (E, seq_len)))

        t = BudgetTrainer.__new__(BudgetTrainer)
        t.model, t.device, t.lr, t.weight_decay = model.train(), torch.device("cpu"), 1e-3, 0.0
        t.effective_batch, t.seq_len, t._batch = E, seq_len, data
        t.optimizer, t._applied = None, None
        t._apply(stack)
        peak = 0
        for step in range(steps):
            with MemoryTracker(model, t.optimizer, timeline=False) as tracker:
                t._optimizer_step(step, stack)
            peak = max(peak, tracker.peak_bytes)
    return peak


def cheapest_stack(effective_batch: int, budget: int, estimate: Callable[[Stack], float],
                   cost: Callable[[Stack], float]) -> Stack | None:
    """The planner of chapter 07's lab over a small search space.

    Candidates: ``Stack(micro_batch=m, grad_accum=effective_batch // m, checkpointing=c)`` for every
    divisor ``m`` of ``effective_batch``, largest first, and ``c`` in ``("none", "full")``. A
    candidate fits when ``estimate(stack) <= budget``. Among those that fit: the smallest
    ``cost(stack)``; ties go to the smaller estimate, then to the earlier candidate. ``None``
    when nothing fits. (:func:`memlab.plan.plan` is the full planner.)

    Args:
        budget: bytes a stack's estimate may reach.
        estimate: stack -> its predicted peak bytes.
        cost: stack -> its cost (time, say).
    """
    check_positive_int("effective_batch", effective_batch)
    best: tuple[float, float, int] | None = None
    pick = None
    i = 0
    for m in sorted((d for d in range(1, effective_batch + 1) if effective_batch % d == 0), reverse=True):
        for c in ("none", "full"):
            s = Stack(micro_batch=m, grad_accum=effective_batch // m, checkpointing=c)
            peak = estimate(s)
            if peak <= budget:
                key = (cost(s), peak, i)
                if best is None or key < best:
                    best, pick = key, s
            i += 1
    return pick


def measure_stack_peak(model_fn: Callable[[], nn.Module], stack: Stack, seq_len: int, *, steps: int = 2,
                       seed: int = 0, data: Any = None) -> int:
    """Tracked peak bytes of ``steps`` optimizer steps of ``model_fn()`` run with ``stack``, no budget
    (the measurement a prediction of the stack's peak is graded against; CPU): the highest
    per-step tracked peak.

    Args:
        model_fn: builds the model (after ``torch.manual_seed(seed)``).
        seed: the seed of the model, the data and the RNGs.
        data: as :class:`BudgetTrainer`'s ``data``.
    """
    torch.manual_seed(seed)
    model = model_fn()
    t = BudgetTrainer(model, None, stacks=[stack], data=data, effective_batch=stack.effective_batch,
                      seq_len=seq_len, seed=seed, ckpt_interval=10**9)
    t.train(steps)
    return t.peak_bytes
