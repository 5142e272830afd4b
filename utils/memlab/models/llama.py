"""A tiny ``transformers`` Llama (Touvron et al. 2023) built from a config, never downloaded.

For the chapters that exercise the Hugging Face stack (LoRA/QLoRA, FSDP, the estimator).
``transformers`` is imported on first use, so the rest of memlab works with PyTorch alone.
"""

from __future__ import annotations

from typing import Any

from memlab.core.optional import needs

__all__ = ["TINY_LLAMA_DEFAULTS", "tiny_llama_config", "tiny_llama"]

# ~0.8M parameters: small enough to train on a CPU in a notebook cell, with grouped-query attention
# (2 KV heads for 4 query heads) so the GQA code paths run too
TINY_LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


def tiny_llama_config(**overrides: Any):
    """A small ``transformers.LlamaConfig`` (byte vocab, 4 layers, GQA with 2 KV heads);
    ``overrides`` replace fields of :data:`TINY_LLAMA_DEFAULTS`."""
    with needs("memlab.models.tiny_llama_config"):
        from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA_DEFAULTS, **overrides})


def tiny_llama(**overrides: Any):
    """A randomly initialised ``transformers.LlamaForCausalLM`` on the default device and dtype
    (nothing is downloaded; seed torch first); ``overrides`` as in :func:`tiny_llama_config`."""
    with needs("memlab.models.tiny_llama"):
        from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**overrides))
