"""Estimating one stack: the estimator's trace of its micro-batch step (:mod:`memlab.estimate`: the one
model resolver, the one step description, the one extrapolation by depth), cached in memory and on disk."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from memlab.core.cachefile import write_cache_file
from memlab.core.vocab import Recipe
from memlab.plan.stack import ESTIMATOR_OPTIMIZER, Stack


def resolve_config(model: Any, config_overrides: Mapping[str, Any] | None = None) -> tuple[str, Any]:
    """The planner's model as ``(name, transformers config)``, through the estimator's one resolver
    (:func:`memlab.estimate.resolve_model`).

    Args:
        model: a preset, a config.json path, a Hub model id (its config.json only) or a transformers config.

    Raises:
        TypeError: a callable or a module (the planner rebuilds the model with adapters and checkpointing);
            ValueError: an unknown name or a config without a layer count.
    """
    from memlab.estimate import resolve_model

    if callable(model) and not isinstance(model, str) and not hasattr(model, "to_json_string"):
        raise TypeError(f"model={type(model).__name__} is invalid; allowed: a preset name, a config.json path or a "
                        f"transformers config (the planner rebuilds the model with adapters and checkpointing)")
    spec = resolve_model(model, config_overrides)
    if spec.layers() is None:
        raise ValueError(f"model={spec.name!r} is invalid; allowed: a config with a layer count "
                         f"(num_hidden_layers, n_layer or num_layers)")
    return spec.name, spec.config


def layer_count(cfg: Any) -> int:
    """The number of decoder layers of a transformers config (:meth:`memlab.estimate.ModelSpec.layers`)."""
    from memlab.estimate import ModelSpec

    return ModelSpec("", config=cfg).layers()[1]


def config_at_depth(cfg: Any, depth: int) -> Any:
    """``cfg`` with ``depth`` decoder layers (the estimator's extrapolation by depth traces such copies)."""
    from memlab.estimate import ModelSpec

    return ModelSpec("", config=cfg).at_depth(depth).config


def _adapter_spec(stack: Stack, lora_r: int) -> Any:
    # The planner's LoRA/QLoRA as a :class:`memlab.estimate.adapters.AdapterSpec` (None for a full fine-tune):
    # rank ``lora_r``, alpha 2 x r, every linear layer but the head, fp32 adapters -- the same adapters
    # ``memlab estimate --adapter`` builds (one builder: :func:`memlab.estimate.adapters.apply_adapter`).
    from memlab.estimate import adapters

    if stack.adapter == "full":
        return None
    return adapters.adapter_spec(stack.adapter, recipe=stack.precision, lora_r=lora_r)


def weight_dtype(stack: Stack) -> Any:
    """The torch dtype :func:`model_builder` builds ``stack``'s base weights in: the frozen base's
    (:func:`memlab.estimate.adapters.base_dtype`) under LoRA/QLoRA, bf16 for "bf16-pure", else fp32 (the mixed
    recipes keep fp32 weights and run under autocast)."""
    import torch

    if stack.adapter != "full":
        from memlab.estimate import adapters

        return adapters.base_dtype(stack.precision)
    return torch.bfloat16 if stack.precision == Recipe.BF16_PURE else torch.float32


def adapter_dtype(stack: Stack, lora_r: int) -> Any:
    """The torch dtype of ``stack``'s LoRA/QLoRA adapters (None for a full fine-tune)."""
    from memlab.estimate import adapters

    spec = _adapter_spec(stack, lora_r)
    return None if spec is None else adapters.ADAPTER_DTYPES[spec.dtype]


def model_builder(cfg: Any, stack: Stack, lora_r: int) -> Callable[[], Any]:
    """A callable that builds ``stack``'s model from ``cfg``: its dtype, attention, LoRA/QLoRA adapters of rank
    ``lora_r`` and checkpointing (called inside the estimator's fake mode, or on the meta device)."""
    import torch

    def build():
        import warnings

        from transformers import AutoModelForCausalLM
        from transformers.modeling_layers import GradientCheckpointingLayer

        from memlab.estimate import adapters

        spec = _adapter_spec(stack, lora_r)
        dtype = weight_dtype(stack)
        attn = "sdpa" if stack.attention == "flash" else stack.attention
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
        if spec is not None:
            adapters.apply_adapter(model, spec, stack.precision)
        if stack.checkpointing != "none":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.gradient_checkpointing_enable()
            if stack.checkpointing == "every-k":
                layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
                for i, layer in enumerate(layers):
                    layer.gradient_checkpointing = i % stack.ckpt_every == 0
        return model

    build.__name__ = f"{type(cfg).__name__}+{stack.adapter}"
    return build


def estimate_stack(model: Any, stack: Stack, *, seq_len: int, device: str = "cuda",
                   config_overrides: Mapping[str, Any] | None = None, lora_r: int = 16,
                   extrapolate: bool = True, loss: str = "auto") -> Any:
    """memlab.estimate's traced estimate (a :class:`memlab.estimate.MemoryEstimate`) of one optimizer step of
    ``stack`` (micro-batches of ``stack.micro_batch``; with accumulation the first micro-batch's gradients stay
    through the next).

    A full fine-tune or LoRA/QLoRA with checkpointing "none" or "full" is the estimator's own case
    (:func:`memlab.estimate.estimate_step`). "every-k" is traced on a model built by a callable
    (checkpointing switched on layer by layer), at two depths that are multiples of k and extrapolated
    by :func:`memlab.estimate.extrapolate_by_depth`.

    Args:
        model: a preset, a config.json path, a Hub model id or a transformers config.
        extrapolate: False traces every layer.
        loss: the estimator's (``"auto"``: transformers' own loss; ``"memlab"``: :func:`memlab.models.lm_loss`,
            the loss :class:`memlab.train.BudgetTrainer` runs).
    """
    name, cfg = resolve_config(model, config_overrides)
    return cached_estimate(name, cfg, stack, seq_len=seq_len, device=device, lora_r=lora_r, extrapolate=extrapolate, loss=loss)


_CACHE: dict[tuple, Any] = {}
_CACHE_MAX = 512
_SOURCES_HASH: list[str] = []
# memlab's modules a trace runs: edited code re-traces
_TRACED_SOURCES = ("estimate/*.py", "plan/*.py", "profiler/*.py", "core/*.py", "quant/*.py", "models/*.py",
                   "checkpoint/*.py", "attention/*.py", "offload/*.py", "loss/*.py", "accounting.py")


def trace_cache_dir() -> Path | None:
    """Where traced estimates persist across runs: ``$MEMLAB_CACHE_DIR`` (None when it is ``none``: no disk
    cache), else ``$XDG_CACHE_HOME/memlab/traces``, else ``~/.cache/memlab/traces``."""
    env = os.environ.get("MEMLAB_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "none", "off") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memlab" / "traces"


def _versions() -> str:
    # everything outside the arguments that changes a trace: the versions of memlab, torch and
    # transformers, and the source of the memlab modules a trace runs (edited code re-traces)
    if not _SOURCES_HASH:
        import hashlib
        import importlib.metadata as md

        import torch
        import transformers

        h = hashlib.sha256()
        here = Path(__file__).resolve().parents[1]
        for pattern in _TRACED_SOURCES:
            for f in sorted(here.glob(pattern)):
                h.update(str(f.relative_to(here)).encode() + f.read_bytes())
        try:
            ver = md.version("memlab")
        except md.PackageNotFoundError:
            ver = "?"
        _SOURCES_HASH.append(f"memlab {ver} src {h.hexdigest()[:16]} torch {torch.__version__} "
                             f"transformers {transformers.__version__}")
    return _SOURCES_HASH[0]


def _disk_path(key: tuple) -> Path | None:
    import hashlib

    d = trace_cache_dir()
    if d is None:
        return None
    return d / (hashlib.sha256(repr((key, _versions())).encode()).hexdigest()[:32] + ".pkl")


def _cache_key(cfg: Any, stack: Stack, seq_len: int, device: str, lora_r: int, extrapolate: bool, loss: str) -> tuple:
    # accumulation's count beyond 2 does not change the peak (the second micro-batch and later ones are alike)
    # CUBLAS_WORKSPACE_CONFIG sets the cuBLAS workspaces a CUDA target's reserved estimate counts
    return (cfg.to_json_string(use_diff=False), dataclasses.replace(stack, grad_accum=min(stack.grad_accum, 2)),
            seq_len, device, lora_r, extrapolate, loss) + (
        (os.environ.get("CUBLAS_WORKSPACE_CONFIG"),) if device == "cuda" else ())


def _remember(key: tuple, est: Any) -> None:
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = est


def _read_disk(path: Path | None) -> Any:
    import pickle

    if path is None or not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001  (a torn or stale file: trace again)
        return None


def lookup_estimate(cfg: Any, stack: Stack, *, seq_len: int, device: str, lora_r: int, extrapolate: bool = True,
                    loss: str = "auto") -> Any:
    """The estimate :func:`cached_estimate` would read from its memory or disk cache, or None where it would trace
    (nothing is traced here)."""
    key = _cache_key(cfg, stack, seq_len, device, lora_r, extrapolate, loss)
    if key in _CACHE:
        return _CACHE[key]
    est = _read_disk(_disk_path(key))
    if est is not None:
        _remember(key, est)
    return est


def remember_estimate(cfg: Any, stack: Stack, est: Any, *, seq_len: int, device: str, lora_r: int,
                      extrapolate: bool = True, loss: str = "auto") -> None:
    """Keep ``est`` (made in another process, :mod:`memlab.plan.ahead`, which wrote the disk cache) in the memory
    cache, as :func:`cached_estimate` keeps what it traces."""
    _remember(_cache_key(cfg, stack, seq_len, device, lora_r, extrapolate, loss), est)


def cached_estimate(name: str, cfg: Any, stack: Stack, *, seq_len: int, device: str, lora_r: int,
                    extrapolate: bool = True, loss: str = "auto", origin: list[str] | None = None) -> Any:
    """:func:`estimate_stack` of a resolved ``(name, cfg)``, cached by (config, stack, seq_len, ...) in memory
    and on disk (:func:`trace_cache_dir`, keyed also by the versions and memlab's source), so a second
    identical ``memlab plan`` reads its traces instead of tracing again.

    With accumulation the first micro-batch's gradients stay allocated through the second, and later
    ones repeat it: a ``grad_accum`` above 2 is keyed as 2. ``name`` is not in the key (the config is).
    ``origin``: a list that gets where the estimate came from appended: "memory", "disk" (the two caches) or
    "traced" (traced now).
    """
    key = _cache_key(cfg, stack, seq_len, device, lora_r, extrapolate, loss)
    if key in _CACHE:
        if origin is not None:
            origin.append("memory")
        return _CACHE[key]
    path = _disk_path(key)
    est = _read_disk(path)
    if origin is not None:
        origin.append("disk" if est is not None else "traced")
    if est is None:
        est = _trace(cfg, stack, seq_len=seq_len, device=device, lora_r=lora_r, extrapolate=extrapolate, loss=loss)
        if path is not None:
            # the tracker (the trace's timeline, a local class) stays in memory; the numbers go to disk
            write_cache_file(path, dataclasses.replace(est, tracker=None) if dataclasses.is_dataclass(est) else est)
    _remember(key, est)
    return est


def step_keywords(stack: Stack, *, seq_len: int, device: str, loss: str = "auto") -> dict[str, Any]:
    """The keywords of :func:`memlab.estimate.make_step` that ``stack``'s micro-batch step has (checkpointing and
    adapters apart): its batch, precision, optimizer, loss (``stack.loss`` "default" is ``loss``) and the optimizer
    step in backward; what ``memlab estimate`` takes for the same step."""
    opt, impl, okw = ESTIMATOR_OPTIMIZER[stack.optimizer]
    return dict(batch_size=stack.micro_batch, seq_len=seq_len, dtype=stack.precision, optimizer=opt,
                optimizer_impl=impl, optimizer_kwargs=okw, device=device,
                loss=loss if stack.loss == "default" else stack.loss, grad_accum=stack.grad_accum,
                optimizer_in_backward=stack.optimizer_in_backward)


def _trace(cfg: Any, stack: Stack, *, seq_len: int, device: str, lora_r: int, extrapolate: bool,
           loss: str = "auto") -> Any:
    from memlab.estimate import adapters
    from memlab.estimate import estimate_step, extrapolate_by_depth, make_step

    if stack.adapter == "qlora":
        adapters.warm_quant()
    kw = step_keywords(stack, seq_len=seq_len, device=device, loss=loss)
    if stack.checkpointing in ("none", "full"):  # the estimator's own route, adapters included (memlab.estimate.adapters)
        step = make_step(checkpointing=stack.checkpointing == "full", attn_implementation=stack.attention,
                         adapter=_adapter_spec(stack, lora_r), **kw)
        return estimate_step(cfg, step, extrapolate=extrapolate)
    step = make_step(checkpointing=False, **kw)  # checkpointing and adapters: in the builder
    L = layer_count(cfg)
    unit = stack.ckpt_every if stack.checkpointing == "every-k" else 1

    def at(depth: int) -> Any:
        return estimate_step(model_builder(config_at_depth(cfg, depth), stack, lora_r), step, extrapolate=False)

    if extrapolate and L % unit == 0:
        # from the third unit on, checked at the fifth (memlab.estimate.extrapolate.aligned_peaks): the first and
        # the last units can differ from the others (a frozen embedding's output needs no gradient)
        est = extrapolate_by_depth(at, L, ((3 * unit, 4 * unit), (4 * unit, 5 * unit)))
        if est is not None:
            return est
    return at(L)
