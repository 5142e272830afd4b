"""Chunked and flash attention from scratch: attention in memory linear in the sequence length.

Attention ``O = softmax(scale * Q K^T + mask) V`` written the obvious way builds an ``Lq x Lk``
score matrix per head, and autograd keeps the probabilities for backward. The online softmax
(Milakov & Gimelshein 2018, arXiv:1805.02867) computes the same output block by block; Rabe &
Staats 2021 (arXiv:2112.05682) chunk queries and keys with it; FlashAttention-2 (Dao 2023,
arXiv:2307.08691) keeps only the logsumexp for backward and recomputes the probabilities.

Every function takes ``(batch, heads, seq, head_dim)`` tensors like
``torch.nn.functional.scaled_dot_product_attention``, and the same options: ``causal=False``,
``True`` / ``"top_left"`` (SDPA's ``is_causal``) or ``"bottom_right"`` (flash-attn >= 2.1); fewer
key/value heads than query heads (GQA); fp16 / bf16 / fp32 accumulate in fp32, fp64 in fp64. A
row whose keys are all masked gives output 0, logsumexp ``-inf`` and gradient 0, as SDPA does.

The modules:

* :mod:`~memlab.attention.masks`: argument checks, :func:`causal_mask`, :func:`block_mask`;
* :mod:`~memlab.attention.reference`: :func:`naive_attention`, :func:`chunked_attention`,
  :func:`merge_partials`, :func:`sdpa_reference`;
* :mod:`~memlab.attention.flash`: :func:`flash_attention` (an autograd Function), its forward and
  backward, :func:`attention_saved_bytes`;
* :mod:`~memlab.attention.triton_flash` and :mod:`~memlab.attention.triton_kernels`:
  :func:`triton_flash_attention` and its Triton kernels (interpreted on CPU, compiled on CUDA);
* :mod:`~memlab.attention.hf`: :func:`register_transformers`.
"""
from memlab.attention.flash import (FlashAttentionFunction, attention_saved_bytes, flash_attention,
                                    flash_attention_backward, flash_attention_forward)
from memlab.attention.hf import register_transformers
from memlab.attention.masks import CAUSAL_MODES, block_mask, causal_mask
from memlab.attention.reference import chunked_attention, merge_partials, naive_attention, sdpa_reference
from memlab.attention.triton_flash import (TritonFlashAttentionFunction, load_triton_kernels, triton_available,
                                           triton_flash_attention, triton_interpreted)


__all__ = [
    "CAUSAL_MODES",
    "naive_attention",
    "chunked_attention",
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "triton_flash_attention",
    "triton_available",
    "triton_interpreted",
    "causal_mask",
    "block_mask",
    "merge_partials",
    "attention_saved_bytes",
    "sdpa_reference",
    "register_transformers",
    "FlashAttentionFunction",
    "TritonFlashAttentionFunction",
    "load_triton_kernels",
]
