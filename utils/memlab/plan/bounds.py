"""Bounds that decide a stack without tracing it (the planner's pruning).

**Lower bound** (:func:`state_bytes`). One optimizer step holds, at the moment ``optimizer.step()`` has made
its state, the weights, the gradients and the optimizer state on the device at once; so whatever else the
step keeps (activations, temporaries, the allocator's rounding), its traced peak -- and the reserved
estimate, which is at least the tensor peak -- is at least their sum. Those bytes follow from the
stack's dtypes alone, counted per parameter tensor on the meta device (:func:`param_counts`):

* weights: every parameter in :func:`memlab.plan.stacks.weight_dtype` (fp32 under fp32 and the mixed
  recipes, bf16 under "bf16-pure", the frozen base's 16-bit dtype under LoRA/QLoRA); QLoRA's quantized
  weights (every ``nn.Linear`` but the head) at 4 bits (NF4 codes: Dettmers et al. 2023; their scales are
  left out, so the bound stays below); the adapters in their own dtype;
* gradients: one per trainable parameter, in its dtype; none with ``offload-adamw`` (each is copied to
  the host and freed in backward) or the optimizer step in backward (each is freed once stepped);
* optimizer state: AdamW's two moments in the parameter's dtype (PyTorch's ``zeros_like``); 8-bit AdamW's
  layout (bitsandbytes: two fp32 moments below 4,096 elements, else two uint8 moments and an fp32 absmax
  per block of 256 for each); none on the device for ``offload-adamw``.

A stack whose lower bound exceeds the budget does not fit, untraced; nor does an offloaded one whose host
buffers alone (:func:`host_lower_bound`: 16 B per trainable parameter) exceed the host budget. Nothing here is a formula for the
peak: the bound is only used to rule out, and :mod:`tests.ch07.test_plan_bounds` checks it is at or below
the traced peak of every kind of stack.

**Upper bound** (:func:`fits_by_neighbour`). :func:`needs_at_least` orders two stacks
of one family (adapter, precision, attention, loss, step in backward): ``c`` needs at least ``d``'s memory
when its micro-batch is at least d's, it accumulates if d does, it checkpoints a subset of d's layers
and its optimizer keeps at least what d's keeps (foreach AdamW >= fused AdamW, every optimizer >=
offload-adamw). So if a traced ``c`` fits, every such ``d`` fits too, untraced; its host memory is c's only when both
offload (or neither does), so an offloading ``d`` is decided only by an offloading ``c``. The same tests
check the order against full traces for every pair the planner can use on a small model.

**Accumulation** (:func:`needs_at_least_less_kept`, :func:`accumulation_lower_bound`). The order above leaves out a
stack ``c`` that does not accumulate (one micro-batch per step) against a ``d`` that does, however small d's
micro-batch: d keeps its first micro-batch's gradients through the next forward and backward. That is all it
keeps: its step is c's step (the same model, optimizer and checkpointing; c's micro-batch at least d's) run
twice, the first pass's gradients and loss value still alive through the second (the estimator traces two
micro-batches: :func:`memlab.estimate.step.training_step`; later ones repeat the second), then the same
optimizer step. So c's traced tensor peak is at least d's traced tensor peak less the gradients d keeps
(:func:`kept_gradient_bytes`: every trainable parameter's gradient, counted whatever the optimizer does with it)
and less :data:`ACCUMULATION_SLACK` (the kept loss value and its scaled copy, scalars); c's reserved estimate is
at least its tensor peak. With LoRA/QLoRA the kept gradients are the adapters' (160 MiB for an 8B model at
r=16), so one traced accumulating stack that exceeds the budget rules out the same line's one-micro-batch stack
(``mb 16x1``), whose trace costs as much as the others'. :mod:`tests.ch07.test_plan_bounds` checks the bound
against the traced peaks of every pair it relates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.plan.stack import OPTIMIZER_GE, Stack


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameter tensors by role, counted on the meta device at full depth (elements per tensor).

    ``full``: every parameter of the model (a full fine-tune trains them all; LoRA/QLoRA freeze them);
    ``quantized``: the elements QLoRA stores in NF4 (the weights of every ``nn.Linear`` but the head);
    ``adapters``: the LoRA adapter tensors (QLoRA's are the same) at the plan's rank."""

    full: tuple[int, ...]
    quantized: int
    adapters: tuple[int, ...]


def param_counts(cfg: Any, lora_r: int) -> ParamCounts:
    """:class:`ParamCounts` of ``cfg`` with adapters of rank ``lora_r``, from the planner's own builder
    (:func:`memlab.plan.stacks.model_builder`) on the meta device: no memory, no trace."""
    import copy

    import torch
    from torch import nn

    from memlab.plan.stacks import model_builder

    cfg = copy.deepcopy(cfg)  # building from a config sets fields on it (the attention kernel, the dtype)
    with torch.device("meta"):
        full = model_builder(cfg, Stack(precision="bf16-mixed"), lora_r)()
        lora = model_builder(cfg, Stack(precision="bf16-mixed", adapter="lora"), lora_r)()
    quantized = sum(m.weight.numel() for n, m in full.named_modules()
                    if isinstance(m, nn.Linear) and m.weight is not full.get_output_embeddings().weight)
    return ParamCounts(full=tuple(p.numel() for p in full.parameters()), quantized=quantized,
                       adapters=tuple(p.numel() for p in lora.parameters() if p.requires_grad))


def _size(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype, device="meta").element_size()


def _adam8bit_state(numels: tuple[int, ...]) -> int:
    from memlab.estimate.recipes import BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE

    return sum(8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n + 8 * -(-n // BNB_BLOCKSIZE) for n in numels)


def state_bytes(stack: Stack, counts: ParamCounts, lora_r: int = 16) -> dict[str, int]:
    """The device bytes of ``stack``'s weights, gradients and optimizer state, by kind: a lower bound of its
    traced peak (see the module docstring). ``lora_r`` sets the adapters' dtype rule only (their sizes are
    ``counts``')."""
    from memlab.plan.stacks import adapter_dtype, weight_dtype

    wsize = _size(weight_dtype(stack))
    if stack.adapter == "full":
        trainable, tsize = counts.full, wsize
        weights = sum(counts.full) * wsize
    else:
        trainable, tsize = counts.adapters, _size(adapter_dtype(stack, lora_r))
        base = sum(counts.full) * wsize
        if stack.adapter == "qlora":  # NF4: two 4-bit codes a byte (scales left out: a lower bound)
            base -= counts.quantized * wsize - counts.quantized // 2
        weights = base + sum(trainable) * tsize
    n = sum(trainable)
    grads = 0 if (stack.optimizer == "offload-adamw" or stack.optimizer_in_backward) else n * tsize
    if stack.optimizer == "offload-adamw":
        state = 0
    elif stack.optimizer == "adamw8bit":
        state = _adam8bit_state(trainable)
    else:
        state = 2 * n * tsize
    return {"weights": weights, "gradients": grads, "optimizer state": state}


def lower_bound(stack: Stack, counts: ParamCounts, lora_r: int = 16) -> int:
    """The sum of :func:`state_bytes`: at most ``stack``'s traced peak."""
    return sum(state_bytes(stack, counts, lora_r).values())


def host_lower_bound(stack: Stack, counts: ParamCounts) -> int:
    """Host bytes an offloaded optimizer allocates at least: an fp32 master weight, an fp32 gradient slot and two
    fp32 moments per trainable parameter (16 B: :class:`memlab.offload.OffloadedAdamW`, chapter 04; the pinned
    staging buffers are left out); 0 for an optimizer on the device."""
    if stack.optimizer != "offload-adamw":
        return 0
    return 16 * sum(counts.full if stack.adapter == "full" else counts.adapters)


def _opt_ge(a: str, b: str) -> bool:
    return a == b or (a, b) in OPTIMIZER_GE


def ckpt_set(s: Stack, n_layers: int) -> frozenset:
    """The indices of the decoder layers ``s`` checkpoints, of ``n_layers``."""
    if s.checkpointing == "full":
        return frozenset(range(n_layers))
    if s.checkpointing == "every-k":
        return frozenset(range(0, n_layers, s.ckpt_every))
    return frozenset()


def family(s: Stack) -> tuple:
    """The knobs two stacks must share to be ordered by memory: adapter, precision, attention, loss, step in backward."""
    # the loss and the optimizer step in backward hold no memory order against their alternatives (the fused
    # loss keeps an fp32 head gradient and chunk tiles; a step in backward its temporaries while activations live)
    return (s.adapter, s.precision, s.attention, s.loss, s.optimizer_in_backward)


def needs_at_least(c: Stack, d: Stack, n_layers: int) -> bool:
    """True when ``c`` holds at least ``d``'s device memory by construction: the same family, a
    micro-batch at least as large, accumulation if d accumulates (its gradients stay through the
    next micro-batch), a subset of d's checkpointed layers, an optimizer that keeps at least as much."""
    return (family(c) == family(d) and c.micro_batch >= d.micro_batch
            and (c.grad_accum > 1 or d.grad_accum == 1)
            and ckpt_set(c, n_layers) <= ckpt_set(d, n_layers)
            and _opt_ge(c.optimizer, d.optimizer))


#: bytes left for what an accumulating step keeps besides its gradients: the first micro-batch's loss value (a
#: detached scalar) and the scaled loss its backward starts from (a scalar), 4 B each, 512 B each as the caching
#: allocator rounds them; 4 KiB covers both with room
ACCUMULATION_SLACK = 4096


def kept_gradient_bytes(stack: Stack, counts: ParamCounts, lora_r: int = 16) -> int:
    """The gradient bytes an accumulating ``stack`` can keep between its micro-batches: one gradient per trainable
    parameter in its dtype (the full model's under a full fine-tune, the adapters' under LoRA/QLoRA), counted
    whatever the optimizer does with them (more than an offloaded optimizer keeps on the device: the bound that
    subtracts them stays below); 0 for a stack that does not accumulate."""
    from memlab.plan.stacks import adapter_dtype, weight_dtype

    if stack.grad_accum <= 1:
        return 0
    if stack.adapter == "full":
        return sum(counts.full) * _size(weight_dtype(stack))
    return sum(counts.adapters) * _size(adapter_dtype(stack, lora_r))


def needs_at_least_less_kept(c: Stack, d: Stack, n_layers: int) -> bool:
    """True when ``c`` holds at least ``d``'s device memory less what d keeps between micro-batches
    (:func:`accumulation_lower_bound`): the order of :func:`needs_at_least` but for accumulation, ``c`` one
    micro-batch per step and ``d`` accumulating."""
    return (c.grad_accum == 1 and d.grad_accum > 1 and family(c) == family(d) and c.micro_batch >= d.micro_batch
            and ckpt_set(c, n_layers) <= ckpt_set(d, n_layers) and _opt_ge(c.optimizer, d.optimizer))


def accumulation_lower_bound(d: Stack, d_tensor_peak: int, counts: ParamCounts, lora_r: int = 16) -> int:
    """A lower bound of the traced tensor peak (so of the reserved estimate too) of every stack ``c`` with
    :func:`needs_at_least_less_kept` (c, d): d's traced tensor peak less the gradients it keeps
    (:func:`kept_gradient_bytes`) and :data:`ACCUMULATION_SLACK`."""
    return d_tensor_peak - kept_gradient_bytes(d, counts, lora_r) - ACCUMULATION_SLACK


def fits_by_neighbour(d: Stack, c: Stack, n_layers: int) -> bool:
    """True when ``d`` fits whenever the traced ``c`` fits, device and host: ``c`` needs at least ``d``'s device memory
    (:func:`needs_at_least`) and both keep their optimizer on the host or neither does (an
    offloaded optimizer's host memory is the same for every stack of one family)."""
    return needs_at_least(c, d, n_layers) and ((c.optimizer == "offload-adamw") == (d.optimizer == "offload-adamw"))
