"""One training step: its description (:class:`StepSpec`), the loss it runs, and the step itself
(zero_grad, forward + loss under the recipe's autocast, backward, optimizer.step())."""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from memlab.estimate.recipes import MIXED, Recipe, canonical_dtype


@dataclass(frozen=True)
class StepSpec:
    """Everything that describes one traced training step (the estimator's ~20 settings, once).

    ``estimate_training_memory(...)`` builds one from its keywords; the trace, the extrapolation by
    depth, the ZeRO sharding and :func:`memlab.plan.estimate_stack` pass it along whole.
    ``dtype`` and ``optimizer`` are canonical (:mod:`memlab.core.vocab`); ``adapter`` is a
    :class:`memlab.estimate.adapters.AdapterSpec` or None; ``step`` a callable ``(model, batch) -> loss``,
    a ``"module:function"`` or None; ``gpu`` a card name of :mod:`memlab.core.gpus` or None.
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
    gpu: str | None = None  # the target card (memlab.core.gpus): its cuBLAS workspace
    grad_accum: int = 1  # micro-batches per optimizer step (gradients kept between them)

    def replace(self, **changes: Any) -> "StepSpec":
        """A copy with some fields changed.

        Args:
            **changes: field -> new value.

        Returns:
            The new StepSpec.
        """
        return dataclasses.replace(self, **changes)


def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except Exception:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str,
          step: Callable[[nn.Module, dict], torch.Tensor] | None) -> torch.Tensor:
    from memlab.models import lm_loss

    if step is not None:
        out = step(model, {"input_ids": x, "labels": x})
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise TypeError(f"step={getattr(step, '__name__', step)!r} returned {type(out).__name__}"
                            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}; allowed: a scalar loss tensor")
        return out
    if loss == "hf":
        return model(input_ids=x, labels=x, use_cache=False).loss
    return lm_loss(model, x, y)


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
) -> torch.Tensor:
    """One step as :func:`estimate_training_memory` runs it: zero_grad(set_to_none), forward and
    loss (under autocast for the mixed recipes), backward, optimizer.step(). With
    ``micro_batches`` > 1, forward and backward run that many times on ``x`` (each loss divided by
    the count, as a trainer accumulating gradients does) before the one optimizer step: the
    gradients of the first micro-batch stay allocated through the next ones.

    Args:
        model: the model.
        optimizer: its optimizer.
        x: the token ids, ``batch x seq_len``.
        y: the targets (for ``loss="memlab"``).
        dtype: the recipe (``"bf16"`` = ``"bf16-mixed"``).
        loss: ``"hf"``: transformers' own (``model(input_ids=x, labels=x).loss``, as the Trainer
            computes it: the logits upcast to fp32, shifted inside); ``"memlab"``:
            :func:`memlab.models.lm_loss` of ``x`` against ``y``.
        step: your ``step(model, {"input_ids": x, "labels": x}) -> loss``; overrides ``loss``.
        micro_batches: forward/backward passes before the optimizer step (gradient accumulation).

    Returns:
        The (last micro-batch's) loss, detached.

    Raises:
        ValueError: an unknown recipe; TypeError: a ``step`` that returns no scalar tensor.
    """
    dtype = canonical_dtype(dtype)
    optimizer.zero_grad(set_to_none=True)
    for _ in range(micro_batches):
        if dtype in MIXED:
            amp = torch.bfloat16 if dtype == Recipe.BF16_MIXED else torch.float16
            with torch.autocast(device_type=x.device.type, dtype=amp):
                out = _loss(model, x, y, loss, step)
        else:
            out = _loss(model, x, y, loss, step)
        (out / micro_batches if micro_batches > 1 else out).backward()
        if micro_batches > 1:
            out = out.detach()  # what a trainer keeps of a finished micro-batch: its loss value
    optimizer.step()
    return out.detach()


def load_step(spec: str) -> Callable[[nn.Module, dict], torch.Tensor]:
    """The function a ``"module:function"`` names (the current directory is importable).

    Args:
        spec: ``"module:function"``.

    Returns:
        The function, ``(model, batch) -> loss``.

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


