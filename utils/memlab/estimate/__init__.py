"""Will this fine-tune fit? Estimate a training step's peak memory without a GPU.

The real training step -- forward, backward, optimizer step -- runs on *fake* tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and devices, no data) under
:class:`memlab.profiler.MemoryTracker`, which counts every live storage as it does on real tensors.
What autograd saves, the optimizer's temporaries, autocast's 16-bit weight copies and checkpointing's
recomputation are whatever PyTorch and ``transformers`` really do; for a model small enough to run,
the estimate equals the real step's tracked peak to the byte. ZeRO follows Rajbhandari et al. 2020;
LoRA Hu et al. 2021; QLoRA Dettmers et al. 2023.

One concern per module:

* :mod:`~memlab.estimate.recipes`: the vocabulary (recipes, optimizers, losses) and input bounds;
* :mod:`~memlab.estimate.model`: the one model resolver (preset, config.json, Hub id, config, callable);
* :mod:`~memlab.estimate.step`: :class:`StepSpec` (one step's settings) and the step itself;
* :mod:`~memlab.estimate.optim`: the optimizers a step runs (8-bit, offloaded);
* :mod:`~memlab.estimate.attention`: which attention kernel the target runs, and the tracker;
* :mod:`~memlab.estimate.trace`: tracing one step (:func:`trace_step`);
* :mod:`~memlab.estimate.extrapolate`: the one extrapolation by depth (also the planner's);
* :mod:`~memlab.estimate.sharding`: ZeRO stages and FSDP2 per rank;
* :mod:`~memlab.estimate.api`: :func:`estimate_training_memory`, :func:`measure_training_memory`;
* :mod:`~memlab.estimate.result`: :class:`MemoryEstimate` and :func:`resolve_gpu`;
* :mod:`~memlab.estimate.suggest`: what would make it fit;

* :mod:`~memlab.estimate.cuda_rules`: CUDA's rules on a CPU trace;
* :mod:`~memlab.estimate.adapters`: LoRA and QLoRA;
* :mod:`~memlab.estimate.peers`: the rules of thumb;
* :mod:`~memlab.estimate.hub`: Hub configs;
* :mod:`~memlab.estimate.validate`: the published comparisons (``memlab estimate --validate``).

The command line is :mod:`memlab.cli.estimate`.
"""
from __future__ import annotations

# re-exports: every name memlab.estimate had before it became a package, plus the shared pieces
# ruff: noqa: F401
from memlab.core.units import format_bytes
from memlab.estimate.recipes import (ATTN_IMPLEMENTATIONS, BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE, CATEGORIES,
                                     CUBLAS_THREADS, CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACE_PRE_HOPPER_BYTES,
                                     DTYPE_ALIASES, DTYPES, cublas_workspace,
                                     FRAGMENTATION_MARGIN, LOSSES, MAX_BATCH, MAX_CONFIG_BYTES, MAX_SEQ_LEN,
                                     MAX_TOKENS, MAX_WORLD_SIZE, OPTIMIZER_ALIASES, OPTIMIZER_IMPLS, OPTIMIZERS,
                                     ZERO_STAGES, canonical_dtype, canonical_optimizer, check_input_bounds,
                                     parse_size)
from memlab.estimate.result import MemoryEstimate, resolve_gpu
from memlab.estimate.model import (ModelSpec, check_overrides, check_positions, is_hf_config, load_config,
                                   resolve_model)
from memlab.estimate.optim import make_optimizer
from memlab.estimate.step import StepSpec, load_step, training_step
from memlab.estimate.trace import trace_step
from memlab.estimate.sharding import fsdp_units, shard_estimate
from memlab.estimate.extrapolate import (EXTRAPOLATE_MIN_LAYERS, EXTRAPOLATION_DEPTHS, FSDP_EXTRAPOLATION_DEPTHS,
                                         affine_estimate, extrapolate_by_depth)
from memlab.estimate.api import (estimate_one_rank, estimate_step, estimate_training_memory, make_step,
                                 measure_training_memory, resolve_for_step)
from memlab.estimate.suggest import QLORA_BITS_PER_PARAM, Suggestion, estimate_command, suggestions
from memlab.estimate.peers import accelerate_estimate, deepspeed_zero_estimate

__all__ = [
    "DTYPES",
    "OPTIMIZERS",
    "OPTIMIZER_IMPLS",
    "CATEGORIES",
    "MemoryEstimate",
    "estimate_training_memory",
    "measure_training_memory",
    "training_step",
    "accelerate_estimate",
    "deepspeed_zero_estimate",
    "suggestions",
    "resolve_gpu",
    "cublas_workspace",
    "CUBLAS_WORKSPACE_PRE_HOPPER_BYTES",
    "load_step",
    "ATTN_IMPLEMENTATIONS",
    "LOSSES",
    "ZERO_STAGES",
    "shard_estimate",
    "fsdp_units",
    "estimate_command",
    "OPTIMIZER_ALIASES",
    "DTYPE_ALIASES",
    # the shared pieces the planner uses (issue 21): one resolver, one step, one extrapolation
    "StepSpec",
    "ModelSpec",
    "resolve_model",
    "check_positions",
    "check_input_bounds",
    "canonical_dtype",
    "canonical_optimizer",
    "make_step",
    "estimate_step",
    "trace_step",
    "affine_estimate",
    "extrapolate_by_depth",
]
