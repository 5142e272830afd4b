"""The estimator's entry points: :func:`estimate_training_memory` (a fake trace, per rank under ZeRO / FSDP)
and :func:`measure_training_memory` (the same step run for real), both through one :class:`StepSpec`."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from memlab.estimate.extrapolate import estimate_one_rank
from memlab.estimate.model import ModelSpec, check_positions, resolve_model
from memlab.estimate.recipes import canonical_dtype, canonical_optimizer, check_input_bounds, cublas_workspace
from memlab.estimate.result import MemoryEstimate
from memlab.estimate.sharding import _check_zero, _fsdp_units, shard_estimate, trace_fsdp
from memlab.estimate.step import StepSpec
from memlab.estimate.trace import trace_step

_ADAPTER_KEYS = ("lora_r", "lora_alpha", "target_modules", "lora_dropout", "adapter_dtype")


def make_step(*, adapter: Any = None, lora_r: int = 16, lora_alpha: float | None = None,
              target_modules: str | Sequence[str] | None = None, lora_dropout: float = 0.0,
              adapter_dtype: str | None = None, **settings: Any) -> StepSpec:
    """A :class:`StepSpec` from :func:`estimate_training_memory`'s keywords (spellings made canonical).

    Args:
        adapter, lora_r, lora_alpha, target_modules, lora_dropout, adapter_dtype: the adapter settings
            (:func:`memlab.estimate.adapters.adapter_spec`); ``adapter`` may be an ``AdapterSpec`` already.
        **settings: the other fields of :class:`StepSpec` (``dtype`` and ``optimizer`` in any spelling).

    Returns:
        The StepSpec.

    Raises:
        ValueError: an unknown recipe or a bad adapter setting.
    """
    from memlab.estimate import adapters

    if "dtype" in settings:
        settings["dtype"] = canonical_dtype(settings["dtype"])
    if "optimizer" in settings:
        settings["optimizer"] = canonical_optimizer(settings["optimizer"])
    ad = adapters.adapter_spec(adapter, recipe=settings.get("dtype", StepSpec.dtype), lora_r=lora_r,
                               lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=lora_dropout,
                               adapter_dtype=adapter_dtype)
    if settings.get("gpu") is not None:
        cublas_workspace(settings["gpu"], env={})  # an unknown card is refused here, named
    return StepSpec(adapter=ad, **settings)


def resolve_for_step(model: Any, step: StepSpec, config_overrides: Mapping[str, Any] | None = None,
                     allow_longer_seq: bool = False) -> ModelSpec:
    """The model a step runs on: resolved, its positions checked, its adapters attached.

    Args:
        model: as for :func:`estimate_training_memory`.
        step: the step (its ``seq_len`` and ``adapter``).
        config_overrides: config fields to change.
        allow_longer_seq: allow ``seq_len`` beyond the model's positions (RoPE scaling).

    Returns:
        The :class:`ModelSpec`.
    """
    spec = resolve_model(model, config_overrides)
    check_positions(spec, step.seq_len, allow_longer_seq)
    if step.adapter is not None:
        from memlab.estimate import adapters

        spec = spec.with_adapter(step.adapter)
        if step.adapter.kind == "qlora":
            adapters.warm_quant()
    return spec


def estimate_step(model: Any, step: StepSpec, *, config_overrides: Mapping[str, Any] | None = None,
                  allow_longer_seq: bool = False, extrapolate: bool | str = "auto") -> MemoryEstimate:
    """:func:`estimate_training_memory` for a :class:`StepSpec` (the planner's route).

    Args:
        model: as for :func:`estimate_training_memory`.
        step: the step, canonical (:func:`make_step`).
        config_overrides, allow_longer_seq, extrapolate: as for :func:`estimate_training_memory`.

    Returns:
        The estimate, per rank under ZeRO.

    Raises:
        ValueError, TypeError, FileNotFoundError: bad settings, named.
    """
    check_input_bounds(step.batch_size, step.seq_len, step.world_size)
    _check_zero(step.world_size, step.zero_stage, step.optimizer)
    if extrapolate not in (True, False, "auto"):
        raise ValueError(f"extrapolate={extrapolate!r} is invalid; allowed: 'auto', True, False")
    spec = resolve_for_step(model, step, config_overrides, allow_longer_seq)
    why = ""
    if step.zero_stage == 3:
        traced, why = trace_fsdp(spec, step, extrapolate)
        if traced is not None:
            return traced
    est = estimate_one_rank(spec, step, extrapolate)
    if step.world_size == 1 and step.zero_stage == 0:
        return est
    units = _fsdp_units(resolve_model(model, config_overrides), step.dtype) if step.zero_stage == 3 else None
    out = shard_estimate(est, step.world_size, step.zero_stage, units=units)
    if why:
        out.notes.append(f"FSDP2 not traced ({why}): its unsharded units are modelled")
    return out


def estimate_training_memory(
    model: Any, *, batch_size: int, seq_len: int, dtype: str = "bf16-mixed", optimizer: str = "adamw",
    checkpointing: bool = False, warmup_steps: int = 1, device: str = "cuda", optimizer_impl: str = "auto",
    optimizer_kwargs: Mapping[str, Any] | None = None, config_overrides: Mapping[str, Any] | None = None,
    seed: int = 0, loss: str = "auto", step: Callable[[nn.Module, dict], torch.Tensor] | str | None = None,
    attn_implementation: str = "auto", allow_longer_seq: bool = False, extrapolate: bool | str = "auto",
    kernel_scratch: bool = True, world_size: int = 1, zero_stage: int = 0, adapter: str | None = None,
    lora_r: int = 16, lora_alpha: float | None = None, target_modules: str | Sequence[str] | None = None,
    lora_dropout: float = 0.0, adapter_dtype: str | None = None, gpu: str | None = None, grad_accum: int = 1,
) -> MemoryEstimate:
    """Peak memory of a (steady-state) training step of ``model``, traced on fake tensors (nothing allocated).

    Args:
        model: a preset of :data:`memlab.models.PRESETS`, a config.json path, a Hub id (config.json only),
            a transformers config, or a callable returning an ``nn.Module`` (built inside the fake mode).
        batch_size, seq_len: the step's batch (of one rank) and tokens per sequence.
        dtype: the recipe, one of :data:`DTYPES` (``"bf16"`` = ``"bf16-mixed"``); it alone sets the weights' dtype.
        optimizer: one of :data:`OPTIMIZERS` (``"adam8bit"`` = ``"adamw8bit"``); ``optimizer_impl``: "auto"
            (PyTorch's default on ``device``: foreach on CUDA), "for-loop", "foreach", "fused";
            ``optimizer_kwargs``: its keywords (``{"offload_gradients": True}`` for offload-adamw).
        checkpointing: recompute each block in backward.
        warmup_steps: untracked steps first (1: the steady state, optimizer state alive).
        device: the device you will train on (CUDA: its kernels, rules and allocator extras are modelled).
        config_overrides: config fields to change (unknown keys are errors).
        seed: the seed of the random batch.
        loss, step: "auto" (transformers' own loss for transformers models, else
            :func:`memlab.models.lm_loss`), "hf", "memlab"; or your ``step(model, batch) -> loss``
            (a callable or ``"module:function"``).
        attn_implementation: "auto", "eager", "sdpa" or "flash" (CUDA).
        allow_longer_seq: allow ``seq_len`` beyond the model's positions (RoPE scaling).
        extrapolate: "auto" traces a homogeneous stack of 4+ layers at two depths and extrapolates exactly
            by layer count; False traces every layer.
        kernel_scratch: add the per-op rule for scratch CUDA kernels allocate inside (softmax backward).
        world_size, zero_stage: one of ``world_size`` data-parallel ranks under ZeRO stage 0-3 (stage 3
            traced with FSDP2 under a fake process group; chapter 08).
        adapter, lora_r, lora_alpha, target_modules, lora_dropout, adapter_dtype: LoRA / QLoRA on a frozen
            base (:mod:`memlab.estimate.adapters`, the planner's builder too).
        gpu: the target card (a name of :mod:`memlab.core.gpus`) or None: on a CUDA target its compute
            capability sets the cuBLAS workspace (:func:`memlab.estimate.recipes.cublas_workspace`).
        grad_accum: micro-batches of ``batch_size`` per optimizer step; the gradients of the first stay
            allocated through the next (two are traced: later ones repeat the second).

    Returns:
        The :class:`MemoryEstimate`.

    Raises:
        ValueError, TypeError, FileNotFoundError: a bad setting, named with what is allowed.
    """
    check_input_bounds(batch_size, seq_len, world_size)
    s = make_step(batch_size=batch_size, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                  checkpointing=checkpointing, warmup_steps=warmup_steps, device=device, optimizer_impl=optimizer_impl,
                  optimizer_kwargs=optimizer_kwargs, seed=seed, loss=loss, step=step,
                  attn_implementation=attn_implementation, kernel_scratch=kernel_scratch, world_size=world_size,
                  zero_stage=zero_stage, adapter=adapter, lora_r=lora_r, lora_alpha=lora_alpha,
                  target_modules=target_modules, lora_dropout=lora_dropout, adapter_dtype=adapter_dtype, gpu=gpu,
                  grad_accum=grad_accum)
    return estimate_step(model, s, config_overrides=config_overrides, allow_longer_seq=allow_longer_seq,
                         extrapolate=extrapolate)


def measure_training_memory(
    model: Any, *, batch_size: int, seq_len: int, dtype: str = "bf16-mixed", optimizer: str = "adamw",
    checkpointing: bool = False, warmup_steps: int = 1, device: str = "cpu", optimizer_impl: str = "auto",
    optimizer_kwargs: Mapping[str, Any] | None = None, config_overrides: Mapping[str, Any] | None = None,
    seed: int = 0, loss: str = "auto", step: Callable[[nn.Module, dict], torch.Tensor] | str | None = None,
    attn_implementation: str = "auto", allow_longer_seq: bool = False, adapter: str | None = None,
    lora_r: int = 16, lora_alpha: float | None = None, target_modules: str | Sequence[str] | None = None,
    lora_dropout: float = 0.0, adapter_dtype: str | None = None, grad_accum: int = 1,
) -> MemoryEstimate:
    """The same step as :func:`estimate_training_memory`, run for real on ``device`` and tracked with
    :class:`memlab.profiler.MemoryTracker` (for models that fit).

    A measurement has no modelled rules: kernel scratch that no op returns is not in it (compare it
    with ``estimate_training_memory(..., kernel_scratch=False)``).

    Args:
        model, batch_size, seq_len, dtype, optimizer, checkpointing, warmup_steps, device, optimizer_impl,
        optimizer_kwargs, config_overrides, seed, loss, step, attn_implementation, allow_longer_seq, adapter,
        lora_r, lora_alpha, target_modules, lora_dropout, adapter_dtype, grad_accum: as for
        :func:`estimate_training_memory`.

    Returns:
        The measured :class:`MemoryEstimate` (``fake=False``).
    """
    s = make_step(batch_size=batch_size, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                  checkpointing=checkpointing, warmup_steps=warmup_steps, device=device, optimizer_impl=optimizer_impl,
                  optimizer_kwargs=optimizer_kwargs, seed=seed, loss=loss, step=step,
                  attn_implementation=attn_implementation, kernel_scratch=False, adapter=adapter, lora_r=lora_r,
                  lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=lora_dropout,
                  adapter_dtype=adapter_dtype, grad_accum=grad_accum)
    return trace_step(resolve_for_step(model, s, config_overrides, allow_longer_seq), s, fake=False)
