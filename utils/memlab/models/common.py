"""Helpers that work on any of the course's models: TinyGPT, a ``transformers`` decoder, a peft wrapper.

Counting unique parameters, finding the stack of decoder layers, and the next-token loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from memlab.models.tinygpt import TinyGPT

__all__ = ["count_parameters", "NoDecoderLayersError", "decoder_layers", "lm_loss"]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements in ``model``, counting shared (tied) tensors once.

    Sharing is detected by identity (the same ``Parameter`` object) and, for tensors with
    real storage, by storage (different ``Parameter`` objects viewing the same memory).
    Works on the meta device and on fake tensors. ``trainable_only`` counts only
    ``requires_grad`` parameters.
    """
    seen_ids: set[int] = set()
    seen_storage: set[tuple] = set()
    total = 0
    for param in model.parameters(recurse=True):
        if id(param) in seen_ids:
            continue
        seen_ids.add(id(param))
        if trainable_only and not param.requires_grad:
            continue
        if param.device.type != "meta" and param.numel() > 0:
            if not _is_fake(param):  # fake tensors have no memory: identity only
                ptr = param.untyped_storage().data_ptr()
                key = (param.device.type, ptr, param.storage_offset(), tuple(param.shape), tuple(param.stride()), param.dtype)
                if key in seen_storage:
                    continue
                seen_storage.add(key)
        total += param.numel()
    return total


_LAYER_PATHS = ("blocks", "model.layers", "transformer.h", "base_model.model.model.layers", "gpt_neox.layers",
                "layers", "h")


class NoDecoderLayersError(ValueError):
    """Raised by :func:`decoder_layers` for a model without a stack of decoder layers."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's stack of transformer blocks: what checkpointing wraps and FSDP2 shards unit by unit.

    Looked for at TinyGPT ``.blocks``, Llama/Mistral/Qwen ``.model.layers``, GPT-2 ``.transformer.h``,
    a peft-wrapped Llama, GPT-NeoX; else the longest ``nn.ModuleList`` in the model. Returns the
    blocks in order.

    Raises:
        NoDecoderLayersError: when the model has no non-empty ModuleList at all.
    """
    for path in _LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, (nn.ModuleList, nn.Sequential)) and len(obj):
            return list(obj)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if lists:
        return list(max(lists, key=len))
    raise NoDecoderLayersError(f"model={type(model).__name__} has no stack of decoder layers (looked at "
                     f"{', '.join(_LAYER_PATHS)} and for any nn.ModuleList); allowed: a transformers decoder "
                     f"(Llama, GPT-2, ...) or memlab.models.TinyGPT")


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``model`` on inputs ``x`` and targets ``y``.

    ``y[b, t]`` is the token after ``x[b, t]`` (the convention of :func:`memlab.models.corpus.batches`
    and :class:`TinyGPT`), for every position -- so no extra shifting is done for
    ``transformers`` models, which are called as ``model(input_ids=x)``.

    Args:
        model: a TinyGPT, a ``transformers`` causal LM (or a peft wrapper), or any module returning logits.
        x, y: input and target token ids, ``(B, T)`` long.
    """
    if isinstance(model, TinyGPT):
        _, loss = model(x, y)
        return loss
    if hasattr(model, "config"):  # transformers model (or a wrapper such as a PEFT model)
        out = model(input_ids=x, use_cache=False)
    else:
        out = model(x)
    if hasattr(out, "logits"):
        logits = out.logits
    elif isinstance(out, (tuple, list)):
        logits = out[0]
    else:
        logits = out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
