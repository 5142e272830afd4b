"""ZeRO stage 3 on the production engine: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

One FSDP unit per decoder layer plus the root, as the PyTorch FSDP2 tutorial and torchtitan wrap
a transformer: a unit's parameters are gathered just before it runs and freed after.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memlab.models import decoder_layers

__all__ = ["fsdp2_shard"]


def fsdp2_shard(model: nn.Module, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, cpu_offload: bool = False,
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` with PyTorch's FSDP2: ``fully_shard`` on every decoder layer, then on the root.

    Each call makes one unit whose parameters become DTensors sharded on dim 0 over the ranks; in
    forward and backward a unit's parameters are all-gathered just before it runs and freed after
    (``reshard_after_forward``), its gradients reduce-scattered.

    Returns ``model``, sharded in place.

    Args:
        model: a decoder model (:func:`memlab.models.decoder_layers` finds its layers).
        param_dtype: the compute dtype of a ``MixedPrecisionPolicy`` (e.g. torch.bfloat16), or None.
        reduce_dtype: the dtype gradients are reduced in (e.g. torch.float32), or None.
        cpu_offload: a ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer step
            on the host (on a CPU run it changes nothing but the code path).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("fsdp2_shard needs torch.distributed initialised: run it under memlab.distributed.launch")
    kw: dict[str, Any] = dict(reshard_after_forward=reshard_after_forward)
    if param_dtype is not None or reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model
