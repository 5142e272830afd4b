"""The estimator's entry points: :func:`estimate_training_memory` (a fake trace, per rank under ZeRO / FSDP)
and :func:`measure_training_memory` (the same step run for real).

Both take the step as a :class:`StepSpec`; their keywords are the convenience form of the same thing,
made into a StepSpec in one place, :func:`make_step`::

    estimate_training_memory("llama-3-8b", StepSpec(batch_size=4, seq_len=2048, checkpointing=True))
    estimate_training_memory("llama-3-8b", batch_size=4, seq_len=2048, checkpointing=True)  # the same
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from memlab.estimate.adapters import adapter_spec, warm_quant
from memlab.estimate.extrapolate import estimate_one_rank
from memlab.estimate.model import ModelSpec, check_positions, resolve_model
from memlab.estimate.recipes import check_input_bounds
from memlab.estimate.result import MemoryEstimate
from memlab.estimate.sharding import check_zero, fsdp_units, shard_estimate, trace_fsdp
from memlab.estimate.step import StepSpec
from memlab.estimate.trace import trace_step

#: the keywords that build a step's LoRA / QLoRA adapters with ``adapter`` (not fields of StepSpec)
ADAPTER_KEYWORDS = ("lora_r", "lora_alpha", "target_modules", "lora_dropout", "adapter_dtype")
STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepSpec))
# what a measurement does not take: it runs one process, with no modelled rule and no modelled card
_NOT_MEASURED = ("kernel_scratch", "world_size", "zero_stage", "gpu")


def make_step(spec: StepSpec | None = None, **overrides: Any) -> StepSpec:
    """``spec`` with ``overrides``, or a new :class:`StepSpec` of them: the one place keywords become a step.

    Args:
        spec: the step to change; None builds one (``batch_size`` and ``seq_len`` are then needed).
        **overrides: fields of :class:`StepSpec`, any spelling, and the adapter's ``lora_r``, ``lora_alpha``,
            ``target_modules``, ``lora_dropout``, ``adapter_dtype`` (:func:`memlab.estimate.adapters.adapter_spec`).

    Raises:
        TypeError: a keyword that is no setting of a step, or no ``batch_size`` / ``seq_len`` without ``spec``.
        ValueError: an unknown recipe, optimizer or card, a bad adapter setting (named, with what is allowed).
    """
    for key in overrides:
        if key not in STEP_FIELDS and key not in ADAPTER_KEYWORDS:
            raise TypeError(f"unexpected keyword argument {key!r}; allowed: the fields of StepSpec "
                            f"({', '.join(STEP_FIELDS)}) and {', '.join(ADAPTER_KEYWORDS)}")
    lora = {k: overrides.pop(k) for k in ADAPTER_KEYWORDS if k in overrides}
    adapter = overrides.pop("adapter", None if spec is None else spec.adapter)
    if spec is None:
        missing = [k for k in ("batch_size", "seq_len") if k not in overrides]
        if missing:
            raise TypeError(f"missing {' and '.join(missing)}: a step needs batch_size and seq_len "
                            f"(or a StepSpec)")
        step = StepSpec(**overrides)
    else:
        step = spec.replace(**overrides)
    # the adapter last: its default dtype follows the (canonical) recipe
    return step.replace(adapter=adapter_spec(adapter, recipe=step.dtype, **lora))


def resolve_for_step(model: Any, step: StepSpec, config_overrides: Mapping[str, Any] | None = None,
                     allow_longer_seq: bool = False) -> ModelSpec:
    """The model a step runs on: resolved, its positions checked against ``step.seq_len``, its adapters attached."""
    spec = resolve_model(model, config_overrides)
    check_positions(spec, step.seq_len, allow_longer_seq)
    if step.adapter is not None:
        spec = spec.with_adapter(step.adapter)
        if step.adapter.kind == "qlora":
            warm_quant()
    return spec


def estimate_step(model: Any, step: StepSpec, *, config_overrides: Mapping[str, Any] | None = None,
                  allow_longer_seq: bool = False, extrapolate: bool | str = "auto") -> MemoryEstimate:
    """:func:`estimate_training_memory` of a :class:`StepSpec` (the planner's route): per rank under ZeRO.

    Raises:
        ValueError, TypeError, FileNotFoundError: bad settings, named.
    """
    check_input_bounds(step.batch_size, step.seq_len, step.world_size)
    check_zero(step.world_size, step.zero_stage, step.optimizer)
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
    units = fsdp_units(model, step.dtype, config_overrides) if step.zero_stage == 3 else None
    out = shard_estimate(est, step.world_size, step.zero_stage, units=units)
    if why:
        out.notes.append(f"FSDP2 not traced ({why}): its unsharded units are modelled")
    return out


def estimate_training_memory(model: Any, spec: StepSpec | None = None, *,
                             config_overrides: Mapping[str, Any] | None = None, allow_longer_seq: bool = False,
                             extrapolate: bool | str = "auto", **overrides: Any) -> MemoryEstimate:
    """Peak memory of a (steady-state) training step of ``model``, traced on fake tensors (nothing allocated).

    The step is ``spec``, changed by ``overrides``, or built from them alone: the fields of
    :class:`StepSpec` (``batch_size``, ``seq_len``, ``dtype``, ``optimizer``, ``checkpointing``, ``device``,
    ``world_size``, ``zero_stage``, ``adapter``, ``gpu``, ``grad_accum``, ... each described there) and the
    adapter's ``lora_r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``, ``adapter_dtype``
    (:func:`make_step`). Under ZeRO (``world_size``, ``zero_stage``) the estimate is one rank's.

    Args:
        model: a preset of :data:`memlab.models.PRESETS`, a config.json path, a Hub id (config.json only),
            a transformers config, or a callable returning an ``nn.Module`` (built inside the fake mode).
        spec: the step; None: built from ``overrides``.
        config_overrides: config fields to change (unknown keys are errors).
        allow_longer_seq: allow ``seq_len`` beyond the model's positions (RoPE scaling).
        extrapolate: "auto" and True trace a homogeneous stack of 4+ layers (5+ with adapters) at three depths
            and extrapolate exactly by layer count (:mod:`memlab.estimate.extrapolate`); False traces every layer.

    Raises:
        ValueError, TypeError, FileNotFoundError: a bad setting, named with what is allowed.
    """
    return estimate_step(model, make_step(spec, **overrides), config_overrides=config_overrides,
                         allow_longer_seq=allow_longer_seq, extrapolate=extrapolate)


def measure_training_memory(model: Any, spec: StepSpec | None = None, *,
                            config_overrides: Mapping[str, Any] | None = None, allow_longer_seq: bool = False,
                            **overrides: Any) -> MemoryEstimate:
    """The same step as :func:`estimate_training_memory`, run for real on ``device`` (here "cpu" unless
    given) and tracked with :class:`memlab.profiler.MemoryTracker` (for models that fit): ``fake=False``.

    A measurement runs one process and has no modelled rules: ``world_size``, ``zero_stage``, ``gpu`` and
    ``kernel_scratch`` are not taken, and kernel scratch that no op returns is not in it (compare it with
    ``estimate_training_memory(..., kernel_scratch=False)``).

    Raises:
        ValueError, TypeError, FileNotFoundError: a bad setting, named with what is allowed.
    """
    for key in _NOT_MEASURED:
        if key in overrides:
            raise TypeError(f"unexpected keyword argument {key!r}: a measurement runs one process with no modelled "
                            f"rules or card; allowed: estimate_training_memory(..., {key}=...)")
    if spec is None:
        overrides.setdefault("device", "cpu")
    step = make_step(spec, **overrides)
    if step.world_size != 1 or step.zero_stage:
        raise ValueError(f"world_size={step.world_size}, zero_stage={step.zero_stage} cannot be measured in one "
                         f"process; allowed: world_size=1, zero_stage=0 (estimate_training_memory models the ranks)")
    step = step.replace(kernel_scratch=False)
    return trace_step(resolve_for_step(model, step, config_overrides, allow_longer_seq), step, fake=False)
