"""Beyond one GPU (chapter 08): ZeRO from scratch, PyTorch FSDP2, and what each rank holds.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
One module per concern:

* :mod:`memlab.distributed.launcher`: :func:`launch` runs ``fn(rank, world_size, *args)`` on N
  processes (gloo on CPU) from a notebook cell; the same ``fn`` runs under ``torchrun``;
* :mod:`memlab.distributed.collectives`: flat buffers in equal shards, reduce-scatter, all-gather;
* :mod:`memlab.distributed.zero`: :class:`ZeroOptimizer` (stages 1 and 2) and the paper's bytes;
* :mod:`memlab.distributed.fsdp`: :func:`fsdp2_shard`, stage 3 on PyTorch's FSDP2;
* :mod:`memlab.distributed.ranks`: :func:`rank_bytes` and :func:`rank_tracker`, one rank's bytes;
* :mod:`memlab.distributed.comm`: :class:`CommCounter` and the paper's communication volume;
* :mod:`memlab.distributed.training`: :func:`train_rank`, one run per rank, and its single-process twin;
  :func:`rank_peaks`, one rank's peak by the allocator's events and by the tracker.
"""
from memlab.distributed.collectives import (all_gather_flat, gather_flat, padded_size, reduce_scatter_flat,
                                            shard_flat, shard_range)
from memlab.distributed.comm import CommCounter, comm_volume_bytes
from memlab.distributed.fsdp import fsdp2_shard
from memlab.distributed.launcher import MAX_LAUNCH_TIMEOUT, RankError, free_port, in_torchrun, launch
from memlab.distributed.ranks import rank_bytes, rank_tracker
from memlab.distributed.training import global_batches, rank_peaks, single_process_losses, train_rank
from memlab.distributed.zero import STAGES, ZeroOptimizer, zero_model_state_bytes

__all__ = [
    "launch",
    "RankError",
    "in_torchrun",
    "free_port",
    "MAX_LAUNCH_TIMEOUT",
    "padded_size",
    "shard_range",
    "shard_flat",
    "gather_flat",
    "all_gather_flat",
    "reduce_scatter_flat",
    "ZeroOptimizer",
    "fsdp2_shard",
    "rank_bytes",
    "rank_tracker",
    "CommCounter",
    "zero_model_state_bytes",
    "comm_volume_bytes",
    "STAGES",
    "global_batches",
    "single_process_losses",
    "train_rank",
    "rank_peaks",
]
