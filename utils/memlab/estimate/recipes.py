"""The estimator's tables and limits: recipes and optimizers described, implementations, losses,
attention kernels, ZeRO stages, bitsandbytes' 8-bit state layout, cuBLAS workspaces, the
fragmentation margin and the input bounds.

The spellings are :mod:`memlab.core.vocab`'s, the one canonicaliser (``"bf16"`` = ``"bf16-mixed"``,
``"adam8bit"`` = ``"adamw8bit"``); :class:`memlab.estimate.StepSpec` stores them canonical.
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping

from memlab.core.units import KiB, MiB
from memlab.core.vocab import RECIPE_ALIASES, Recipe

# canonical recipe -> what it keeps in which dtype (printed by the CLI and MemoryEstimate.table)
DTYPES: dict[str, str] = {
    Recipe.FP32.value: "fp32 weights, gradients, optimizer state and compute",
    Recipe.BF16_MIXED.value: "mixed precision: fp32 weights/gradients/optimizer state, forward under "
                             "autocast(bfloat16)",
    Recipe.FP16_MIXED.value: "mixed precision: fp32 weights/gradients/optimizer state, forward under "
                             "autocast(float16)",
    Recipe.BF16_PURE.value: "bf16 weights, gradients and optimizer state, no autocast, no fp32 master copy",
}
#: other spellings of a recipe (``"bf16"`` = ``"bf16-mixed"``): memlab.core.vocab's
DTYPE_ALIASES: dict[str, str] = dict(RECIPE_ALIASES)
#: the recipes that run the forward pass under autocast
MIXED = (Recipe.BF16_MIXED.value, Recipe.FP16_MIXED.value)
#: the recipes whose compute is 16-bit
SIXTEEN_BIT = MIXED + (Recipe.BF16_PURE.value,)

OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW (2 moments per parameter, in the parameter's dtype)",
    "sgd": "torch.optim.SGD without momentum (no state)",
    "adamw8bit": "bitsandbytes.optim.AdamW8bit (2 moments of 1 byte, fp32 absmax per 256 elements)",
    "offload-adamw": "memlab.offload.OffloadedAdamW (chapter 04): device keeps the params in their dtype and their "
                     "grads; host keeps fp32 master weights, an fp32 grad slot and 2 fp32 moments (+ staging on CUDA)",
    "paged-adamw32bit": "bitsandbytes.optim.PagedAdamW32bit (2 fp32 moments; those of tensors of 100,000 elements or "
                        "more in CUDA unified memory, outside PyTorch's allocator: reported as paged bytes)",
    "paged-adamw8bit": "bitsandbytes.optim.PagedAdamW8bit (AdamW8bit's state; the moments of tensors of 100,000 "
                       "elements or more in CUDA unified memory, outside PyTorch's allocator: reported as paged bytes)",
}
PAGED_OPTIMIZERS = ("paged-adamw32bit", "paged-adamw8bit")
BNB_MIN_PAGED_SIZE = 100_000  # bitsandbytes' get_state_buffer: smaller tensors get a plain torch.zeros_like
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash")
#: the loss a traced step runs (StepSpec.loss): auto, transformers' own (hf), memlab.models.lm_loss (memlab),
#: memlab.loss.chunked_cross_entropy (chunked) or memlab.loss.enable's fused linear cross-entropy (fused)
LOSSES = ("auto", "hf", "memlab", "chunked", "fused")
#: other spellings of a loss: "default" is "auto"
LOSS_ALIASES = {"default": "auto"}
ZERO_STAGES = (0, 1, 2, 3)


# bitsandbytes' blockwise 8-bit optimizers (bitsandbytes/optim/optimizer.py, Optimizer8bit /
# Optimizer2State.init_state): tensors with fewer than min_8bit_size elements keep 32-bit
# state; larger ones keep uint8 states and one fp32 absmax per block of 256 elements.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256

# cuBLAS allocates one workspace through the caching allocator for each thread that runs matmuls:
# the forward thread and the autograd engine's backward thread (results/h100/diag.log). It is in
# torch.cuda.max_memory_allocated but no op returns it. Its size is PyTorch's choice, by card
# (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize): 32 MiB on compute capability
# 9.x and later (Hopper, Blackwell), the ":4096:2:16:8" default elsewhere (4096 KiB x 2 + 16 KiB x 8),
# and CUBLAS_WORKSPACE_CONFIG (":SIZE_KiB:COUNT" pairs) overrides both.
CUBLAS_WORKSPACE_BYTES = 32 * MiB  # Hopper and later; also the estimate's figure when no card is given
CUBLAS_WORKSPACE_PRE_HOPPER_BYTES = 4096 * KiB * 2 + 16 * KiB * 8  # 8,519,680 B (Ampere, Ada, Volta ...)
CUBLAS_THREADS = 2


def cublas_workspace(gpu: str | None = None, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The bytes of one cuBLAS workspace on the target card, and where the figure comes from.

    Args:
        gpu: a card name of :mod:`memlab.core.gpus` (its compute capability picks PyTorch's default), a size
            (``"24GB"``: no card known, the Hopper figure, said so) or None (no card known: the Hopper figure, 32 MiB).
        env: the environment to read ``CUBLAS_WORKSPACE_CONFIG`` from (default ``os.environ``).

    Returns:
        ``(bytes, why)``; ``why`` says which rule gave the figure.

    Raises:
        ValueError: neither a card of :mod:`memlab.core.gpus` nor a size, naming the cards it knows.
    """
    from memlab.core import gpus

    config = (os.environ if env is None else env).get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        # PyTorch sums every ":SIZE:COUNT" pair (SIZE in KiB); with none it warns and keeps its default
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(a) * int(b) for a, b in pairs) * KiB, f"CUBLAS_WORKSPACE_CONFIG={config}"
    if gpu is None:
        return CUBLAS_WORKSPACE_BYTES, "no card given: Hopper's"
    cap = gpus.capability(gpu) if isinstance(gpu, str) else None
    if cap is None:
        gpus.parse_gpu(gpu)  # a size is a GPU too (the same answer as --gpu); anything else is refused, named
        return CUBLAS_WORKSPACE_BYTES, (f"gpu={gpu!r} is a size, not a card: Hopper's 32 MiB (8.125 MiB before "
                                        f"compute capability 9.0; name the card for its own)")
    if cap.sm >= (9, 0):
        return CUBLAS_WORKSPACE_BYTES, f"{cap.name}, compute capability {cap.sm[0]}.{cap.sm[1]}: 32 MiB"
    return CUBLAS_WORKSPACE_PRE_HOPPER_BYTES, (f"{cap.name}, compute capability {cap.sm[0]}.{cap.sm[1]}: "
                                               f"PyTorch's :4096:2:16:8 default, 8.125 MiB")


# max_memory_reserved / max_memory_allocated at the peak of a steady training step, measured on
# an H100 (TinyGPT and a Llama with a 32k vocabulary, 6 x 512, batch 8 x 512, fp32 and bf16 AMP):
# 1.05, 1.10, 1.09, 1.14 (results/h100/estimator_probe.json). The largest is the stated margin.
FRAGMENTATION_MARGIN = 1.14

MAX_CONFIG_BYTES = 4 * MiB  # a config.json is a few KiB; /dev/zero or a huge file is refused
MAX_BATCH = 2**20  # sequences per step (per rank)
MAX_SEQ_LEN = 2**20  # tokens per sequence
MAX_TOKENS = 2**31  # batch x seq_len: beyond it attention's element counts overflow int64
MAX_WORLD_SIZE = 1024  # ranks: stage 3 traces a fake process group of this many


def check_input_bounds(batch_size: Any, seq_len: Any, world_size: Any = 1) -> None:
    """Refuse, before any work, a batch, a sequence or a world size no trace can finish in seconds.

    ``batch_size`` (per rank) and ``seq_len`` are each 1 to :data:`MAX_BATCH` / :data:`MAX_SEQ_LEN`, their
    product at most :data:`MAX_TOKENS`; ``world_size`` 1 to :data:`MAX_WORLD_SIZE`.

    Raises:
        ValueError: naming the argument, its value and the allowed range (or the product).
    """
    for name, v, hi in (("batch_size", batch_size, MAX_BATCH), ("seq_len", seq_len, MAX_SEQ_LEN),
                        ("world_size", world_size, MAX_WORLD_SIZE)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ValueError(f"{name}={v!r} is invalid; allowed: an int from 1 to {hi:,}")
    if batch_size * seq_len > MAX_TOKENS:
        raise ValueError(f"batch_size={batch_size} x seq_len={seq_len} = {batch_size * seq_len:,} tokens is invalid; "
                         f"allowed: at most {MAX_TOKENS:,} tokens per step")


# Extrapolation by depth (memlab.estimate.extrapolate): traced at these two depths (decoder layers) and a third,
# 2 d2 - d1. From 3 layers on, the first two and the last two layers of the traced stacks are distinct layers (the
# first can differ: a frozen embedding's output needs no gradient; HF Llama keeps inputs_embeds alive through the
# forward; the last feeds the head), so every candidate moment of extrapolate.aligned_peaks lines up over the three
# depths.
EXTRAPOLATION_DEPTHS = (3, 4)
EXTRAPOLATE_MIN_LAYERS = 6
