"""memlab's attention as a ``transformers`` attention implementation (``AttentionInterface``).

Registered under a name (default ``"memlab"``; transformers treats any name with "flash" in it
as a flash-attn kernel, hence not "memlab_flash"), a model picks it with
``config._attn_implementation = name`` or ``model.set_attn_implementation(name)``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from memlab.attention.flash import flash_attention
from memlab.attention.reference import chunked_attention, naive_attention
from memlab.attention.triton_flash import triton_flash_attention
from memlab.core.validation import check_choice, invalid

__all__ = ["register_transformers"]

_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "flash": flash_attention, "chunked": chunked_attention, "naive": naive_attention,
    "triton": triton_flash_attention}


def register_transformers(name: str = "memlab", impl: str = "flash") -> str:
    """Register memlab's attention with transformers' ``AttentionInterface``; returns ``name``.

    Then ``LlamaForCausalLM(config)`` with ``config._attn_implementation = name`` (or
    ``model.set_attn_implementation(name)``) runs it. transformers passes no mask to an
    implementation it has no mask function for, so this handles causal (bottom-right: right for
    both training and decoding with a cache) and non-causal attention, not padding masks: use it on
    batches without padding. GQA goes to memlab's own grouped heads (no repeat of k and v).

    Args:
        impl: which memlab attention runs: ``"flash"``, ``"chunked"``, ``"naive"`` or ``"triton"``.

    Raises:
        ValueError: an unknown ``impl`` or an empty ``name``.
    """
    check_choice("impl", impl, _IMPLS)
    if not isinstance(name, str) or not name:
        raise invalid("name", name, "a non-empty string")
    from transformers import AttentionInterface

    fn = _IMPLS[impl]

    def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
        if dropout:
            raise ValueError(f"{name}: dropout={dropout} is not supported; allowed: 0.0 (set attention_dropout=0)")
        if attention_mask is not None:
            raise ValueError(f"{name}: got an attention_mask; only causal / full attention without padding is supported")
        causal = "bottom_right" if kwargs.get("is_causal", getattr(module, "is_causal", True)) else False
        out = fn(query, key, value, causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention_forward)
    return name
