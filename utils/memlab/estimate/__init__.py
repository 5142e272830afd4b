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
* :mod:`~memlab.estimate.trace_cache`: the ``memlab estimate`` command's cache of extrapolated estimates on disk;
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

from memlab.core.optional import lazy_attributes

# Each public name from the module that defines it, imported when first asked for: ``import memlab.estimate`` and
# ``memlab estimate``'s argument checks and preset resolution import neither torch nor transformers.
_WHERE = {
    "CATEGORIES": "memlab.core.vocab",
    "DTYPES": "memlab.estimate.recipes", "OPTIMIZERS": "memlab.estimate.recipes",
    "check_input_bounds": "memlab.estimate.recipes",
    "MemoryEstimate": "memlab.estimate.result", "resolve_gpu": "memlab.estimate.result",
    "ModelSpec": "memlab.estimate.model", "check_positions": "memlab.estimate.model",
    "load_config": "memlab.estimate.model", "resolve_model": "memlab.estimate.model",
    "StepSpec": "memlab.estimate.step", "training_step": "memlab.estimate.step",
    "fsdp_units": "memlab.estimate.sharding", "shard_estimate": "memlab.estimate.sharding",
    "extrapolate_by_depth": "memlab.estimate.extrapolate",
    "estimate_step": "memlab.estimate.api", "estimate_training_memory": "memlab.estimate.api",
    "make_step": "memlab.estimate.api", "measure_training_memory": "memlab.estimate.api",
    "suggestions": "memlab.estimate.suggest",
    "accelerate_estimate": "memlab.estimate.peers", "deepspeed_zero_estimate": "memlab.estimate.peers",
    "AllocatorConfig": "memlab.estimate.caching_allocator",
    "estimate_reserved": "memlab.estimate.allocator_replay", "replay": "memlab.estimate.allocator_replay",
}


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())


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
