"""Pick the training stack that fits a model into a memory budget (chapter 07).

A training run has knobs that trade memory for time: the precision, activation checkpointing
(none, every k-th block, every block), the optimizer (AdamW, fused AdamW, 8-bit AdamW, AdamW
offloaded to the CPU), LoRA or QLoRA adapters, the attention kernel, and the micro-batch (with
gradient accumulation keeping the effective batch); and, where ``allow`` names them, chapter 09's fused
(or chunked) loss and optimizer step in backward. :class:`Stack` is one choice of all of them.

:func:`plan` enumerates the stacks, estimates each one's peak by *tracing* its training step on
fake tensors with :mod:`memlab.estimate` (the same resolver, step description and extrapolation),
and ranks those that fit by a stated cost model (:func:`stack_cost`; vendor peak rates in
:data:`GPU_SPECS`). The cost model orders stacks; its seconds are not a measurement. Most candidates
are decided without a trace (:mod:`memlab.plan.bounds`): by a lower bound (weights, gradients and
optimizer state alone exceed the budget; or, one micro-batch per step, an accumulating stack's traced peak less the
gradients it keeps) or by the memory order against a traced neighbour; the pick
is always traced, and ``plan(prune=False)`` traces every candidate (the same answer, tested).

One concern per module: :mod:`~memlab.plan.stack` (the knobs and their vocabulary),
:mod:`~memlab.plan.cost` (the cost model), :mod:`~memlab.plan.stacks` (estimating one stack, cached),
:mod:`~memlab.plan.bounds` (the lower bound and the memory order), :mod:`~memlab.plan.search` (the
candidates and the search), :mod:`~memlab.plan.budget` (budgets), :mod:`~memlab.plan.result`,
:mod:`~memlab.plan.memo` (a whole plan remembered on disk), :mod:`~memlab.plan.ahead` (a second process
tracing ahead the stack the search likely asks for next), :mod:`~memlab.plan.planner` (:func:`plan`);
the command line is :mod:`memlab.cli.plan`.

    memlab plan llama-3-8b --gpu rtx4090 --seq-len 2048 --batch-size 16
"""
from __future__ import annotations

from memlab.plan.stack import DEFAULT_ALLOW, Stack, fidelity_tier, stack_label
from memlab.plan.cost import GPU_SPECS, CostModel, model_shape, stack_cost
from memlab.plan.stacks import estimate_stack, trace_cache_dir
from memlab.plan.search import enumerate_stacks
from memlab.plan.result import PlanResult, PlanRow, format_count
from memlab.plan.bounds import lower_bound, param_counts
from memlab.plan.budget import DEFAULT_HOST_BUDGET, host_available_bytes, resolve_budget
from memlab.plan.planner import plan

__all__ = ["plan", "Stack", "PlanResult", "PlanRow", "CostModel", "GPU_SPECS", "DEFAULT_ALLOW", "estimate_stack",
           "enumerate_stacks", "stack_cost", "fidelity_tier", "stack_label", "model_shape", "resolve_budget",
           "host_available_bytes", "DEFAULT_HOST_BUDGET", "trace_cache_dir", "lower_bound", "param_counts", "format_count"]
