"""Where the memory of a training step goes: bytes per parameter and bytes of activations.

Model states follow Rajbhandari et al. 2020 ("ZeRO", section 3.1): Adam keeps, per parameter,
the weight, its gradient and two moments: 16 bytes in fp32, and 2 + 2 + 12 with mixed precision
(16-bit weights and gradients, fp32 master copy and moments). Activations follow Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1): one
layer saves s*b*h*(34 + 5*a*s/h) bytes (16-bit activations, 1-byte dropout masks), written per
element as s*b*h*(16*e + 2*m) + a*s^2*b*(2*e + m) so the element sizes are parameters (PyTorch's
CPU dropout keeps its mask in the activation dtype: m = e there). The byte counters measure the
same with ``torch.autograd.graph.saved_tensors_hooks``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

# format_bytes lives in memlab.core.units (no torch there); ``memlab.accounting.format_bytes`` stays importable
from memlab.core.units import GB, format_bytes
from memlab.core.validation import check_choice, check_int, check_positive_int, invalid

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "float64": torch.float64,
    "int8": torch.int8, "uint8": torch.uint8,
}


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a ``torch.dtype`` or a name such as "fp32", "bf16", "int8" (one of
    ``_DTYPE_NAMES``, case-insensitive, "torch." allowed).

    Raises:
        ValueError: for an unknown name or a value that is neither.
    """
    allowed = "a torch.dtype or one of " + ", ".join(sorted(_DTYPE_NAMES))
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        if key not in _DTYPE_NAMES:
            raise invalid("dtype", dtype, allowed)
        dtype = _DTYPE_NAMES[key]
    if not isinstance(dtype, torch.dtype):
        raise invalid("dtype", dtype, allowed)
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each model state for one training recipe (an entry of :data:`RECIPES`).

    Not :class:`memlab.core.vocab.Recipe` (the enum of precision recipes): this one pairs a
    precision with an optimizer and holds its bytes; :data:`RECIPES` says how the names map.
    """

    weights: float
    gradients: float
    optimizer: float
    source: str

    @property
    def total(self) -> float:
        """Bytes per parameter of all three states together."""
        return self.weights + self.gradients + self.optimizer


#: Bytes per parameter by ``"<precision>-<optimizer>"``. The precision part maps onto
#: :class:`memlab.core.vocab.Recipe`: ``fp32-*`` is ``Recipe.FP32``; ``mixed-*`` is mixed precision
#: with an fp32 master copy, ``Recipe.BF16_MIXED`` or ``Recipe.FP16_MIXED`` alike (both keep 16-bit
#: weights and gradients here, as the ZeRO paper counts them). The optimizer part is
#: :class:`memlab.core.vocab.Optimizer`'s ``adamw``, ``sgd`` or ``adamw8bit``
#: (``sgd-momentum`` has no enum member: the estimator's SGD keeps no momentum).
RECIPES: dict[str, Recipe] = {
    # fp32 weights and gradients; AdamW's exp_avg and exp_avg_sq in fp32.
    "fp32-adamw": Recipe(4, 4, 8, "4 + 4 + 2*4: every state in fp32"),
    # plain SGD keeps no state; with momentum it keeps one buffer per parameter.
    "fp32-sgd": Recipe(4, 4, 0, "SGD without momentum keeps no optimizer state"),
    "fp32-sgd-momentum": Recipe(4, 4, 4, "one fp32 momentum buffer"),
    # ZeRO (Rajbhandari et al. 2020, sec. 3.1): 2 + 2 + K with K = 12 (fp32 master, m, v).
    "mixed-adamw": Recipe(2, 2, 12, "ZeRO paper: 16-bit weights and grads, fp32 master + m + v"),
    # Hugging Face Transformers docs, "Model training anatomy": fp32 + 16-bit weights (6),
    # fp32 gradients (4), AdamW (8): 18 bytes.
    "mixed-adamw-fp32-grads": Recipe(6, 4, 8, "HF model-memory anatomy: 6 + 4 + 8"),
    # bitsandbytes 8-bit AdamW (Dettmers et al. 2022): two 1-byte states (+ small absmax) on
    # top of a mixed-precision setup with an fp32 master copy.
    "mixed-adamw8bit": Recipe(2, 2, 4 + 2, "16-bit weights/grads, fp32 master, two 8-bit states"),
}


def model_state_bytes(n_params: int, recipe: str = "fp32-adamw") -> dict[str, int]:
    """Bytes (ints) of weights, gradients and optimizer state for ``n_params`` parameters (an int
    >= 0) under ``recipe`` (a key of :data:`RECIPES`): keys "weights", "gradients", "optimizer",
    "total".

    Raises:
        ValueError: naming the argument, for a bad ``n_params`` or an unknown ``recipe``.
    """
    check_int("n_params", n_params, minimum=0)
    check_choice("recipe", recipe, RECIPES)
    r = RECIPES[recipe]
    out = {"weights": int(r.weights * n_params), "gradients": int(r.gradients * n_params), "optimizer": int(r.optimizer * n_params)}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(
    seq_len: int,
    batch_size: int,
    hidden: int,
    n_heads: int,
    *,
    act_bytes: int = 2,
    mask_bytes: int = 1,
    layernorm_stats_bytes: int = 0,
    recompute: str = "none",
) -> int:
    """Activation bytes one GPT-style transformer layer saves for backward.

    ``act_bytes`` (e) per activation element, ``mask_bytes`` (m) per dropout-mask element:
    s*b*h*(16e + 2m) + a*s^2*b*(2e + m). With e=2, m=1 this is Korthikanti et al.'s
    s*b*h*(34 + 5*a*s/h). ``mask_bytes=0`` is no dropout: no masks, and the attention
    probabilities are the softmax output itself, saved once, so the s^2 term is a*s^2*b*e.
    ``layernorm_stats_bytes`` adds the mean and 1/std that each of the two LayerNorms saves
    (2 norms * 2 stats * s*b elements; pass 4 for fp32 statistics).

    Args:
        seq_len, batch_size, hidden, n_heads: s, b, h, a; ints >= 1.
        act_bytes: e: 1, 2, 4 or 8.
        mask_bytes: m: 0 (no dropout), 1, 2, 4 or 8.
        layernorm_stats_bytes: bytes per LayerNorm statistic (0 leaves them out, as the paper does).
        recompute: "none"; "selective" (the attention core is recomputed, so the a*s^2*b terms
            vanish: 34*s*b*h in the paper's case); "full" (only each layer's input, e*s*b*h, is kept).

    Raises:
        ValueError: naming the argument, its value and what is allowed.
    """
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden), ("n_heads", n_heads)):
        check_positive_int(name, v)
    # bool is an int: True would pass as 1 byte, so the choice is checked on exact ints
    if isinstance(act_bytes, bool) or act_bytes not in (1, 2, 4, 8):
        raise invalid("act_bytes", act_bytes, "1, 2, 4, 8")
    if isinstance(mask_bytes, bool) or mask_bytes not in (0, 1, 2, 4, 8):
        raise invalid("mask_bytes", mask_bytes, "0 (no dropout), 1, 2, 4, 8")
    check_choice("recompute", recompute, ("none", "selective", "full"))
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    if recompute == "full":
        return s * b * h * e
    linear_terms = s * b * h * (16 * e + 2 * m) + 2 * 2 * s * b * layernorm_stats_bytes
    if recompute == "selective":
        return linear_terms
    return linear_terms + a * s * s * b * ((2 * e + m) if m else e)


def korthikanti_bytes_per_layer(seq_len: int, batch_size: int, hidden: int, n_heads: int) -> int:
    """The paper's formula as printed: one layer saves s*b*h*(34 + 5*a*s/h) bytes (16-bit,
    1-byte masks); s, b, h, a are ints >= 1.

    Raises:
        ValueError: naming the argument, for one that is not a positive int.
    """
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden), ("n_heads", n_heads)):
        check_positive_int(name, v)
    s, b, h, a = seq_len, batch_size, hidden, n_heads
    return 34 * s * b * h + 5 * a * s * s * b


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    st = t.untyped_storage()
    return (t.device.type, t.device.index, st.data_ptr(), st.nbytes())


def saved_storages(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] | None = None, **kwargs: Any) -> dict[tuple[Any, ...], int]:
    """The storages one call ``fn(*args, **kwargs)`` saves for backward: {storage key: bytes}.

    Measured with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves goes
    through the pack hook. Tensors that share a storage (views) appear once: storages are told
    apart by identity, not by address (a storage saved and freed within the call counts, and
    one that later gets its address is another storage; the storages are held until the call
    returns). Parameters and buffers are not activations: when ``fn`` is an ``nn.Module`` its own
    are excluded; ``exclude`` leaves out others (e.g. a model's parameters when ``fn`` is a lambda).

    Returns:
        ``{(device type, device index, storage id): bytes}``, one entry per saved storage.

    Raises:
        ValueError: when ``fn`` is not callable.
    """
    if not callable(fn):
        raise invalid("fn", fn, "a callable (a module or a function)")
    extra = list(exclude) if exclude is not None else []
    if isinstance(fn, nn.Module):
        extra += list(fn.parameters()) + list(fn.buffers())
    skip = {id(t.untyped_storage()) for t in extra}
    kept: dict[int, Any] = {}  # id -> the storage itself: held, so no saved storage dies and lends
    #                            its address (or its id) to another one while we count

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()  # one Python object per storage, shared by all its views
        if id(st) not in skip:
            kept[id(st)] = st
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return {(st.device.type, st.device.index, i): st.nbytes() for i, st in kept.items()}


def saved_activation_bytes(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] | None = None, **kwargs: Any) -> int:
    """Bytes that one call ``fn(*args, **kwargs)`` saves for backward, each storage counted once
    (see :func:`saved_storages`; 0 under ``torch.no_grad``)."""
    return sum(saved_storages(fn, *args, exclude=exclude, **kwargs).values())


def unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped): views and tied tensors
    counted once, a view counting its whole storage."""
    seen: dict[tuple[Any, ...], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, step counters ...; the state exists
    after the first step), storages once.

    Raises:
        ValueError: when ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise invalid("optimizer", optimizer, "a torch.optim.Optimizer")
    return unique_bytes(v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of the live model states: keys "parameters" (the model's buffers included),
    "gradients", "optimizer" (0 without an optimizer), "total". Each storage counted once (tied
    weights, views)."""
    params = list(model.parameters()) + list(model.buffers())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    opt = optimizer_state_bytes(optimizer) if optimizer is not None else 0
    out = {"parameters": unique_bytes(params), "gradients": unique_bytes(grads), "optimizer": opt}
    out["total"] = sum(out.values())
    return out


def plot_breakdown(
    bars: Mapping[str, Mapping[str, float]],
    *,
    title: str = "training memory by category",
    unit: float = GB,
    unit_name: str = "GB",
    budget: float | None = None,
    ax: Any = None,
) -> Any:
    """Stacked horizontal bars, one bar per setup, one colour per category; returns the Axes.

    Args:
        bars: ``{label: {category: bytes}}``; a "total" category is not drawn.
        unit: bytes per unit on the x axis (memlab.core.units.GB by default), named ``unit_name``.
        budget: a GPU's memory in bytes, drawn as a dashed line, or None.
        ax: the matplotlib Axes to draw on, or None for a new figure.

    Raises:
        ValueError: when ``bars`` is empty.
    """
    import matplotlib.pyplot as plt

    if not bars:
        raise invalid("bars", bars, "a non-empty {label: {category: bytes}}")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(bars)))
    cats: list[str] = []
    for parts in bars.values():
        cats += [c for c in parts if c not in cats and c != "total"]
    colors = dict(zip(cats, plt.cm.tab10.colors))
    labels = list(bars)
    for i, label in enumerate(labels):
        left = 0.0
        for c in cats:
            v = bars[label].get(c, 0) / unit
            ax.barh(i, v, left=left, color=colors[c], label=c if i == 0 else None, edgecolor="white")
            left += v
        ax.text(left, i, f" {left:,.1f} {unit_name}", va="center", fontsize=9)
    if budget is not None:
        ax.axvline(budget / unit, color="black", linestyle="--", linewidth=1)
        ax.text(budget / unit, len(labels) - 0.4, f" GPU {budget / unit:,.0f} {unit_name}", fontsize=9)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(unit_name)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return ax


def tinygpt_step_peak(config: Any, batch_size: int, seq_len: int) -> int:
    """Predicted peak bytes of one fp32 AdamW training step of ``TinyGPT(config)`` on a CPU.

    The step after the first (Adam's state exists), with ``zero_grad(set_to_none=True)`` before the
    forward, the for-loop AdamW (PyTorch's CPU default) and dropout on (``config.dropout > 0``: a
    4-byte noise tensor per dropout on a CPU). Two candidates, the larger wins:

    * backward: weights + Adam's two moments (12 bytes/param, plus buffers and a 4-byte ``step``
      per tensor) + every saved activation (the per-layer formula plus the embedding, final
      LayerNorm, LM head and loss terms) + the gradient of the logits and of one attention-score
      matrix, alive together at the top of backward;
    * optimizer step: all states with gradients (16 bytes/param) + the for-loop's two temporaries
      the size of the largest parameter.

    ``config`` is a :class:`memlab.models.TinyGPTConfig` with ``dropout > 0``.

    Raises:
        ValueError: naming the argument, for a bad size or a config without dropout.
    """
    # measured: within 2% of MemoryTracker's peak on the configurations lab 00 checks
    from memlab.models import TinyGPT

    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    if not getattr(config, "dropout", 0) > 0:
        raise invalid("config.dropout", getattr(config, "dropout", None), "a dropout > 0 (this model assumes dropout on)")
    with torch.device("meta"):
        model = TinyGPT(config)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())
    largest = max(p.numel() for p in params) * 4
    e = m = 4
    s, b, h, a, V = seq_len, batch_size, config.n_embd, config.n_head, config.vocab_size
    acts = config.n_layer * activation_bytes_per_layer(s, b, h, a, act_bytes=e, mask_bytes=m, layernorm_stats_bytes=4)
    acts += (b * s * 8 + s * 8          # token ids and positions (embedding backward)
             + b * s * h * m            # dropout after the embeddings
             + b * s * h * e + 2 * b * s * 4  # final LayerNorm input, mean and 1/std
             + b * s * h * e            # LM head input
             + b * s * V * e            # log-softmax output
             + b * s * 8 + 4)           # targets, loss normaliser
    states = 12 * n_params + buffers + 4 * len(params)
    backward = states + acts + b * s * V * 4 + a * s * s * b * 4
    optimizer = states + 4 * n_params + 2 * largest
    return int(max(backward, optimizer))


__all__ = [
    "dtype_bytes",
    "Recipe",
    "RECIPES",
    "model_state_bytes",
    "activation_bytes_per_layer",
    "korthikanti_bytes_per_layer",
    "tinygpt_step_peak",
    "saved_storages",
    "saved_activation_bytes",
    "optimizer_state_bytes",
    "state_bytes",
    "unique_bytes",
    "format_bytes",
    "plot_breakdown",
]
