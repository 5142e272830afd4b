"""LoRA and QLoRA for the estimator and the planner: one description of the adapters, one builder.

``memlab estimate --adapter lora``, ``estimate_training_memory(..., adapter="qlora")`` and
:func:`memlab.plan.plan`'s LoRA/QLoRA stacks all build their fake model here
(:func:`apply_adapter` on the base model that :func:`base_dtype` says how to build), so one
configuration gives one answer by every route (``tests/ch01/test_estimate_adapters.py``).

What is built, and why (the usual Hugging Face + peft recipe):

* the frozen base in 16 bits for a 16-bit recipe (``"bf16-mixed"``, ``"bf16-pure"``: bf16;
  ``"fp16-mixed"``: fp16; :mod:`memlab.core.vocab`, ``"bf16"`` = ``"bf16-mixed"``), as
  ``from_pretrained(..., torch_dtype=torch.bfloat16)`` loads it; fp32 for ``"fp32"``. So
  "bf16-mixed" with an adapter is a bf16 base with the forward pass under
  ``autocast(bfloat16)`` and the adapters in ``adapter_dtype`` (no fp32 master copy of the frozen
  weights exists: they have no optimizer);
* QLoRA: every ``nn.Linear`` but ``lm_head`` stored in NF4 (:class:`memlab.quant.Linear4bit`,
  blocksize 64, double quantization, compute in the base's 16-bit dtype), as transformers'
  ``BitsAndBytesConfig(load_in_4bit=True)`` does; embeddings, norms and the head stay 16-bit;
* a rank-``r`` :class:`memlab.quant.lora.LoRALinear` on each target (``target_modules``: leaf names such as
  ``q_proj,v_proj``, or ``"all-linear"``: every linear layer but the output head, as peft's
  ``target_modules="all-linear"``), scaled by ``lora_alpha / r`` (default alpha = 2r), with
  ``lora_dropout`` on the adapter's input (a real dropout mask, counted);
* the adapters in ``adapter_dtype``: "fp32" by default (peft upcasts adapter weights to fp32,
  ``autocast_adapter_dtype=True``), "bf16" by default for ``dtype="bf16-pure"``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from memlab.core import vocab
from memlab.core.validation import check_positive_int, invalid

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = ["ADAPTERS", "ADAPTER_DTYPES", "AdapterSpec", "adapter_spec", "base_dtype", "apply_adapter",
           "warm_quant", "linear_targets"]

ADAPTERS = ("lora", "qlora")
#: the adapters' dtypes by name (``ADAPTER_DTYPES``, name -> torch dtype, is made when first asked for: a step's
#: settings are checked, and an estimate read from the trace cache, without importing torch)
ADAPTER_DTYPE_NAMES = ("fp32", "bf16", "fp16")
ALL_LINEAR = "all-linear"


def _adapter_dtypes() -> dict[str, torch.dtype]:
    if "ADAPTER_DTYPES" not in globals():
        import torch

        globals()["ADAPTER_DTYPES"] = dict(zip(ADAPTER_DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
    return globals()["ADAPTER_DTYPES"]


def __getattr__(name: str) -> Any:  # PEP 562: ADAPTER_DTYPES made (torch imported) when first asked for
    if name == "ADAPTER_DTYPES":
        return _adapter_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class AdapterSpec:
    """LoRA (``kind="lora"``) or QLoRA (``kind="qlora"``) adapters, fully specified."""

    kind: str
    r: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    dropout: float = 0.0
    dtype: str = "fp32"

    def describe(self) -> str:
        """One line naming the adapters (what the estimate's ``adapter`` field shows)."""
        t = self.target_modules if isinstance(self.target_modules, str) else ",".join(self.target_modules)
        base = "NF4 base (every linear but lm_head), " if self.kind == "qlora" else ""
        return (f"{self.kind}: {base}rank {self.r}, alpha {self.alpha:g}, on {t}, dropout {self.dropout:g}, "
                f"{self.dtype} adapters")

    def cli_args(self) -> list[str]:
        """The ``memlab estimate`` flags that give this spec, one list item per word."""
        t = self.target_modules if isinstance(self.target_modules, str) else ",".join(self.target_modules)
        out = ["--adapter", self.kind, "--lora-r", str(self.r), "--lora-alpha", f"{self.alpha:g}",
               "--target-modules", t]
        if self.dropout:
            out += ["--lora-dropout", f"{self.dropout:g}"]
        out += ["--adapter-dtype", self.dtype]
        return out


def adapter_spec(adapter: str | AdapterSpec | None, *, recipe: str = "bf16-mixed", lora_r: int = 16,
                 lora_alpha: float | None = None, target_modules: Any = None, lora_dropout: float = 0.0,
                 adapter_dtype: str | None = None) -> AdapterSpec | None:
    """A checked :class:`AdapterSpec` from the keywords of ``estimate_training_memory``.

    Args:
        adapter: "lora", "qlora", None / "none" (no adapter), or an AdapterSpec (returned as is).
        recipe: the training recipe (sets the default ``adapter_dtype``: bf16 under "bf16-pure").
        lora_r: the rank.
        lora_alpha: the scale numerator (default 2 x r).
        target_modules: "all-linear" (default) or names such as "q_proj,v_proj".
        lora_dropout: dropout on the adapters' input, in [0, 1).
        adapter_dtype: "fp32", "bf16" or "fp16".

    Returns:
        The spec, or None without an adapter.

    Raises:
        ValueError: a bad value, named; adapter keywords given without ``adapter`` (they would be ignored).
    """
    if isinstance(adapter, AdapterSpec):
        return adapter
    if adapter is None or adapter == "none":
        given = {k: v for k, v in (("lora_alpha", lora_alpha), ("target_modules", target_modules),
                                   ("adapter_dtype", adapter_dtype)) if v is not None}
        if lora_r != 16:
            given["lora_r"] = lora_r
        if lora_dropout:
            given["lora_dropout"] = lora_dropout
        if given:
            k, v = next(iter(given.items()))
            raise ValueError(f"{k}={v!r} given without an adapter; allowed: adapter='lora' or 'qlora' with it "
                             f"(CLI --adapter lora|qlora)")
        return None
    if adapter not in ADAPTERS:
        raise invalid("adapter", adapter, "None, 'lora', 'qlora'")
    check_positive_int("lora_r", lora_r)
    alpha = 2 * lora_r if lora_alpha is None else lora_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not _finite(alpha) or not alpha > 0:
        raise invalid("lora_alpha", lora_alpha, "a number > 0 (default 2 x lora_r)")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise invalid("lora_dropout", lora_dropout, "a number in [0, 1)")
    if target_modules is None or target_modules == ALL_LINEAR:
        targets: tuple[str, ...] | str = ALL_LINEAR
    else:
        items = target_modules.split(",") if isinstance(target_modules, str) else target_modules
        try:
            targets = tuple(str(t).strip() for t in items)
        except TypeError:
            raise invalid("target_modules", target_modules, "'all-linear' or module names such as 'q_proj,v_proj'") from None
        if not targets or any(not t or not isinstance(t, str) for t in targets):
            raise invalid("target_modules", target_modules, "'all-linear' or module names such as 'q_proj,v_proj'")
    if adapter_dtype is None:
        adapter_dtype = "bf16" if vocab.recipe(recipe) == vocab.Recipe.BF16_PURE else "fp32"
    if adapter_dtype not in ADAPTER_DTYPE_NAMES:
        raise invalid("adapter_dtype", adapter_dtype, ", ".join(map(repr, ADAPTER_DTYPE_NAMES)))
    return AdapterSpec(adapter, lora_r, float(alpha), targets, float(lora_dropout), adapter_dtype)


def _finite(x: float) -> bool:
    """A finite number, an int beyond a float's range (10**400) included as not finite (no OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def base_dtype(recipe: str) -> torch.dtype:
    """The frozen base's dtype under a training recipe, any spelling (see the module docstring): fp32 for
    "fp32", fp16 for "fp16-mixed", else bf16."""
    import torch

    r = vocab.recipe(recipe)
    return {vocab.Recipe.FP16_MIXED: torch.float16, vocab.Recipe.FP32: torch.float32}.get(r, torch.bfloat16)


def linear_targets(model: nn.Module) -> list[str]:
    """The sorted leaf names of every linear layer but the output head (peft's ``"all-linear"``)."""
    from torch import nn

    from memlab.quant import Linear4bit

    head = _head_names(model)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, (nn.Linear, Linear4bit)) and n and n not in head})


def _head_names(model: nn.Module) -> set[str]:
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    names = {n for n, m in model.named_modules() if out is not None and m is out}
    return names | {n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] == "lm_head"}


def apply_adapter(model: nn.Module, spec: AdapterSpec, recipe: str) -> nn.Module:
    """In place: freeze ``model`` (built in :func:`base_dtype`), quantize it for QLoRA, wrap the targets
    in LoRALinear adapters of ``spec``.

    ``recipe`` sets QLoRA's compute dtype (the base's 16-bit dtype). Returns ``model``.

    Raises:
        ValueError: no target found, naming the linear layers there are.
    """
    import torch
    from torch import nn

    from memlab.quant.lora import LoRALinear
    from memlab.quant import Linear4bit

    for p in model.parameters():
        p.requires_grad_(False)
    head = _head_names(model)
    targets = set(linear_targets(model)) if spec.target_modules == ALL_LINEAR else set(spec.target_modules)
    if spec.kind == "qlora":
        compute = base_dtype(recipe) if vocab.recipe(recipe) != vocab.Recipe.FP32 else torch.bfloat16
        for name, m in list(model.named_modules()):
            if isinstance(m, nn.Linear) and name not in head:
                _replace(model, name, Linear4bit.from_linear(m, compute, 64, True))
    found = []
    for name, m in list(model.named_modules()):
        if name and name.rsplit(".", 1)[-1] in targets and isinstance(m, (nn.Linear, Linear4bit)):
            found.append(name)
            _replace(model, name, LoRALinear(m, r=spec.r, alpha=spec.alpha, dropout=spec.dropout,
                                             dtype=_adapter_dtypes()[spec.dtype]))
    if not found:
        raise ValueError(f"target_modules={','.join(sorted(targets))!r} matches no linear layer of "
                         f"{type(model).__name__}; allowed: 'all-linear' or some of {', '.join(linear_targets(model))}")
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    setattr(parent, name.rsplit(".", 1)[-1], new)


_QUANT_WARM = False


def warm_quant() -> None:
    """Build memlab.quant's cached codebooks once, for real, outside any trace.

    Built inside the first traced step they would count in that trace only, enough to bend a
    depth extrapolation.
    """
    global _QUANT_WARM
    if not _QUANT_WARM:
        import torch
        from torch import nn

        from memlab.quant import Linear4bit

        with torch.no_grad():
            Linear4bit.from_linear(nn.Linear(64, 64))(torch.zeros(1, 64))
        _QUANT_WARM = True


def adapted_builder(build_base: Callable[[torch.dtype], nn.Module], spec: AdapterSpec | None,
                    recipe: str) -> Callable[[], nn.Module]:
    """A no-argument builder of the adapted model: ``build_base(base_dtype(recipe))``, then
    :func:`apply_adapter` of ``spec`` (None: the base alone)."""

    def build() -> nn.Module:
        model = build_base(base_dtype(recipe))
        return model if spec is None else apply_adapter(model, spec, recipe)

    return build
