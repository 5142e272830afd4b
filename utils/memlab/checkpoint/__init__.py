"""Gradient checkpointing from scratch: trade compute for activation memory (chapter 02).

Autograd keeps, for every layer, the tensors its backward needs (the layer's *activations*).
Checkpointing keeps only a few of them and recomputes the rest during backward.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (arXiv:1604.06174): split a
chain of ``n`` layers into ``k`` segments and keep only each segment's input (a *boundary*).
In backward, one segment at a time is recomputed with autograd on. The activation peak is

    k * boundary  +  ceil(n / k) * layer        (= n/k + k layer units when boundary = layer)

which is smallest near ``k = sqrt(n)`` (``2 * sqrt(n)`` units instead of ``n``), for the price of
about one extra forward pass. Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198): *selective* recomputation keeps the outputs of the
expensive operations and recomputes only the cheap ones.

Modules:

* :mod:`~memlab.checkpoint.recompute` -- :func:`checkpoint` (non-reentrant, on
  ``saved_tensors_hooks``, the forward's RNG and autocast state replayed), :func:`selective_checkpoint`
  with :data:`MATMUL_OPS`, :func:`checkpoint_reentrant` (the older ``autograd.Function`` design and
  its LoRA pitfall), :class:`RNGState`;
* :mod:`~memlab.checkpoint.segments` -- :func:`checkpoint_sequential`, :func:`sqrt_segments`,
  :func:`activation_memory_model`, :func:`segments_for_budget`, and the peak predicted and measured;
* :mod:`~memlab.checkpoint.offload` -- :func:`offload_activations` (saved tensors to host memory),
  :func:`offload_checkpoints` (every decoder layer checkpointed, its input kept in host memory:
  chapter 09) and :func:`count_saved_tensors`;
* :mod:`~memlab.checkpoint.layers` -- :func:`enable` / :func:`disable` on a model's decoder layers.
"""
from memlab.checkpoint.layers import disable, enable
from memlab.checkpoint.offload import (CheckpointOffloadStats, OffloadedCheckpoints, OffloadStats, count_saved_tensors,
                                      offload_activations, offload_checkpoints, saved_activation_bytes)
from memlab.checkpoint.recompute import MATMUL_OPS, RNGState, checkpoint, checkpoint_reentrant, selective_checkpoint
from memlab.checkpoint.segments import (activation_memory_model, checkpoint_sequential,
                                        measure_sequential_activation_peak, segments_for_budget,
                                        sequential_activation_peak, split_segments, sqrt_segments)

__all__ = [
    "checkpoint",
    "checkpoint_reentrant",
    "checkpoint_sequential",
    "selective_checkpoint",
    "MATMUL_OPS",
    "RNGState",
    "sqrt_segments",
    "activation_memory_model",
    "segments_for_budget",
    "split_segments",
    "offload_activations",
    "OffloadStats",
    "saved_activation_bytes",
    "count_saved_tensors",
    "sequential_activation_peak",
    "measure_sequential_activation_peak",
    "enable",
    "disable",
    # chapter 09: the inputs of checkpointed layers in host memory
    "offload_checkpoints",
    "OffloadedCheckpoints",
    "CheckpointOffloadStats",
]
