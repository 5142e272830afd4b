"""The language-model loss without its logits: chunked and fused linear cross-entropy, from scratch.

For ``N`` tokens, a head ``W`` ``(V, H)`` and targets ``t``, the loss is::

    loss = 1/n * sum over counted tokens i of  logsumexp(h_i W^T) - (h_i W^T)[t_i]

Written plainly it makes the ``N x V`` logits, upcasts them to fp32 and keeps the log-softmax for
backward: at 8k tokens and Llama 3's 128,256 classes, 3.9 GiB per fp32 copy. The fused version
keeps two numbers per token (logsumexp, target logit) and recomputes the logits chunk by chunk in
backward (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models",
arXiv:2411.09009; Hsu et al. 2024, "Liger Kernel", arXiv:2410.10989).

The modules:

* :mod:`~memlab.loss.reference`: :func:`materialized_cross_entropy` (the plain loss) and
  :func:`chunked_cross_entropy` (chunks through autograd: saves nothing in training);
* :mod:`~memlab.loss.fused`: :class:`FusedLinearCrossEntropy` and :func:`fused_linear_cross_entropy`
  (ignore_index, soft-cap, z-loss, bias, tied heads, fp32 accumulation under bf16/fp16);
* :mod:`~memlab.loss.triton_fused` and :mod:`~memlab.loss.triton_kernels`:
  :func:`triton_fused_linear_cross_entropy` and its kernels (interpreted on CPU, compiled on CUDA);
* :mod:`~memlab.loss.hf`: :func:`enable` / :func:`disable` for a transformers ``*ForCausalLM``;
* :mod:`~memlab.loss.peers`: torchtune's, Liger-Kernel's and Cut Cross-Entropy's losses, where they run.
"""
from memlab.loss.fused import FusedLinearCrossEntropy, fused_linear_cross_entropy
from memlab.loss.hf import SUPPORTED, disable, enable, is_enabled, shift_labels
from memlab.loss.reference import chunked_cross_entropy, materialized_cross_entropy
from memlab.loss.triton_fused import (TritonFusedLinearCrossEntropy, load_triton_kernels, triton_available,
                                      triton_fused_linear_cross_entropy, triton_interpreted)

__all__ = [
    "materialized_cross_entropy",
    "chunked_cross_entropy",
    "FusedLinearCrossEntropy",
    "fused_linear_cross_entropy",
    "TritonFusedLinearCrossEntropy",
    "triton_fused_linear_cross_entropy",
    "triton_available",
    "triton_interpreted",
    "load_triton_kernels",
    "enable",
    "disable",
    "is_enabled",
    "shift_labels",
    "SUPPORTED",
]
