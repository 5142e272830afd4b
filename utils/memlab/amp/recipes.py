"""The bytes of one AdamW update per recipe: predicted from the tensors that exist, then measured.

"fp16" and "bf16" here are the course's fp16-mixed / bf16-mixed (:mod:`memlab.core.vocab`): a
16-bit model with fp32 master weights (:class:`memlab.amp.MasterWeights`; Micikevicius et al.
2018, sec. 3.1). It is activations that halve in mixed precision, not model states.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from memlab.accounting import unique_bytes
from memlab.amp.master import MasterWeights
from memlab.core import vocab
from memlab.core.validation import invalid

__all__ = ["UPDATE_RECIPES", "update_recipe_dtype", "update_peak_bytes", "measure_update_peak"]

#: the recipes chapter 03 compares, by the short names its lab passes: the model's dtype in each
#: (None: fp32 training, no master copy); "fp16"/"bf16" are fp16-mixed/bf16-mixed
UPDATE_RECIPES: dict[str, torch.dtype | None] = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE = {vocab.Recipe.FP32: None, vocab.Recipe.FP16_MIXED: torch.float16, vocab.Recipe.BF16_MIXED: torch.bfloat16}
_ALLOWED = "'fp32', 'fp16' or 'fp16-mixed', 'bf16' or 'bf16-mixed' (a memlab.core.vocab.Recipe)"


def update_recipe_dtype(recipe: Any) -> torch.dtype | None:
    """The model's dtype in an update recipe: torch.float16 or torch.bfloat16 for the mixed recipes,
    None for fp32.

    Args:
        recipe: a key of :data:`UPDATE_RECIPES`, its canonical spelling ("fp16-mixed",
            "bf16-mixed") or a :class:`memlab.core.vocab.Recipe` (not bf16-pure: no master copy).

    Raises:
        ValueError: an unknown or unsupported recipe.
    """
    try:
        parsed = vocab.recipe(recipe)
    except ValueError:
        parsed = None
    if parsed not in _DTYPE:
        raise invalid("recipe", recipe, _ALLOWED)
    return _DTYPE[parsed]


def _check_update_args(model: Any, recipe: Any) -> torch.dtype | None:
    if not isinstance(model, nn.Module):
        raise invalid("model", model, "an nn.Module")
    dtype = update_recipe_dtype(recipe)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen or not list(model.parameters()):
        shown = f"{frozen[:3]}{' ...' if len(frozen) > 3 else ''}"
        raise invalid("model", model, f"a model with a parameter, every parameter training (requires_grad=True); "
                                      f"frozen here: {shown}")
    return dtype


def update_peak_bytes(model: nn.Module, recipe: str) -> int:
    """Predicted peak bytes of one AdamW update (the second; Adam's state exists) of ``model``.

    The update :func:`measure_update_peak` measures: gradients as backward leaves them, then
    ``torch.optim.AdamW(..., foreach=False)`` (the for-loop, PyTorch's CPU default).

    * ``"fp32"``: an fp32 model and its optimizer: 4 (weights) + 4 (grads) + 8 (Adam's m, v) =
      16 bytes per parameter;
    * ``"fp16"`` / ``"bf16"`` (mixed): :class:`MasterWeights` (``free_model_grads=True``): the
      16-bit grads are copied into fp32 grads of the fp32 masters (each 16-bit grad freed once
      copied), then the optimizer steps the masters: 2 (16-bit weights) + 4 (fp32 masters) + 4
      (their grads) + 8 (m, v) = 18 bytes per parameter, more than fp32 training.

    Both add a 4-byte ``step`` tensor per parameter tensor, the model's buffers (floating-point
    ones cast to 16 bits with the model in the 16-bit recipes), and the for-loop AdamW's two fp32
    temporaries (``exp_avg_sq.sqrt()`` and its quotient) the size of the largest parameter. Each
    parameter counted once (``model.parameters()`` skips tied duplicates).

    ``recipe`` as :func:`update_recipe_dtype` takes it.

    Raises:
        ValueError: ``model`` is not a module, has a frozen parameter or none; an unknown recipe.
    """
    dtype = _check_update_args(model, recipe)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)
    if dtype is None:
        buffers = unique_bytes(model.buffers())
    else:  # MasterWeights casts the model, floating-point buffers too, to 16 bits
        seen = {id(b.untyped_storage()): b for b in model.buffers()}
        buffers = sum(b.numel() * (2 if b.is_floating_point() else b.element_size()) for b in seen.values())
    per_param = 16 if dtype is None else 18
    return per_param * n + 2 * 4 * largest + 4 * len(params) + buffers


def _random_grads(params: list[torch.Tensor], gen: torch.Generator) -> None:
    for p in params:  # in each parameter's dtype, as backward leaves them
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device=p.device, dtype=p.dtype)


def measure_update_peak(model: nn.Module, recipe: str, *, seed: int = 0) -> int:
    """Measured peak bytes of one AdamW update of ``model`` (modified: cast and stepped).

    ``"fp32"``: ``AdamW(model.parameters(), lr=1e-3, foreach=False)``; the mixed recipes:
    ``MasterWeights(model, that optimizer, dtype)``. Random gradients drive a first update, so
    Adam's state exists; after ``zero_grad(set_to_none=True)`` and fresh gradients, the second
    update runs inside a :class:`memlab.profiler.MemoryTracker` over the model and the optimizer.

    ``seed`` seeds the random gradients; returns the tracker's peak in bytes.

    Raises:
        ValueError: as :func:`update_peak_bytes`.
    """
    from memlab.profiler import MemoryTracker  # the profiler imports much more than this module needs

    dtype = _check_update_args(model, recipe)

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)

    if dtype is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make(params)
        update: Callable[[], Any] = optimizer.step

        def zero() -> None:
            optimizer.zero_grad(set_to_none=True)
    else:
        mw = MasterWeights(model, make, dtype)
        params, optimizer, update, zero = mw.model_params, mw.optimizer, mw.step, mw.zero_grad
    gen = torch.Generator().manual_seed(seed)
    zero()
    _random_grads(params, gen)
    update()  # the first update creates Adam's state
    zero()
    _random_grads(params, gen)
    with MemoryTracker(model, optimizer) as tracker:
        update()
    return tracker.peak_bytes
