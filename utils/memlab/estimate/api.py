"""The estimator's entry points: :func:`estimate_training_memory` (a fake trace, per rank under ZeRO / FSDP)
and :func:`measure_training_memory` (the same step run for real).

Both take the step as a :class:`StepSpec`; their keywords are the convenience form of the same thing,
made into a StepSpec in one place, :func:`make_step`::

    estimate_training_memory("llama-3-8b", StepSpec(batch_size=4, seq_len=2048, checkpointing=True))
    estimate_training_memory("llama-3-8b", batch_size=4, seq_len=2048, checkpointing=True)  # the same

Every argument meets one schema before any work (:data:`STEP_SCHEMA`, :data:`ENTRY_SCHEMA`, and
:func:`check_config_overrides` for a model's config fields, whatever the model's source): types, finiteness,
ranges and choices, each refused in the one format of :mod:`memlab.core.validation`
(``name=value is invalid; allowed: ...``). Heavy modules (torch, transformers) are imported inside the functions.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Mapping

from memlab.core import gpus, vocab
from memlab.core.validation import (check_bool, check_choice, check_int, check_mapping, check_number, check_schema,
                                    check_str, finite, invalid)
from memlab.estimate.recipes import (ATTN_IMPLEMENTATIONS, LOSS_ALIASES, LOSSES, MAX_BATCH, MAX_CONFIG_BYTES,
                                     MAX_SEQ_LEN, MAX_WORLD_SIZE, OPTIMIZER_IMPLS, ZERO_STAGES, check_input_bounds)

if TYPE_CHECKING:  # pragma: no cover
    from memlab.estimate.model import ModelSpec
    from memlab.estimate.result import MemoryEstimate
    from memlab.estimate.step import StepSpec

#: the keywords that build a step's LoRA / QLoRA adapters with ``adapter`` (not fields of StepSpec)
ADAPTER_KEYWORDS = ("lora_r", "lora_alpha", "target_modules", "lora_dropout", "adapter_dtype")
# what a measurement does not take: it runs one process, with no modelled rule and no modelled card
_NOT_MEASURED = ("kernel_scratch", "world_size", "zero_stage", "gpu", "fsdp_version")

# Bounds on work: past them a trace runs for minutes (each warm-up step is a whole traced step) or no real run exists.
MAX_WARMUP_STEPS = 16  # untracked steps before the tracked one: from the second on, nothing changes
MAX_GRAD_ACCUM = 2**16  # micro-batches per optimizer step (two are traced; later ones repeat the second)
MAX_LORA_R = 2**16  # an adapter's rank (no layer is wider than memlab.models.CONFIG_LIMITS' 2**17)
MAX_SEED = 2**63 - 1  # torch.manual_seed's range
# layers a trace takes one by one (extrapolate=False, or layers that differ): about 0.2 s each for a small model on a
# loaded 2-core CPU, so 128 (more than any published model: Llama 3.1 405B has 126) is half a minute, 1024 three
MAX_TRACED_LAYERS = 128
_DEVICE = re.compile(r"^(cpu|cuda|meta)(:[0-9]{1,4})?$")
ADAPTER_DTYPES = ("fp32", "bf16", "fp16")


def _step_fields() -> tuple[str, ...]:
    from memlab.estimate.step import StepSpec

    return tuple(f.name for f in dataclasses.fields(StepSpec))


# ---- the schema of a step's settings: one checker per argument, each naming it --------------------------------

def _int(lo: int, hi: int) -> Callable[[str, Any], Any]:
    return lambda name, v: check_int(name, v, minimum=lo, maximum=hi)


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, v: None if v is None else check(name, v)


def _choice(options: tuple, what: str = "") -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> None:
        if not isinstance(v, str):
            raise invalid(name, v, ", ".join(map(repr, options)) + what)
        check_choice(name, v, options)
    return check


def _recipe(name: str, v: Any) -> None:
    vocab.canonical_recipe(v, argument=name)


def _optimizer(name: str, v: Any) -> None:
    vocab.canonical_optimizer(v, argument=name)


def _device(name: str, v: Any) -> None:
    text = str(v) if type(v).__module__ == "torch" else v
    if not isinstance(text, str) or not _DEVICE.match(text.strip()):
        raise invalid(name, v, "'cuda', 'cpu' (or 'cuda:N', a torch.device)")


def _step_fn(name: str, v: Any) -> None:
    if v is None or callable(v):
        return
    if not isinstance(v, str) or v.count(":") != 1 or not all(v.split(":")):
        raise invalid(name, v, "None, a function (model, batch) -> loss, or 'module:function'")


def _adapter(name: str, v: Any) -> None:
    if v is None or (isinstance(v, str) and v in ("none", "lora", "qlora")):
        return
    if type(v).__name__ == "AdapterSpec":
        return
    raise invalid(name, v, "None, 'lora', 'qlora' (or a memlab.estimate.adapters.AdapterSpec)")


def _gpu(name: str, v: Any) -> None:
    if v is not None:
        gpus.parse_gpu(v, name=name)


def _target_modules(name: str, v: Any) -> None:
    allowed = "'all-linear', or module names such as 'q_proj,v_proj' (a str or a list of str)"
    if v is None:
        return
    if isinstance(v, str):
        if not v.strip() or not all(t.strip() for t in v.split(",")):
            raise invalid(name, v, allowed)
        return
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(t, str) and t.strip() for t in v):
        raise invalid(name, v, allowed)


def _lora_alpha(name: str, v: Any) -> None:
    if v is not None:
        check_number(name, v, minimum=0, strict_minimum=True)


def _dropout(name: str, v: Any) -> None:
    if not finite(v) or not 0 <= v < 1:
        raise invalid(name, v, "a number in [0, 1)")


def _lora_r(name: str, v: Any) -> None:
    check_int(name, v, minimum=1)  # (the message adapter_spec gives too)
    check_int(name, v, minimum=1, maximum=MAX_LORA_R)


# optimizer keywords memlab knows the type of (the optimizer itself refuses the others, named)
_OPT_NUMBERS = {"lr": 0.0, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0}
_OPT_BOOLS = ("amsgrad", "maximize", "nesterov", "foreach", "fused", "capturable", "differentiable",
              "offload_gradients", "pin_memory", "overlap")


def _optimizer_kwargs(name: str, v: Any) -> None:
    kwargs = check_mapping(name, v, "None or a dict of the optimizer's keywords (str keys), e.g. {'lr': 1e-4}")
    for k, x in kwargs.items():
        key = f"{name}[{k!r}]"
        if k in _OPT_NUMBERS:
            check_number(key, x, minimum=_OPT_NUMBERS[k])
        elif k == "eps":
            check_number(key, x, minimum=0, strict_minimum=True)
        elif k in _OPT_BOOLS:
            check_bool(key, x)
        elif k == "betas":
            if not (isinstance(x, (list, tuple)) and len(x) == 2 and all(finite(b) and 0 <= b < 1 for b in x)):
                raise invalid(key, x, "a pair of finite numbers in [0, 1), e.g. (0.9, 0.999)")


def _zero_stage(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v not in ZERO_STAGES:
        raise invalid(name, v, "0 (data parallel), 1 (optimizer state sharded), 2 (and gradients), "
                               "3 (and parameters: FSDP); an int")


def _fsdp_version(name: str, v: Any) -> None:
    from memlab.estimate.step import check_fsdp_version  # one message for the API, make_step, StepSpec and the CLI

    check_fsdp_version(name, v)


def _extrapolate(name: str, v: Any) -> None:
    if not (v is True or v is False or v == "auto" and isinstance(v, str)):
        raise invalid(name, v, "'auto', True, False")


#: every setting of a step (the fields of StepSpec and the adapter's keywords) and its rule
STEP_SCHEMA: dict[str, Callable[[str, Any], Any]] = {
    "batch_size": _int(1, MAX_BATCH),
    "seq_len": _int(1, MAX_SEQ_LEN),
    "dtype": _recipe,
    "optimizer": _optimizer,
    "checkpointing": check_bool,
    "warmup_steps": _int(0, MAX_WARMUP_STEPS),
    "device": _device,
    "optimizer_impl": _choice(OPTIMIZER_IMPLS),
    "optimizer_kwargs": _optimizer_kwargs,
    "seed": _int(0, MAX_SEED),
    "loss": _choice(LOSSES + tuple(LOSS_ALIASES)),
    "step": _step_fn,
    "attn_implementation": _optional(_choice(ATTN_IMPLEMENTATIONS, " or None")),
    "kernel_scratch": check_bool,
    "world_size": _int(1, MAX_WORLD_SIZE),
    "zero_stage": _zero_stage,
    "adapter": _adapter,
    "gpu": _gpu,
    "grad_accum": _int(1, MAX_GRAD_ACCUM),
    "offload_checkpoints": check_bool,
    "optimizer_in_backward": check_bool,
    "fsdp_version": _fsdp_version,
    "keep_previous_outputs": check_bool,
    "zero_grad_set_to_none": check_bool,
    "lora_r": _lora_r,
    "lora_alpha": _lora_alpha,
    "target_modules": _target_modules,
    "lora_dropout": _dropout,
    "adapter_dtype": _optional(_choice(ADAPTER_DTYPES, " or None")),
}

#: the entry points' own keywords (beside the model and the step)
ENTRY_SCHEMA: dict[str, Callable[[str, Any], Any]] = {
    "config_overrides": lambda name, v: check_mapping(name, v, "None or a dict of config fields (str keys), "
                                                               "e.g. {'num_hidden_layers': 2}"),
    "allow_longer_seq": check_bool,
    "extrapolate": _extrapolate,
}


def check_step_arguments(values: Mapping[str, Any]) -> None:
    """Check settings of a step (keywords of :func:`estimate_training_memory`, or a StepSpec's fields) against
    :data:`STEP_SCHEMA` and :data:`ENTRY_SCHEMA`, before any work.

    Raises:
        ValueError: ``name=value is invalid; allowed: ...`` for the first bad one.
    """
    check_schema(values, {**STEP_SCHEMA, **ENTRY_SCHEMA})


def check_step(step: "StepSpec") -> None:
    """Check every field of a built :class:`StepSpec` (one made directly skips :func:`make_step`'s check)."""
    check_step_arguments({f.name: getattr(step, f.name) for f in dataclasses.fields(step)})


# ---- config overrides: memlab's own rules, whatever the model's source (preset, config.json, Hub id, config) ----

_NOT_OVERRIDABLE = ("model_type", "architectures", "_name_or_path", "transformers_version", "auto_map")
_ACT_FIELDS = ("hidden_act", "activation_function")
_DTYPE_FIELDS = ("torch_dtype", "dtype")
_CONFIG_DTYPES = ("float32", "float16", "bfloat16")  # the recipe sets the weights' dtype; these are the names
_MAX_CONFIG_INT = 2**31  # token ids and other counts outside memlab.models.CONFIG_LIMITS


def _json_like(value: Any, depth: int = 0) -> bool:
    # None, bool, a finite number, a str, or lists / dicts (str keys) of them: what a config.json holds
    if value is None or isinstance(value, (bool, str)):
        return True
    if isinstance(value, (int, float)):
        return finite(value) and abs(value) <= 2**53
    if depth < 4 and isinstance(value, (list, tuple)):
        return all(_json_like(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    return False


def _number_rule(key: str) -> tuple[float, float, bool] | None:
    # (minimum, maximum, minimum excluded) for a float field memlab knows by its name, else None
    if key.endswith(("_eps", "_epsilon")) or key == "eps":
        return 0.0, 1.0, True
    if "dropout" in key or key.endswith(("_pdrop", "_prob")):
        return 0.0, 1.0, False
    if key in ("rope_theta", "initializer_range", "logit_scale", "attn_logit_softcapping",
               "final_logit_softcapping"):
        return 0.0, 1e12, key == "rope_theta"
    return None


def _check_override(key: str, value: Any, current: Any) -> None:
    """One config override against memlab's rules and the field's present value ``current``."""
    from memlab.models.presets import CONFIG_LIMITS

    name = f"config_overrides[{key!r}]"
    if key in _NOT_OVERRIDABLE:
        raise invalid(name, value, f"no override: {key} says which model this is (pass another model instead)")
    for fields, lo, hi in CONFIG_LIMITS.values():
        if key in fields:
            if value is None and key in ("num_key_value_heads", "head_dim", "n_inner"):
                return
            check_int(name, value, minimum=lo, maximum=hi)
            return
    if key in _ACT_FIELDS:
        from transformers.activations import ACT2FN

        check_choice(name, value, sorted(ACT2FN))
        return
    if key in _DTYPE_FIELDS:
        if value is not None:
            check_choice(name, value, _CONFIG_DTYPES)
        return
    if key.endswith("_token_id"):  # a token id, none, or a list of them (eos_token_id)
        ids = value if isinstance(value, list) and value else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < _MAX_CONFIG_INT
                                         for i in ids):
            raise invalid(name, value, "a token id (an int >= 0), a list of them, or None")
        return
    rule = _number_rule(key)
    if rule is not None and not (value is None and current is None):
        lo, hi, strict = rule
        check_number(name, value, minimum=lo, maximum=hi, strict_minimum=strict)
        return
    _check_by_type(name, value, current)


def _check_by_type(name: str, value: Any, current: Any) -> None:
    # a field memlab has no rule for by name: the type of its present value (a config.json's JSON types)
    if not _json_like(value):
        raise invalid(name, value, "a JSON value (a finite number, a str, true/false, null, a list or a dict)")
    if isinstance(current, bool):
        check_bool(name, value)
    elif isinstance(current, int):
        if value is not None:
            check_int(name, value, minimum=-_MAX_CONFIG_INT, maximum=_MAX_CONFIG_INT)
    elif isinstance(current, float):
        check_number(name, value)
    elif isinstance(current, str):
        check_str(name, value, "a non-empty string (the field is one)")
    elif isinstance(current, (list, tuple)) and not isinstance(value, (list, tuple)):
        raise invalid(name, value, "a list (the field is one)")
    elif isinstance(current, dict) and value is not None and not isinstance(value, dict):
        raise invalid(name, value, "a dict (the field is one) or null")


def check_config_overrides(config: Any, overrides: Mapping[str, Any]) -> None:
    """Check ``overrides`` (config fields to change) against memlab's rules before a model is built: the
    dimensions within :data:`memlab.models.CONFIG_LIMITS` (ints), activations among transformers' ``ACT2FN``,
    ``torch_dtype`` / ``dtype`` among float32, float16, bfloat16, epsilons finite and > 0, dropouts in [0, 1],
    other fields of the type of their present value in ``config`` (a bool stays a bool, an int an int, a float
    finite), and no override of what names the model (``model_type``). The same rules for a preset, a
    config.json, a Hub id or a transformers config. Unknown keys are the resolver's to refuse (with the closest
    field names).

    Raises:
        ValueError: ``config_overrides['key']=value is invalid; allowed: ...``.
    """
    for key, value in overrides.items():
        # (torch_dtype is not read: transformers warns on the deprecated name)
        _check_override(key, value, None if key in _DTYPE_FIELDS else getattr(config, key, None))


def config_file_name(path: str, cfg: Any = None) -> str:
    """How an estimate names a model read from a config.json (or its folder): the Hub id in its
    ``_name_or_path`` when it holds one, else its architecture (``architectures[0]``), else its ``model_type``;
    never the folder it sits in (``myproj/config.json`` is not a model called "myproj"). The file is named after it."""
    from memlab.estimate import hub

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    data: dict = {}
    try:
        if os.path.getsize(file) <= MAX_CONFIG_BYTES:
            with open(file, encoding="utf-8") as f:
                loaded = json.load(f)
            data = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        data = {}
    source = str(data.get("_name_or_path") or getattr(cfg, "_name_or_path", "") or "")
    archs = data.get("architectures") or getattr(cfg, "architectures", None) or []
    model_type = data.get("model_type") or getattr(cfg, "model_type", "?")
    if hub.REPO_ID.match(source) and not source.startswith((".", "/")):
        name = source
    elif archs and isinstance(archs[0], str):
        name = archs[0]
    else:
        name = str(model_type)
    return f"{name} ({model_type}, {path})"


def _is_config_path(model: Any) -> bool:
    from memlab.models import PRESETS

    return (isinstance(model, str) and model not in PRESETS
            and (model.endswith(".json") or os.path.isdir(model) or os.sep in model) and os.path.exists(model))


def _resolve(model: Any, overrides: Mapping[str, Any]) -> "ModelSpec":
    # the resolver, its errors from transformers' own field checks (strict dataclasses) turned into memlab's format
    from memlab.estimate.model import resolve_model

    try:
        return resolve_model(model, overrides or None)
    except (ValueError, TypeError, FileNotFoundError):
        raise
    except Exception as exc:  # e.g. huggingface_hub's StrictDataclassFieldValidationError on a setattr
        if not overrides or type(exc).__module__.split(".")[0] not in ("huggingface_hub", "transformers"):
            raise  # (a missing optional package, an interrupt ...: not the overrides' fault)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])
        raise ValueError(f"config_overrides={dict(overrides)!r} is invalid ({' '.join(s.strip() for s in first[:2])}); "
                         f"allowed: values of each field's type") from None


def resolve_for_step(model: Any, step: "StepSpec", config_overrides: Mapping[str, Any] | None = None,
                     allow_longer_seq: bool = False) -> "ModelSpec":
    """The model a step runs on: its config overrides checked (:func:`check_config_overrides`, whatever the
    model's source), resolved, its positions checked against ``step.seq_len``, its adapters attached (memlab.quant's
    codebooks for QLoRA are built by the trace, :func:`memlab.estimate.trace.trace_step`: an estimate read from the
    trace cache imports no torch)."""
    from memlab.estimate.model import check_positions

    overrides = check_mapping("config_overrides", config_overrides)
    if overrides and (isinstance(model, str) or not callable(model)):
        base = _resolve(model, {})  # the model as it is: the present value (and so the type) of each field
        check_config_overrides(base.config, overrides)
    spec = _resolve(model, overrides)
    if _is_config_path(model):
        spec = dataclasses.replace(spec, name=config_file_name(model, spec.config))
    check_positions(spec, step.seq_len, allow_longer_seq)
    if step.adapter is not None:
        spec = spec.with_adapter(step.adapter)
    return spec


def check_depth(spec: "ModelSpec", extrapolate: bool | str) -> None:
    """Refuse, before any trace, a model whose every layer would be traced when it has more than
    :data:`MAX_TRACED_LAYERS`: ``extrapolate=False``, or layers that differ (no extrapolation by depth).

    Raises:
        ValueError: naming the layer field, its value and the ways that are allowed.
    """
    layers = spec.layers()
    if layers is None or layers[1] <= MAX_TRACED_LAYERS:
        return
    field, n = layers
    if extrapolate is False:
        raise ValueError(f"extrapolate=False with {field}={n} is invalid: every layer would be traced one by one "
                         f"(minutes); allowed: extrapolate='auto' (exact for identical layers) or at most "
                         f"{MAX_TRACED_LAYERS} layers")
    if not spec.homogeneous():
        raise ValueError(f"{field}={n} with layers that differ is invalid: they cannot be extrapolated by depth and "
                         f"every layer would be traced (minutes); allowed: at most {MAX_TRACED_LAYERS} layers")


def make_step(spec: "StepSpec | None" = None, **overrides: Any) -> "StepSpec":
    """``spec`` with ``overrides``, or a new :class:`StepSpec` of them: the one place keywords become a step.

    Args:
        spec: the step to change; None builds one (``batch_size`` and ``seq_len`` are then needed).
        **overrides: fields of :class:`StepSpec`, any spelling, and the adapter's ``lora_r``, ``lora_alpha``,
            ``target_modules``, ``lora_dropout``, ``adapter_dtype`` (:func:`memlab.estimate.adapters.adapter_spec`),
            each checked against :data:`STEP_SCHEMA` first.

    Raises:
        TypeError: a keyword that is no setting of a step, or no ``batch_size`` / ``seq_len`` without ``spec``.
        ValueError: a bad value (named, with what is allowed).
    """
    from memlab.estimate.adapters import adapter_spec
    from memlab.estimate.step import StepSpec

    fields = _step_fields()
    if spec is not None and not isinstance(spec, StepSpec):
        raise TypeError(f"spec={spec!r} is invalid; allowed: a memlab.estimate.StepSpec or None (or its fields as keywords)")
    for key in overrides:
        if key not in fields and key not in ADAPTER_KEYWORDS:
            raise TypeError(f"unexpected keyword argument {key!r}; allowed: the fields of StepSpec "
                            f"({', '.join(fields)}) and {', '.join(ADAPTER_KEYWORDS)}")
    check_schema(overrides, STEP_SCHEMA)
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


def estimate_step(model: Any, step: "StepSpec", *, config_overrides: Mapping[str, Any] | None = None,
                  allow_longer_seq: bool = False, extrapolate: bool | str = "auto") -> "MemoryEstimate":
    """:func:`estimate_training_memory` of a :class:`StepSpec` (the planner's route): per rank under ZeRO.

    Raises:
        ValueError, TypeError, FileNotFoundError: bad settings, named.
    """
    from memlab.estimate.extrapolate import estimate_one_rank
    from memlab.estimate.sharding import check_zero, fsdp_units, shard_estimate, trace_fsdp
    from memlab.estimate.step import add_zero_grad_note

    check_step(step)
    check_schema(dict(config_overrides=config_overrides, allow_longer_seq=allow_longer_seq, extrapolate=extrapolate),
                 ENTRY_SCHEMA)
    check_input_bounds(step.batch_size, step.seq_len, step.world_size)
    check_zero(step.world_size, step.zero_stage, step.optimizer)
    spec = resolve_for_step(model, step, config_overrides, allow_longer_seq)
    check_depth(spec, extrapolate)
    why = ""
    if step.zero_stage == 3:
        traced, why = trace_fsdp(spec, step, extrapolate)
        if traced is not None:
            return traced
    est = add_zero_grad_note(estimate_one_rank(spec, step, extrapolate), step)  # (memlab.estimate.step)
    if step.world_size == 1 and step.zero_stage == 0:
        return est
    units = fsdp_units(model, step.dtype, config_overrides) if step.zero_stage == 3 else None
    out = shard_estimate(est, step.world_size, step.zero_stage, units=units, fsdp_version=step.fsdp_version,
                         grad_accum=step.grad_accum)
    if why:
        out.notes.append(f"FSDP{step.fsdp_version} not traced ({why}): its unsharded units are modelled")
    return out


def estimate_training_memory(model: Any, spec: "StepSpec | None" = None, *,
                             config_overrides: Mapping[str, Any] | None = None, allow_longer_seq: bool = False,
                             extrapolate: bool | str = "auto", **overrides: Any) -> "MemoryEstimate":
    """Peak memory of a (steady-state) training step of ``model``, traced on fake tensors (nothing allocated).

    The step is ``spec``, changed by ``overrides``, or built from them alone: the fields of
    :class:`StepSpec` (``batch_size``, ``seq_len``, ``dtype``, ``optimizer``, ``checkpointing``, ``device``,
    ``world_size``, ``zero_stage``, ``adapter``, ``gpu``, ``grad_accum``, ... each described there) and the
    adapter's ``lora_r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``, ``adapter_dtype``
    (:func:`make_step`). Under ZeRO (``world_size``, ``zero_stage``) the estimate is one rank's. Every argument
    is checked before any work (:data:`STEP_SCHEMA`, :data:`ENTRY_SCHEMA`, :func:`check_config_overrides`).

    Args:
        model: a preset of :data:`memlab.models.PRESETS`, a config.json path, a Hub id (config.json only),
            a transformers config, or a callable returning an ``nn.Module`` (built inside the fake mode): a model
            factory (a keyword parameter ``depth``, ``num_layers``, ``n_layers`` or ``num_hidden_layers``) is
            traced at 3, 4 and 5 layers and extrapolated to its default depth; a builder returning
            ``AutoModelForCausalLM.from_config(config)`` unchanged takes the config's route; any other callable
            is traced at full depth (:func:`memlab.estimate.extrapolate.callable_route`; the notes say which).
        spec: the step; None: built from ``overrides``.
        config_overrides: config fields to change (unknown keys are errors; values checked by memlab's rules);
            for a model factory, only its depth parameter (``{"depth": 80}``).
        allow_longer_seq: allow ``seq_len`` beyond the model's positions (RoPE scaling).
        extrapolate: "auto" and True trace a homogeneous stack of 6+ layers (EXTRAPOLATE_MIN_LAYERS) at three depths
            and extrapolate exactly by layer count (:mod:`memlab.estimate.extrapolate`); False traces every layer.
        gpu (keyword): the target card (:data:`memlab.core.gpus.GPUS`) or a size (``"24GB"``, ``"24GiB"``, bytes).

    Raises:
        ValueError, TypeError, FileNotFoundError: a bad setting, named with what is allowed.
    """
    check_schema(dict(config_overrides=config_overrides, allow_longer_seq=allow_longer_seq, extrapolate=extrapolate),
                 ENTRY_SCHEMA)
    check_schema(overrides, STEP_SCHEMA)  # torch-free: every keyword before anything is imported or read
    _read_hub_config_first(model)
    return estimate_step(model, make_step(spec, **overrides), config_overrides=config_overrides,
                         allow_longer_seq=allow_longer_seq, extrapolate=extrapolate)


def _read_hub_config_first(model: Any) -> None:
    """A Hub id's config.json read (and kept) before torch is imported: one that cannot be had is refused in a
    second, not after the imports a step needs (:mod:`memlab.estimate.hub`)."""
    from memlab.estimate import hub

    if hub.looks_like_repo_id(model):
        from memlab.models import PRESETS

        if model not in PRESETS:
            hub.load_hub_config(model)


def measure_training_memory(model: Any, spec: "StepSpec | None" = None, *,
                            config_overrides: Mapping[str, Any] | None = None, allow_longer_seq: bool = False,
                            **overrides: Any) -> "MemoryEstimate":
    """The same step as :func:`estimate_training_memory`, run for real on ``device`` (here "cpu" unless
    given) and tracked with :class:`memlab.profiler.MemoryTracker` (for models that fit): ``fake=False``.

    A measurement runs one process and has no modelled rules: ``world_size``, ``zero_stage``, ``gpu`` and
    ``kernel_scratch`` are not taken, and kernel scratch that no op returns is not in it (compare it with
    ``estimate_training_memory(..., kernel_scratch=False)``). Arguments are checked as the estimate's are.

    Raises:
        ValueError, TypeError, FileNotFoundError: a bad setting, named with what is allowed.
    """
    from memlab.estimate.step import add_zero_grad_note
    from memlab.estimate.trace import trace_step

    for key in _NOT_MEASURED:
        if key in overrides:
            raise TypeError(f"unexpected keyword argument {key!r}: a measurement runs one process with no modelled "
                            f"rules or card; allowed: estimate_training_memory(..., {key}=...)")
    check_schema(dict(config_overrides=config_overrides, allow_longer_seq=allow_longer_seq), ENTRY_SCHEMA)
    if spec is None:
        overrides.setdefault("device", "cpu")
    step = make_step(spec, **overrides)
    check_step(step)
    if step.world_size != 1 or step.zero_stage:
        raise ValueError(f"world_size={step.world_size}, zero_stage={step.zero_stage} cannot be measured in one "
                         f"process; allowed: world_size=1, zero_stage=0 (estimate_training_memory models the ranks)")
    check_input_bounds(step.batch_size, step.seq_len, step.world_size)
    step = step.replace(kernel_scratch=False)
    return add_zero_grad_note(trace_step(resolve_for_step(model, step, config_overrides, allow_longer_seq), step,
                                         fake=False), step)

