"""One training step: its description (:class:`StepSpec`), the loss it runs, and the step itself
(zero_grad, forward + loss under the recipe's autocast, backward, optimizer.step())."""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from typing import TYPE_CHECKING

from memlab.core import vocab
from memlab.core.units import format_bytes
from memlab.core.vocab import Recipe
from memlab.core.validation import check_bool, invalid
from memlab.estimate.recipes import LOSS_ALIASES, MIXED, cublas_workspace

#: the FSDP implementations a ZeRO stage 3 step can be traced with: 1 (``FullyShardedDataParallel``, flat
#: parameters) and 2 (``fully_shard``, per-parameter DTensors; the default)
FSDP_VERSIONS = (1, 2)


def check_fsdp_version(name: str, value: Any) -> int:
    """``value`` if it is 1 or 2 (an int, not a bool nor a str), else the named ValueError (every route: the API,
    make_step, a StepSpec, the CLI)."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in FSDP_VERSIONS:
        raise invalid(name, value, "1 (FSDP1: FullyShardedDataParallel, flat parameters) or 2 (FSDP2: fully_shard); "
                                   "an int")
    return value

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from memlab.estimate.result import MemoryEstimate


@dataclass(frozen=True)
class StepSpec:
    """One training step's settings: what :func:`memlab.estimate.estimate_training_memory` traces and
    :func:`memlab.estimate.measure_training_memory` runs (their keywords are these fields).

    The trace, the extrapolation by depth, the ZeRO sharding and :func:`memlab.plan.estimate_stack`
    pass it along whole. Spellings are stored canonical (:mod:`memlab.core.vocab`): ``dtype="bf16"``
    is ``"bf16-mixed"``, ``optimizer="adam8bit"`` is ``"adamw8bit"``, ``adapter="lora"`` an
    :class:`~memlab.estimate.adapters.AdapterSpec` of the defaults; an unknown recipe, optimizer,
    adapter or card is refused here, named (ValueError).

    Attributes:
        batch_size, seq_len: the step's batch (of one rank) and tokens per sequence.
        dtype: the recipe, one of :data:`memlab.estimate.DTYPES`; it alone sets the weights' dtype.
        optimizer: one of :data:`memlab.estimate.OPTIMIZERS`; ``optimizer_impl``: "auto" (PyTorch's
            default on ``device``: foreach on CUDA), "for-loop", "foreach", "fused"; ``optimizer_kwargs``:
            its keywords (``{"offload_gradients": True}`` for offload-adamw).
        checkpointing: recompute each block in backward.
        offload_checkpoints: with ``checkpointing``, keep each checkpointed layer's input in host memory
            (:func:`memlab.checkpoint.offload_checkpoints`: memlab's checkpoint on every decoder layer, the
            inputs copied to the host in forward and fetched one layer ahead in backward).
        optimizer_in_backward: step each parameter's own optimizer in backward and free its gradient at once
            (:func:`memlab.offload.optimizer_in_backward`); no gradient accumulation, no ZeRO, not with
            offload-adamw (which frees gradients its own way).
        warmup_steps: untracked steps first (1: the steady state, optimizer state alive).
        device: the device you will train on (CUDA: its kernels, rules and allocator extras are modelled).
        seed: the seed of the random batch.
        loss, step: "auto" (also spelled "default": transformers' own loss for transformers models, else
            :func:`memlab.models.lm_loss`), "hf", "memlab", "chunked" (:func:`memlab.loss.chunked_cross_entropy`
            on the final hidden states and the head's weight) or "fused" (:func:`memlab.loss.enable`: the
            head and the loss fused, the logits never materialised); or your ``step(model, batch) -> loss``
            (a callable or ``"module:function"``), which overrides ``loss``.
        attn_implementation: "auto", "eager", "sdpa" or "flash" (CUDA).
        kernel_scratch: add the per-op rule for scratch CUDA kernels allocate inside (softmax backward).
        world_size, zero_stage: one of ``world_size`` data-parallel ranks under ZeRO stage 0-3 (stage 3
            traced with FSDP2 under a fake process group; chapter 08).
        adapter: None, "lora", "qlora" or an AdapterSpec: LoRA / QLoRA on a frozen base
            (:mod:`memlab.estimate.adapters`; the keywords ``lora_r``, ``lora_alpha``, ``target_modules``,
            ``lora_dropout``, ``adapter_dtype`` of :func:`memlab.estimate.make_step` set the rest).
        gpu: the target card (a name of :mod:`memlab.core.gpus`) or None: on a CUDA target its compute
            capability sets the cuBLAS workspace (:func:`memlab.estimate.recipes.cublas_workspace`).
        grad_accum: micro-batches of ``batch_size`` per optimizer step; the gradients of the first stay
            allocated through the next (two are traced: later ones repeat the second; three under FSDP1, whose
            micro-batches but the last run under ``no_sync()``).
        fsdp_version: with ``zero_stage=3``, the FSDP traced: 2 (``fully_shard``, the default) or 1
            (``FullyShardedDataParallel`` with its FULL_SHARD defaults: one flat parameter per decoder layer and
            one for the root, gradient accumulation under ``no_sync()``; :mod:`memlab.estimate.sharding`).
        keep_previous_outputs: the loop keeps what the previous forward returned (``out = model(...)`` kept
            for logging: transformers' output with its logits, else the loss) until the next forward has
            returned; traced as two consecutive steps, the first one's outputs alive through the second's forward.
        zero_grad_set_to_none: how the loop zeroes the gradients before each step: True (PyTorch's default since 2.0)
            frees them (``p.grad = None``), so each backward allocates them anew; False
            (``optimizer.zero_grad(set_to_none=False)``, ``model.zero_grad()`` before torch 2.0, the HF Trainer of
            that time) zeroes them in place: the gradient buffers stay allocated through the next forward and
            backward, which adds into them. Not with ``zero_stage=3`` (FSDP's sharded gradients are not traced
            kept) nor with ``optimizer_kwargs={'offload_gradients': True}`` (which frees each gradient in backward).
    """

    batch_size: int
    seq_len: int
    dtype: str = Recipe.BF16_MIXED.value
    optimizer: str = "adamw"
    checkpointing: bool = False
    warmup_steps: int = 1
    device: str = "cuda"
    optimizer_impl: str = "auto"
    optimizer_kwargs: Mapping[str, Any] | None = None
    seed: int = 0
    loss: str = "auto"
    step: Callable[[nn.Module, dict], torch.Tensor] | str | None = None
    attn_implementation: str | None = "auto"
    kernel_scratch: bool = True
    world_size: int = 1
    zero_stage: int = 0
    adapter: Any = None
    gpu: str | None = None
    grad_accum: int = 1
    offload_checkpoints: bool = False
    optimizer_in_backward: bool = False
    fsdp_version: int = 2
    keep_previous_outputs: bool = False
    zero_grad_set_to_none: bool = True

    def __post_init__(self) -> None:
        # one vocabulary (frozen: set through object)
        object.__setattr__(self, "dtype", vocab.canonical_recipe(self.dtype, argument="dtype"))
        object.__setattr__(self, "optimizer", vocab.canonical_optimizer(self.optimizer))
        if isinstance(self.loss, str) and self.loss in LOSS_ALIASES:
            object.__setattr__(self, "loss", LOSS_ALIASES[self.loss])
        from memlab.estimate.adapters import AdapterSpec, adapter_spec

        if not isinstance(self.adapter, AdapterSpec):
            object.__setattr__(self, "adapter", adapter_spec(self.adapter, recipe=self.dtype))
        if self.gpu is not None:
            cublas_workspace(self.gpu, env={})  # an unknown card is refused here, named
        check_bool("offload_checkpoints", self.offload_checkpoints)
        check_bool("optimizer_in_backward", self.optimizer_in_backward)
        check_bool("keep_previous_outputs", self.keep_previous_outputs)
        check_bool("zero_grad_set_to_none", self.zero_grad_set_to_none)
        check_fsdp_version("fsdp_version", self.fsdp_version)
        if self.fsdp_version == 1 and self.zero_stage != 3:
            raise ValueError(f"fsdp_version=1 is invalid with zero_stage={self.zero_stage!r}: FSDP shards the "
                             f"parameters (ZeRO stage 3); allowed: zero_stage=3 (CLI --zero-stage 3), or fsdp_version=2")
        if self.offload_checkpoints and not self.checkpointing:
            raise ValueError("offload_checkpoints=True is invalid with checkpointing=False: it keeps the inputs of "
                             "checkpointed layers on the host; allowed: checkpointing=True (CLI --checkpointing)")
        if self.optimizer_in_backward:
            self._check_in_backward()
        if not self.zero_grad_set_to_none:
            self._check_zero_grad_kept()

    def _check_zero_grad_kept(self) -> None:
        # what keeping the gradients between steps (zero_grad(set_to_none=False)) is not traced with, named
        if self.zero_stage == 3:
            raise ValueError("zero_grad_set_to_none=False is invalid with zero_stage=3: FSDP's sharded gradients are "
                             "not traced kept between steps; allowed: zero_grad_set_to_none=True, or zero_stage 0, 1, 2")
        if (self.optimizer_kwargs or {}).get("offload_gradients"):
            raise ValueError("zero_grad_set_to_none=False is invalid with optimizer_kwargs={'offload_gradients': True}: "
                             "each gradient is copied to the host and freed in backward, none is kept; allowed: "
                             "zero_grad_set_to_none=True, or offload_gradients off")

    def _check_in_backward(self) -> None:
        # what the optimizer step in backward rules out, named
        if self.grad_accum != 1:
            raise ValueError(f"optimizer_in_backward=True is invalid with grad_accum={self.grad_accum}: each parameter "
                             f"is stepped and its gradient freed in every backward, so gradients cannot accumulate; "
                             f"allowed: grad_accum=1 (a larger batch_size instead)")
        if self.optimizer == "offload-adamw":
            raise ValueError("optimizer_in_backward=True is invalid with optimizer='offload-adamw' (it frees each "
                             "gradient in backward its own way: optimizer_kwargs={'offload_gradients': True}); "
                             "allowed: adamw, sgd, adamw8bit")
        if self.world_size != 1 or self.zero_stage:
            raise ValueError(f"optimizer_in_backward=True is invalid with world_size={self.world_size}, "
                             f"zero_stage={self.zero_stage}: not modelled under ZeRO; allowed: world_size=1, zero_stage=0")

    def replace(self, **changes: Any) -> "StepSpec":
        """A copy with some fields changed (checked as a new one is)."""
        return dataclasses.replace(self, **changes)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str,
          step: Callable[[nn.Module, dict], torch.Tensor] | None) -> tuple[torch.Tensor, Any]:
    """(the loss, what the forward returned to the loop: transformers' output for "hf", "chunked", "fused",
    else the loss itself)."""
    import torch

    from memlab.models import lm_loss

    if step is not None:
        out = step(model, {"input_ids": x, "labels": x})
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise TypeError(f"step={getattr(step, '__name__', step)!r} returned {type(out).__name__}"
                            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}; allowed: a scalar loss tensor")
        return out, out
    if loss in ("hf", "chunked", "fused"):  # chunked, fused: the model's own loss replaced (enable_chunked_loss,
        outputs = model(input_ids=x, labels=x, use_cache=False)  # memlab.loss.enable)
        return outputs.loss, outputs
    out = lm_loss(model, x, y)
    return out, out


def enable_chunked_loss(model: nn.Module) -> nn.Module:
    """Make a transformers causal LM's training loss :func:`memlab.loss.chunked_cross_entropy` of its final
    hidden states and head weight: ``model(input_ids=x, labels=x).loss`` is transformers' loss (labels shifted by
    one inside), with the logits made a chunk of tokens at a time (autograd keeps each chunk's log-probabilities).
    It replaces ``forward`` on the instance, as :func:`memlab.loss.enable` does for the fused loss, so the step
    runs inside the model's own call (its hooks, the tracker's forward phase).

    Raises:
        ValueError: a model without a decoder (``get_decoder``) and output embeddings (``get_output_embeddings``).
    """
    from types import SimpleNamespace

    from memlab.loss import chunked_cross_entropy, shift_labels

    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if decoder is None or head is None:
        raise ValueError(f"loss='chunked' needs a transformers causal LM (get_decoder, get_output_embeddings); "
                         f"{type(model).__name__} is not one: use loss='memlab' or step=")

    def forward(input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
        loss = chunked_cross_entropy(hidden, head.weight, shift_labels(labels), bias=getattr(head, "bias", None))
        return SimpleNamespace(loss=loss, logits=None)

    model.forward = forward
    return model


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    dtype: str = Recipe.FP32.value,
    loss: str = "memlab",
    step: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    micro_batches: int = 1,
    no_sync: Callable[[], Any] | None = None,
    previous: list | None = None,
    set_to_none: bool = True,
) -> torch.Tensor:
    """One step as :func:`estimate_training_memory` runs it: ``optimizer.zero_grad(set_to_none)``, forward and
    loss (under autocast for the mixed recipes), backward, optimizer.step(). With
    ``micro_batches`` > 1, forward and backward run that many times on ``x`` (each loss divided by
    the count, as a trainer accumulating gradients does) before the one optimizer step: the
    gradients of the first micro-batch stay allocated through the next ones.

    Args:
        x: the token ids, ``batch x seq_len``.
        y: the targets (for ``loss="memlab"``).
        dtype: the recipe, any spelling.
        loss: ``"hf"``: transformers' own (``model(input_ids=x, labels=x).loss``, as the Trainer
            computes it: the logits upcast to fp32, shifted inside), also ``"fused"`` (the same call on a
            model :func:`memlab.loss.enable` fused); ``"memlab"``: :func:`memlab.models.lm_loss` of ``x``
            against ``y``; ``"chunked"``: the same call on a model :func:`enable_chunked_loss` changed.
        step: your ``step(model, {"input_ids": x, "labels": x}) -> loss``; overrides ``loss``.
        micro_batches: forward/backward passes before the optimizer step (gradient accumulation).
        no_sync: FSDP1's ``model.no_sync``: every micro-batch but the last runs under it (the gradients are
            reduced once, in the last backward), as PyTorch's FSDP documentation shows gradient accumulation.
        previous: the loop's variable that holds the outputs of the last forward (a list, changed in place):
            what it holds stays alive until the next forward has returned, then that forward's outputs replace
            it (``out = model(...)`` in a loop that keeps ``out`` for logging); None keeps nothing.
        set_to_none: ``zero_grad``'s argument: True frees the gradients, False zeroes them in place (they stay
            allocated through forward, and backward adds into them).

    Returns:
        The (last micro-batch's) loss, detached.

    Raises:
        ValueError: an unknown recipe; TypeError: a ``step`` that returns no scalar tensor.
    """
    import torch

    dtype = vocab.canonical_recipe(dtype, argument="dtype")
    import contextlib

    check_bool("set_to_none", set_to_none)
    optimizer.zero_grad(set_to_none=set_to_none)
    for i in range(micro_batches):
        if dtype in MIXED:
            amp = torch.bfloat16 if dtype == Recipe.BF16_MIXED else torch.float16
            with torch.autocast(device_type=x.device.type, dtype=amp):
                out, outputs = _loss(model, x, y, loss, step)
        else:
            out, outputs = _loss(model, x, y, loss, step)
        if previous is not None:  # the new outputs replace the previous ones only now, after the forward
            previous[:] = [outputs]
        del outputs
        with no_sync() if (no_sync is not None and i < micro_batches - 1) else contextlib.nullcontext():
            (out / micro_batches if micro_batches > 1 else out).backward()
        if micro_batches > 1:
            out = out.detach()  # what a trainer keeps of a finished micro-batch: its loss value
    optimizer.step()
    return out.detach()


def load_step(spec: str) -> Callable[[nn.Module, dict], torch.Tensor]:
    """The function ``(model, batch) -> loss`` that ``spec``, a ``"module:function"``, names (the current
    directory is importable).

    Raises:
        ValueError: a malformed spec, a module that does not import, a missing function.
    """
    import importlib

    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"step={spec!r} is invalid; allowed: 'module:function' (e.g. mystep:loss_fn), "
                         f"a function (model, batch) -> loss with batch = {{'input_ids': x, 'labels': x}}")
    mod_name, fn_name = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"step={spec!r}: cannot import module {mod_name!r} ({exc})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"step={spec!r}: module {mod_name!r} ({getattr(mod, '__file__', '?')}) has no function {fn_name!r}")
    return fn


#: the start of the note an estimate of a loop that keeps its gradients between steps carries
ZERO_GRAD_NOTE = "zero_grad_set_to_none=False"


def add_zero_grad_note(est: "MemoryEstimate", step: "StepSpec") -> "MemoryEstimate":
    """``est`` with the note of a loop that zeroes its gradients in place (``step.zero_grad_set_to_none`` False):
    the gradient bytes kept, read from the traced breakdowns. Nothing for the default loop; added once."""
    if step.zero_grad_set_to_none or any(n.startswith(ZERO_GRAD_NOTE) for n in est.notes):
        return est
    if step.optimizer_in_backward:
        kept = ("but the optimizer step in backward frees each gradient as soon as it is stepped, so none is kept: "
                "the same step as set_to_none=True")
    else:
        grads = max([bd.get("gradients", 0) for bd in est.phase_breakdowns.values()]
                    + [est.breakdown.get("gradients", 0)])
        kept = (f"the gradients ({format_bytes(grads)} at most) stay allocated, zeroed in place, through the next "
                f"forward and backward; backward adds each new gradient into its buffer (a temporary until added), "
                f"frozen parameters have none")
    est.notes.append(f"{ZERO_GRAD_NOTE} (optimizer.zero_grad(set_to_none=False); model.zero_grad() before torch "
                     f"2.0, the HF Trainer of that time): {kept}")
    return est
