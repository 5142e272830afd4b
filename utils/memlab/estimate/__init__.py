"""Will this fine-tune fit? Estimate a training step's peak memory without a GPU.

The real training step -- forward, backward, optimizer step -- runs on *fake* tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and devices, no data) under
:class:`memlab.profiler.MemoryTracker`, which counts every live storage as it does on real tensors.
What autograd saves, the optimizer's temporaries, autocast's 16-bit weight copies and checkpointing's
recomputation are whatever PyTorch and ``transformers`` really do; for a model small enough to run,
the estimate equals the real step's tracked peak to the byte. ZeRO follows Rajbhandari et al. 2020;
LoRA Hu et al. 2021; QLoRA Dettmers et al. 2023.

One concern per module:

* :mod:`~memlab.estimate.recipes`: the tables (recipes, optimizers, losses, kernels) and input bounds;
* :mod:`~memlab.estimate.model`: the one model resolver (preset, config.json, Hub id, config, callable);
* :mod:`~memlab.estimate.step`: :class:`StepSpec` (one step's settings) and the step itself;
* :mod:`~memlab.estimate.optim`: the optimizers a step runs (8-bit, offloaded);
* :mod:`~memlab.estimate.attention`: which attention kernel the target runs, and the tracker;
* :mod:`~memlab.estimate.trace`: tracing one step (:func:`~memlab.estimate.trace.trace_step`);
* :mod:`~memlab.estimate.extrapolate`: the one extrapolation by depth (also the planner's);
* :mod:`~memlab.estimate.sharding`: ZeRO stages and FSDP2 per rank;
* :mod:`~memlab.estimate.api`: :func:`estimate_training_memory`, :func:`measure_training_memory`;
* :mod:`~memlab.estimate.result`: :class:`MemoryEstimate` and :func:`resolve_gpu`;
* :mod:`~memlab.estimate.suggest`: what would make it fit;

* :mod:`~memlab.estimate.caching_allocator`: a model of PyTorch's CUDA caching allocator;
* :mod:`~memlab.estimate.allocator_replay`: a traced step's allocations replayed through it (reserved, nvidia-smi);

* :mod:`~memlab.estimate.cuda_rules`: CUDA's rules on a CPU trace;
* :mod:`~memlab.estimate.adapters`: LoRA and QLoRA;
* :mod:`~memlab.estimate.peers`: the rules of thumb;
* :mod:`~memlab.estimate.hub`: Hub configs;
* :mod:`~memlab.estimate.validate`: the published comparisons (``memlab estimate --validate``).

The command line is :mod:`memlab.cli.estimate`.
"""
from __future__ import annotations

from memlab.core.vocab import CATEGORIES
from memlab.estimate.recipes import DTYPES, OPTIMIZERS, check_input_bounds
from memlab.estimate.result import MemoryEstimate, resolve_gpu
from memlab.estimate.model import ModelSpec, check_positions, load_config, resolve_model
from memlab.estimate.step import StepSpec, training_step
from memlab.estimate.sharding import fsdp_units, shard_estimate
from memlab.estimate.extrapolate import extrapolate_by_depth
from memlab.estimate.api import estimate_step, estimate_training_memory, make_step, measure_training_memory
from memlab.estimate.suggest import suggestions
from memlab.estimate.peers import accelerate_estimate, deepspeed_zero_estimate
from memlab.estimate.caching_allocator import AllocatorConfig
from memlab.estimate.allocator_replay import estimate_reserved, replay

__all__ = [
    "estimate_training_memory",
    "measure_training_memory",
    "StepSpec",
    "MemoryEstimate",
    "resolve_gpu",
    "suggestions",
    "training_step",
    "load_config",
    "DTYPES",
    "OPTIMIZERS",
    "CATEGORIES",
    # per rank (chapter 08)
    "shard_estimate",
    "fsdp_units",
    # the rules of thumb, side by side (memlab.estimate.peers)
    "accelerate_estimate",
    "deepspeed_zero_estimate",
    # the pieces the planner shares (issue 21): one resolver, one step, one extrapolation
    "make_step",
    "estimate_step",
    "ModelSpec",
    "resolve_model",
    "check_positions",
    "check_input_bounds",
    "extrapolate_by_depth",
    # reserved memory and nvidia-smi by a model of PyTorch's CUDA caching allocator (issue 38)
    "estimate_reserved",
    "replay",
    "AllocatorConfig",
]
