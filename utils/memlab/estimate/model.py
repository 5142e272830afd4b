"""The one model resolver: a preset, a config.json, a Hub id, a transformers config or a callable
becomes a :class:`ModelSpec` that builds the model (on fake tensors) at any depth.

Used by :func:`memlab.estimate.estimate_training_memory` and :func:`memlab.plan.plan` alike. Hub ids
read only their config.json, through transformers (:mod:`memlab.estimate.hub`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import stat as _stat
import sys
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # pragma: no cover - imported where used: resolving a preset needs no torch
    import torch
    from torch import nn

from memlab.core.optional import needs
from memlab.core.units import MiB
from memlab.core.vocab import Recipe
from memlab.estimate.recipes import MAX_CONFIG_BYTES


def is_hf_config(obj: Any) -> bool:
    """True when ``obj`` is a transformers ``PretrainedConfig``."""
    try:
        from transformers import PretrainedConfig
    except Exception:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, PretrainedConfig)


# A config must give these (one name of each group) for the model to have a size at all.
_REQUIRED_DIMS = (
    ("hidden_size", "n_embd", "d_model"),
    ("num_hidden_layers", "n_layer", "num_layers"),
    ("num_attention_heads", "n_head"),
    ("vocab_size",),
)
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_POSITION_FIELDS = ("max_position_embeddings", "n_positions")
# transformers' attribute_map of the preset families' config classes (only GPT2Config has one): another name of a field
_ATTRIBUTE_MAPS = {"gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                            "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}}
# position tables of learned rows: no flag makes a longer sequence meaningful
_LEARNED_POSITIONS = ("gpt2", "gpt_neo", "gpt_bigcode", "opt", "bert", "roberta")


def load_config(path: str | os.PathLike):
    """A ``transformers`` config from a local ``config.json`` (or a folder holding one), offline.

    Raises:
        FileNotFoundError, ValueError: naming the file: missing, unreadable, not JSON, no
            ``model_type``, an unknown ``model_type``, or a dimension missing (``hidden_size``,
            layers, heads, ``vocab_size``: without them transformers would use its default size).
    """
    with needs("memlab estimate"):
        from transformers import AutoConfig

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        st = os.stat(path)
        if not _stat.S_ISREG(st.st_mode):
            raise ValueError(f"config file {path!r} is not a regular file (a device, a pipe or a socket); "
                             "allowed: a config.json file")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"config file {path!r} is larger than {MAX_CONFIG_BYTES // MiB} MiB; allowed: a "
                             "config.json (a few KiB)")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {path!r} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"config file {path!r} has no 'model_type'; allowed: a transformers config.json")
    missing = [" / ".join(group) for group in _REQUIRED_DIMS if not any(k in data for k in group)]
    if missing:
        raise ValueError(f"config file {path!r} lacks {', '.join(missing)}: without them transformers would "
                         f"use its default size for {data['model_type']!r}; allowed: a complete config.json")
    from memlab.models import validate_config

    validate_config(data, f"config file {path!r}")
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"config file {path!r}: model_type={model_type!r} cannot be built by transformers ({exc})") from None


def check_overrides(cfg: Any, overrides: Mapping[str, Any], what: str) -> None:
    """Refuse override keys that are not fields of ``cfg`` (a typo would otherwise be ignored);
    ``what`` is how the error names the model.

    Raises:
        ValueError: naming the unknown key, with the closest field names.
    """
    import difflib

    try:
        default = type(cfg)()
    except Exception:  # pragma: no cover - every transformers config has defaults
        default = cfg
    known = set(vars(default)) | set(vars(cfg)) | set(getattr(type(cfg), "attribute_map", {}))
    for key in overrides:
        if key in known or hasattr(default, key):
            continue
        close = difflib.get_close_matches(key, sorted(k for k in known if not k.startswith("_")), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"config_overrides key {key!r} is not a field of {type(cfg).__name__} ({what}){hint}")


# A model factory: a callable with a keyword parameter of one of these names builds the model at that depth
# (decoder layers); the estimator traces it at a few small depths and extrapolates (memlab.estimate.extrapolate).
DEPTH_PARAMETERS = ("depth", "num_layers", "n_layers", "num_hidden_layers")


def depth_parameter(fn: Callable) -> tuple[str, Any] | None:
    """``(name, default)`` of ``fn``'s depth parameter (one of :data:`DEPTH_PARAMETERS`, taken by keyword), its default
    ``inspect.Parameter.empty`` when it has none; None when ``fn`` has none, or its signature cannot be read.

    Raises:
        ValueError: ``fn`` takes more than one of them (which one sets the depth is not known).
    """
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin, a C callable: no signature to read
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    found = [(n, p.default) for n, p in sig.parameters.items() if n in DEPTH_PARAMETERS and p.kind in kinds]
    if len(found) > 1:
        raise ValueError(f"model={getattr(fn, '__name__', type(fn).__name__)} takes {', '.join(n for n, _ in found)}: "
                         f"which of them sets the depth is not known; allowed: a callable with one depth parameter "
                         f"({', '.join(DEPTH_PARAMETERS)}), or one without any (traced at full depth)")
    return found[0] if found else None


class _AtDepth:
    """A model factory called with its depth parameter set: a builder of no arguments that names the factory (its
    ``__name__`` and ``__code__``, so an untraceable builder's error points at the factory's own line)."""

    def __init__(self, factory: Callable[..., nn.Module], param: str, depth: int) -> None:
        self.factory, self.param, self.depth = factory, param, depth
        self.__name__ = getattr(factory, "__name__", type(factory).__name__)
        code = getattr(factory, "__code__", None)
        if code is not None:
            self.__code__ = code

    def __call__(self) -> nn.Module:
        return self.factory(**{self.param: self.depth})

    def __repr__(self) -> str:
        return f"{self.__name__}({self.param}={self.depth})"


@dataclass(init=False)
class ModelSpec:
    """What to build: a display name, and either a transformers config or a plain callable.

    A preset resolved without overrides keeps its name in ``preset`` and builds its transformers config on first
    use of :attr:`config` (so an answer read from the trace cache never imports transformers).

    A model factory (a callable taking a depth parameter, :data:`DEPTH_PARAMETERS`) keeps the factory in
    ``factory``, the parameter's name in ``depth_param`` and the full depth in ``depth``; ``fn`` builds it at that
    depth, :meth:`at_depth` at any other, :meth:`layers` answers ``(depth_param, depth)``."""

    name: str
    fn: Callable[[], nn.Module] | None = None
    adapter: Any = None  # a memlab.estimate.adapters.AdapterSpec: LoRA / QLoRA built on the base (memlab.estimate.adapters)
    preset: str | None = None  # a preset of memlab.models.PRESETS, its config built when first read
    _config: Any = field(default=None, repr=False)
    factory: Callable[..., nn.Module] | None = None  # a model factory, called with depth_param=depth
    depth_param: str | None = None
    depth: int | None = None
    depth_source: str = ""  # where the full depth came from (the factory's default, config_overrides)

    def __init__(self, name: str, config: Any = None, fn: Callable[[], nn.Module] | None = None, adapter: Any = None,
                 preset: str | None = None, _config: Any = None, factory: Callable[..., nn.Module] | None = None,
                 depth_param: str | None = None, depth: int | None = None, depth_source: str = "") -> None:
        self.name, self.fn, self.adapter, self.preset = name, fn, adapter, preset
        self._config = config if config is not None else _config
        self.factory, self.depth_param, self.depth, self.depth_source = factory, depth_param, depth, depth_source
        if factory is not None and fn is None:
            self.fn = _AtDepth(factory, depth_param, depth)

    @property
    def config(self) -> Any:
        """The transformers config (a preset's built now if it was not yet), or None for a callable."""
        if self._config is None and self.preset is not None:
            from memlab.models import preset_config

            self._config = preset_config(self.preset)
        return self._config

    @property
    def is_hf(self) -> bool:
        return self._config is not None or self.preset is not None

    def fields(self) -> dict[str, Any] | None:
        """The config's fields without building it where that is possible (a preset's published dimensions,
        ``model_type`` its family), else the built config's; None for a callable."""
        if self._config is None and self.preset is not None:
            from memlab.models import PRESETS

            entry = PRESETS[self.preset]
            out = {**{k: v for k, v in entry.items() if k not in ("family", "hf_id")}, "model_type": entry["family"]}
            # the names GPT2Config also answers to (its attribute_map), as getattr on the built config does
            out.update({k: out[v] for k, v in _ATTRIBUTE_MAPS.get(entry["family"], {}).items() if v in out})
            return out
        return None if self.config is None else {**vars(self.config), "model_type": getattr(self.config, "model_type", "")}

    def cache_key(self) -> str | None:
        """What identifies the model in the trace cache (its name, config, adapter), or None for a callable."""
        if self.fn is not None or not self.is_hf:
            return None
        cfg = repr(sorted(self.fields().items())) if self._config is None else self._config.to_json_string(use_diff=False)
        return repr((self.name, type(self._config).__name__ if self._config is not None else self.preset, cfg,
                     self.adapter))

    def layers(self) -> tuple[str, int] | None:
        """``(the config's layer-count field, its value)``; a model factory's ``(its depth parameter, the full
        depth)``; None for another callable or a config without one."""
        if self.factory is not None:
            return self.depth_param, self.depth
        lazy = self.fields() if (self._config is None and self.preset is not None) else None  # no config built
        for f in _LAYER_FIELDS:
            if lazy is not None:
                v = lazy.get(f)
            else:
                v = getattr(self.config, f, None) if self.config is not None else None
            if isinstance(v, int) and v > 0:
                return f, v
        return None

    def homogeneous(self) -> bool:
        """Whether the decoder layers are identical (no per-layer types that differ): the case
        extrapolation by depth is exact for."""
        if self.layers() is None:
            return False
        for f in ("layer_types", "sliding_window_pattern_list", "block_types"):
            v = getattr(self.config, f, None)
            if isinstance(v, (list, tuple)) and len(set(map(str, v))) > 1:
                return False
        if getattr(self.config, "use_sliding_window", False) and getattr(self.config, "max_window_layers", None) not in (None, 0):
            mw, (_, n) = self.config.max_window_layers, self.layers()
            if 0 < mw < n:
                return False
        return True

    def at_depth(self, depth: int) -> "ModelSpec":
        """The same model with ``depth`` decoder layers (the config deep-copied; per-layer lists cut to ``depth``; a
        model factory called with its depth parameter set to ``depth``)."""
        if self.factory is not None:
            return ModelSpec(self.name, factory=self.factory, depth_param=self.depth_param, depth=depth,
                             adapter=self.adapter, depth_source=self.depth_source)
        cfg = copy.deepcopy(self.config)
        f, n = self.layers()
        setattr(cfg, f, depth)
        for lf in ("layer_types",):
            v = getattr(cfg, lf, None)
            if isinstance(v, (list, tuple)) and len(v) == n:
                setattr(cfg, lf, list(v[:1]) * depth)
        return ModelSpec(self.name, config=cfg, adapter=self.adapter)

    def with_adapter(self, adapter: Any) -> "ModelSpec":
        """The same model with LoRA / QLoRA adapters (a :class:`memlab.estimate.adapters.AdapterSpec`, or None)."""
        return ModelSpec(self.name, config=self._config, fn=None if self.factory is not None else self.fn,
                         adapter=adapter, preset=self.preset, factory=self.factory, depth_param=self.depth_param,
                         depth=self.depth, depth_source=self.depth_source)

    def build(self, dtype: str, attn: str | None) -> nn.Module:
        """Build the model, adapters applied when the spec has them (call it inside a fake mode for a trace).

        Args:
            dtype: the canonical recipe; it alone sets the weights' dtype.
            attn: transformers' ``attn_implementation``, or None for its default.
        """
        import torch

        if self.adapter is not None:  # the one builder of adapted models (estimate, CLI and plan)
            from memlab.estimate import adapters

            base = adapters.base_dtype(dtype)
            if self.fn is not None:
                model = build_in(self.fn, base)
            else:
                model = self._from_config(base, attn)
            return adapters.apply_adapter(model, self.adapter, dtype)
        if self.fn is not None:
            return _build(self.fn, dtype)
        # The weights' dtype comes from the recipe, never from the config's torch_dtype / dtype
        # (transformers 5 would otherwise build a bf16 model from a config that says bfloat16).
        return self._from_config(torch.bfloat16 if dtype == Recipe.BF16_PURE else torch.float32, attn)

    def _from_config(self, param_dtype: torch.dtype, attn: str | None) -> nn.Module:
        with needs("memlab estimate"):
            from transformers import AutoModelForCausalLM
        kw = {} if attn is None else {"attn_implementation": attn}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(self.config, dtype=param_dtype, **kw)


def resolve_model(model: Any, config_overrides: Mapping[str, Any] | None) -> ModelSpec:
    """The one model resolver of the estimator and the planner.

    Args:
        model: a preset of :data:`memlab.models.PRESETS`, a config.json path (or its folder), a Hub
            model id ``org/name`` (its config.json only, :mod:`memlab.estimate.hub`), a transformers config,
            or a callable returning an ``nn.Module`` (a model factory when it takes a depth parameter, one of
            :data:`DEPTH_PARAMETERS`: built at its default depth, or the one ``config_overrides`` gives it).
        config_overrides: config fields to change; for a model factory only its depth parameter
            (``{"depth": 32}``), for another callable none.

    Raises:
        ValueError, TypeError, FileNotFoundError: an unknown name (with the closest preset), a bad
            file, an unknown override key, an ``nn.Module`` instance.
    """
    from memlab.models import validate_config

    overrides = dict(config_overrides or {})
    if isinstance(model, str):
        from memlab.models import PRESETS, UnknownPresetError, preset_config

        if model in PRESETS:
            if not overrides:  # its transformers config built when first needed (not for a cached answer)
                return ModelSpec(model, preset=model)
            check_overrides(preset_config(model), overrides, f"preset {model!r}")
            cfg = preset_config(model, **overrides)
            return ModelSpec(model, config=cfg)
        from memlab.estimate import hub

        if hub.looks_like_repo_id(model):  # "org/name": its config.json through transformers (memlab.estimate.hub)
            cfg = hub.load_hub_config(model)
            check_overrides(cfg, overrides, f"model {model!r}")
            for k, v in overrides.items():
                setattr(cfg, k, v)
            validate_config(cfg, f"model {model!r}")
            return ModelSpec(f"{model} ({getattr(cfg, 'model_type', '?')})", config=cfg)
        if model.endswith(".json") or os.path.isdir(model) or os.sep in model:
            if not os.path.exists(model):
                raise FileNotFoundError(f"config file {model!r}: no such file")
            cfg = load_config(model)
            check_overrides(cfg, overrides, f"config file {model!r}")
            for k, v in overrides.items():
                setattr(cfg, k, v)
            validate_config(cfg, f"config file {model!r} with --set {overrides}" if overrides else f"config file {model!r}")
            name = os.path.basename(os.path.dirname(os.path.abspath(model))) if model.endswith(".json") else os.path.basename(model.rstrip("/"))
            return ModelSpec(f"{name} ({getattr(cfg, 'model_type', '?')})", config=cfg)
        import difflib

        close = difflib.get_close_matches(model.lower(), sorted(PRESETS), n=3, cutoff=0.6)
        raise UnknownPresetError(
            f"model={model!r} is invalid; allowed: a preset ({', '.join(sorted(PRESETS))}), "
            f"the path of a transformers config.json, or a Hub model id such as meta-llama/Llama-3.1-8B"
            f"{f' (did you mean {close[0]}?)' if close else ''}"
        )
    if is_hf_config(model):
        cfg = copy.deepcopy(model)
        check_overrides(cfg, overrides, type(cfg).__name__)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        validate_config(cfg, type(cfg).__name__)
        return ModelSpec(type(cfg).__name__, config=cfg)
    if _is_module(model):
        raise TypeError(
            f"model={type(model).__name__} instance: pass a function that builds it instead "
            f"(e.g. lambda: {type(model).__name__}(...)), so it can be built on fake tensors"
        )
    if callable(model):
        return _resolve_callable(model, overrides)
    raise TypeError(
        f"model={model!r} is invalid; allowed: a preset name, a config.json path, a transformers "
        f"config, or a callable returning an nn.Module"
    )


def _resolve_callable(model: Callable, overrides: dict[str, Any]) -> ModelSpec:
    """A callable's spec: a model factory (a depth parameter, :func:`depth_parameter`) at the depth
    ``config_overrides`` gives it, else at its default; another callable as it is (no overrides)."""
    import inspect

    from memlab.core.validation import check_int
    from memlab.models.presets import CONFIG_LIMITS

    name = getattr(model, "__name__", type(model).__name__)
    found = depth_parameter(model)
    if found is None:
        if overrides:
            raise ValueError(f"config_overrides={overrides!r} is invalid for model={name}: config_overrides only apply to "
                             f"a preset, a config.json, a transformers config, or a model factory's depth parameter "
                             f"(a callable taking one of {', '.join(DEPTH_PARAMETERS)}), e.g. {{'depth': 32}}")
        return ModelSpec(name, fn=model)
    param, default = found
    for key in overrides:
        if key != param:
            raise ValueError(f"config_overrides key {key!r} is invalid for the model factory {name}({param}=...): "
                             f"allowed: {{{param!r}: the depth}} (its other parameters: bind them in the callable, "
                             f"e.g. functools.partial)")
    _, lo, hi = CONFIG_LIMITS["layers"]
    if param in overrides:
        depth = check_int(f"config_overrides[{param!r}]", overrides[param], minimum=lo, maximum=hi)
        source = f"config_overrides {{{param!r}: {depth}}}"
    elif default is inspect.Parameter.empty:
        raise ValueError(f"model={name} takes {param!r} without a default: the full depth is not known; allowed: "
                         f"config_overrides={{{param!r}: N}} (N decoder layers), or a default for {param!r}")
    elif isinstance(default, int) and not isinstance(default, bool):
        depth = check_int(f"{name}()'s default {param}", default, minimum=lo, maximum=hi)
        source = f"its default {param}={default}"
    else:  # a default that is not a depth (None: decided inside): the callable as it is, at full depth
        return ModelSpec(name, fn=model)
    return ModelSpec(name, factory=model, depth_param=param, depth=depth, depth_source=source)


def check_positions(spec: ModelSpec, seq_len: int, allow_longer_seq: bool) -> None:
    """Refuse a ``seq_len`` beyond the model's positions (a fake trace would not notice).

    A callable's model is not checked; ``allow_longer_seq`` allows it for position encodings that
    extend (RoPE scaling).

    Raises:
        ValueError: naming ``seq_len``, the model's position field and its size.
    """
    if not spec.is_hf:
        return
    # a preset not built yet answers from its published dimensions (no transformers import), else the config
    lazy = spec.fields() if spec._config is None else None
    cfg = None if lazy is not None else spec.config
    given = lazy if lazy is not None else vars(cfg)

    def get(name: str) -> Any:
        return lazy.get(name) if lazy is not None else getattr(cfg, name, None)

    for f in _POSITION_FIELDS:
        n = get(f)
        if isinstance(n, int) and n > 0:
            break
    else:
        return
    if seq_len <= n:
        return
    learned = ("n_positions" in given or (get("model_type") or "") in _LEARNED_POSITIONS
               or get("position_embedding_type") == "absolute")
    if learned:
        f = "n_positions" if "n_positions" in given else f
    if learned:
        raise ValueError(f"seq_len={seq_len} exceeds {spec.name}'s {f}={n}: its position table has {n} rows; "
                         f"allowed: seq_len <= {n} (or a larger {f} in config_overrides, a different model)")
    if not allow_longer_seq:
        raise ValueError(f"seq_len={seq_len} exceeds {spec.name}'s {f}={n}; allowed: seq_len <= {n}, or "
                         f"allow_longer_seq=True (CLI --allow-longer-seq) if you extend its context (e.g. RoPE scaling)")


def vocab_size(model: nn.Module) -> int:
    """The vocabulary size of a built model: its config's ``vocab_size``, else its (first) embedding's rows."""
    from torch import nn

    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError(f"cannot find the vocabulary size of {type(model).__name__}: give it a config.vocab_size or an nn.Embedding")


def enable_checkpointing(model: nn.Module, context_fn: Callable[[], tuple] | None = None) -> None:
    """Turn on the model's own checkpointing; with ``context_fn``, PyTorch's non-reentrant checkpoint
    gets it, so the recompute in backward runs under the contexts it returns (the CUDA rules of
    :mod:`memlab.estimate.cuda_rules`: without them the recompute keeps CPU's tensors and torch's checkpoint
    refuses the mismatch with a CheckpointError).

    Raises:
        ValueError: a model without ``gradient_checkpointing_enable()``.
    """
    from torch.utils.checkpoint import checkpoint

    from memlab.models import TinyGPT

    kwargs = None if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}
    if isinstance(model, TinyGPT):
        model.gradient_checkpointing_enable(None if kwargs is None else functools.partial(checkpoint, **kwargs))
        return
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(model, name, None)
        if callable(fn):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                # transformers' enable methods take the checkpoint's keyword arguments first
                fn() if kwargs is None else fn(kwargs)
            return
    raise ValueError(
        f"checkpointing=True but {type(model).__name__} has no gradient_checkpointing_enable(); "
        f"allowed: TinyGPT, transformers models, or a model with that method"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build(builder: Callable[[], nn.Module], dtype: str) -> nn.Module:
    """Build the model; for "bf16-pure" directly in bf16 (created, not converted: converting
    fake parameters in place is refused, and building in bf16 never holds an fp32 copy)."""
    import torch

    if dtype != Recipe.BF16_PURE:
        return builder()
    return build_in(builder, torch.bfloat16)


def build_in(builder: Callable[[], nn.Module], param_dtype: torch.dtype) -> nn.Module:
    """Call ``builder`` with ``param_dtype`` as torch's default dtype: the model a recipe's weights are built in."""
    import torch

    if param_dtype == torch.float32:
        return builder()
    with _default_dtype(param_dtype):
        model = builder()
    for p in model.parameters():  # anything built with an explicit fp32 dtype
        if p.is_floating_point() and p.dtype != param_dtype:
            p.data = p.data.to(param_dtype)
    return model


def largest_layer_params(model: nn.Module) -> int:
    """The most parameters any one module holds itself (DeepSpeed's ZeRO-3 estimator's largest layer)."""
    best = 0
    for m in model.modules():
        best = max(best, sum(p.numel() for p in m.parameters(recurse=False)))
    return best


class UntraceableBuilder(RuntimeError):
    """A builder function that fails on fake tensors: the message names its line and the route that works;
    ``original`` is the exception it raised."""

    original: BaseException | None = None


_WHAT_WORKS = ("build the model from its config inside the builder (AutoModelForCausalLM.from_config(config), "
               "then .to(...), peft's get_peft_model / prepare_model_for_kbit_training), or pass the config itself "
               "with adapter='lora' or 'qlora' (4-bit bitsandbytes weights: adapter='qlora')")


def untraceable(builder: Callable, exc: BaseException) -> UntraceableBuilder | None:
    """The one-line error for ``exc`` raised by ``builder`` on fake tensors, naming the builder's line that raised
    it and what works instead; None when the exception did not come from inside ``builder``'s own code."""
    import linecache

    code = getattr(builder, "__code__", None)
    tb, line = exc.__traceback__, None
    while tb is not None:
        if code is not None and tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return None
    src = linecache.getline(code.co_filename, line).strip()
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    err = UntraceableBuilder(f"{getattr(builder, '__name__', 'builder')}() cannot be traced on fake tensors: "
                             f"{os.path.basename(code.co_filename)} line {line}, `{src}`, raised "
                             f"{type(exc).__name__}{': ' + msg[:200] if msg else ''}; what works: {_WHAT_WORKS}")
    err.original = exc
    return err


def _is_module(obj: Any) -> bool:
    """An ``nn.Module`` instance (none can exist before torch is imported: it is not imported for the check)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)
