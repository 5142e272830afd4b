"""How a model given as a callable is estimated (:func:`callable_route`): a model factory that takes a depth is
extrapolated as it is (its modules checked per layer on the meta device, :func:`factory_layers_differ`); a
callable whose model is a transformers model built from its config takes the config route (:func:`config_route`:
the two layouts compared); anything else is traced at full depth, and the estimate's note says which
(:func:`route_note`). The extrapolation itself is :mod:`memlab.estimate.extrapolate`'s."""
from __future__ import annotations

import copy
from typing import Any, Callable

from memlab.estimate.model import ModelSpec
from memlab.estimate.recipes import EXTRAPOLATE_MIN_LAYERS, EXTRAPOLATION_DEPTHS
from memlab.estimate.result import MemoryEstimate
from memlab.estimate.step import StepSpec


def _meta_build(build: Callable[[], Any]) -> Any:
    """``build()`` on the meta device (nothing allocated, no fake mode), with the fake trace's build context
    (``.cuda()``, ``.to("cuda")``: :func:`memlab.estimate.trace.traceable_build`)."""
    import warnings

    import torch

    from memlab.estimate.trace import traceable_build

    with warnings.catch_warnings(), torch.device("meta"), traceable_build("meta"):
        warnings.simplefilter("ignore")
        return build()


def _own(m: Any) -> tuple:
    # a module's class and its own parameters' and buffers' names, shapes, dtypes (and requires_grad)
    return (f"{type(m).__module__}.{type(m).__qualname__}",
            tuple((k, tuple(p.shape), str(p.dtype), p.requires_grad) for k, p in m.named_parameters(recurse=False)),
            tuple((k, tuple(b.shape), str(b.dtype)) for k, b in m.named_buffers(recurse=False)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}" if text else type(exc).__name__


def factory_layers_differ(spec: ModelSpec) -> str:
    """Why a model factory cannot be extrapolated by depth, or "" when it can: built on the meta device at
    :data:`EXTRAPOLATION_DEPTHS` and at its full depth, its modules (each one's class, its own parameters' and
    buffers' shapes, dtypes, requires_grad) at the full depth must be those at the first depth plus one layer's
    (what the second depth adds) for every layer beyond it: layers that differ in type or shape (a different first
    layer is allowed), or a depth parameter that builds nothing per layer, are refused. What shapes cannot show
    (layers that run differently with the same parameters) is left to the traces' check at a third depth."""
    from collections import Counter

    d1, d2 = EXTRAPOLATION_DEPTHS
    n, param = spec.depth, spec.depth_param
    try:
        c1, c2, cn = (Counter(_own(m) for m in _meta_build(spec.at_depth(d).fn).modules()) for d in (d1, d2, n))
    except Exception as exc:  # noqa: BLE001 (a factory that cannot build on the meta device: traced as it is)
        return f"building it on the meta device raised {_first_line(exc)}"
    layer = c2 - c1
    if not layer or layer + c1 != c2:
        return f"{param}={d2} does not build the modules of {param}={d1} and one layer more"
    if cn != c1 + Counter({k: v * (n - d1) for k, v in layer.items()}):
        return (f"its modules at {param}={n} are not those at {param}={d1} plus {n - d1} times one layer's "
                f"(layers that differ in type or shape)")
    return ""


def _base_model(spec: ModelSpec, dtype: str) -> Any:
    # the model as ModelSpec.build makes it, before any adapter (adapters are memlab's own, the same on both routes)
    if spec.adapter is None:
        return spec.build(dtype, None)
    from memlab.estimate.adapters import base_dtype
    from memlab.estimate.model import build_in

    base = base_dtype(dtype)
    return build_in(spec.fn, base) if spec.fn is not None else spec._from_config(base, None)


def _layout(model: Any) -> tuple:
    """What a step on ``model`` depends on besides its config: every module in order (its name, :func:`_own`, its
    own plain attributes but ``training``, how many hooks of each kind it holds, a ``forward`` set on the instance),
    the parameters tied together, and the attention implementation."""
    rows = []
    for name, m in model.named_modules():
        attrs = vars(m)
        plain = tuple(sorted((k, repr(v)) for k, v in attrs.items()
                             if k != "training" and isinstance(v, (bool, int, float, str, type(None)))))
        hooks = tuple(sorted((k, len(v)) for k, v in attrs.items() if k.endswith("hooks") and isinstance(v, dict)))
        rows.append((name, _own(m), plain, hooks, "forward" in attrs))
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    tied = sorted(tuple(g) for g in groups.values() if len(g) > 1)
    return rows, tied, getattr(getattr(model, "config", None), "_attn_implementation", None)


def _layout_difference(a: Any, b: Any) -> str:
    # the first difference between two models' layouts (:func:`_layout`), in words; "" when there is none
    (ra, ta, aa), (rb, tb, ab) = _layout(a), _layout(b)
    for x, y in zip(ra, rb):
        if x != y:
            what = ("module" if x[0] != y[0] or x[1][0] != y[1][0] else "parameters or buffers" if x[1] != y[1]
                    else "attributes" if x[2] != y[2] else "hooks" if x[3] != y[3] else "an instance forward")
            return f"{what} of {x[0] or 'the model'!r} ({x[1][0].rsplit('.', 1)[-1]}) differ"
    if len(ra) != len(rb):
        return f"{len(ra)} modules against {len(rb)}"
    if ta != tb:
        return "other parameters are tied"
    if aa != ab:
        return f"attention {aa!r} against {ab!r}"
    return ""


def config_route(spec: ModelSpec, step: StepSpec) -> tuple[ModelSpec | None, str]:
    """A callable whose model is a transformers model built from its config: ``(the config's spec, "")`` when the
    callable's model, built once on the meta device, has the layout (:func:`_layout`: every module's type, its
    parameters' shapes, dtypes and requires_grad, its plain attributes and hooks, the tied parameters, the
    attention) of ``AutoModelForCausalLM.from_config(model.config)`` built the same way; else ``(None, why not)``.
    Both are built at full depth under ``step``'s recipe, as a trace builds them (adapters aside: memlab adds them
    to either alike)."""
    import sys

    try:
        model = _meta_build(lambda: _base_model(spec, step.dtype))
    except Exception as exc:  # noqa: BLE001 (a builder that cannot build on the meta device: traced as it is)
        return None, f"building it on the meta device raised {_first_line(exc)}"
    kind = type(model).__name__
    if "transformers" not in sys.modules:
        return None, f"its model ({kind}) is not a transformers model"
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None, f"its model ({kind}) is not a transformers model"
    from memlab.estimate.model import ModelSpec

    cspec = ModelSpec(spec.name, config=copy.deepcopy(model.config), adapter=spec.adapter)
    if cspec.layers() is None:
        return None, f"its {kind}'s config has no layer count"
    n = cspec.layers()[1]
    if not cspec.homogeneous():
        return None, f"its {kind}'s layers differ (the config's per-layer types)"
    if n < EXTRAPOLATE_MIN_LAYERS:
        return None, f"{n} layers, fewer than the {EXTRAPOLATE_MIN_LAYERS} extrapolation starts at (a full trace is cheap)"
    try:
        ref = _meta_build(lambda: _base_model(cspec, step.dtype))
    except Exception as exc:  # noqa: BLE001
        return None, f"AutoModelForCausalLM.from_config(model.config) raised {_first_line(exc)}"
    diff = _layout_difference(model, ref)
    if diff:
        return None, f"its {kind} is not AutoModelForCausalLM.from_config(model.config) ({diff})"
    return cspec, ""


def callable_route(spec: ModelSpec, step: StepSpec) -> tuple[ModelSpec, str]:
    """How a model given as a callable is estimated: ``(the spec to extrapolate, "")`` for a model factory
    (itself) or a transformers model built from its config (the config's spec, :func:`config_route`); else
    ``(spec, why its every layer is traced)``."""
    if spec.factory is not None:
        return spec, ""
    from memlab.estimate.model import DEPTH_PARAMETERS, depth_parameter

    cspec, why = config_route(spec, step)
    if cspec is not None:
        return cspec, ""
    found = depth_parameter(spec.fn)
    if found is not None:  # a default that is no depth (None): the factory's depth is not known
        return spec, (f"its {found[0]}={found[1]!r} is not a depth; config_overrides={{{found[0]!r}: N}} makes it a "
                      f"model factory, extrapolated")
    return spec, (f"it takes no depth parameter ({', '.join(DEPTH_PARAMETERS)}) and {why}; a model factory "
                  f"(e.g. def build(depth=32)) is extrapolated")


def route_note(spec: ModelSpec, route: ModelSpec, est: MemoryEstimate | None, why: str) -> str:
    # the estimate's note on how a callable's model was estimated
    name = f"{spec.name}()"
    if est is None or not est.extrapolated_from:
        return f"model {name}: every layer traced (the callable at full depth): {why}"
    d1, d2 = est.extrapolated_from
    depths = f"{d1}, {d2} and {2 * d2 - d1}"
    if route.factory is not None:
        p, n = route.depth_param, route.depth
        return (f"model factory {spec.name}({p}=...): traced at {p}={depths}, the per-layer difference the same "
                f"between them (checked), and extrapolated to {p}={n} ({route.depth_source}); its modules at {p}={n} "
                f"(built on the meta device) are those at {p}={EXTRAPOLATION_DEPTHS[0]} plus one layer's for each "
                f"layer more (checked)")
    f, n = route.layers()
    return (f"model {name}: a transformers {type(route.config).__name__} model whose layout (module types, parameter "
            f"shapes and dtypes, attributes, tied weights, attention; built once on the meta device) is "
            f"AutoModelForCausalLM.from_config(model.config)'s: estimated by the config route, traced at {depths} "
            f"layers and extrapolated to {f}={n}")
