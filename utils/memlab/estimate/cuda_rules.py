"""CUDA semantics for a trace on a CPU-only torch (``estimate_training_memory(device="cuda")``).

A CPU build of torch cannot create CUDA fake tensors, so a question about a CUDA card is traced with
CPU fake tensors; :func:`cuda_semantics` is a ``TorchFunctionMode`` that reroutes, during the traced
step, the operators whose CPU and CUDA paths keep different tensors. Each rule that fired is stated in
the estimate's notes (:func:`rule_notes`):

1. Dropout keeps a 1-byte mask: on CUDA, ``dropout`` with ``0 < p < 1`` in training runs the fused
   ``native_dropout`` (a bool mask kept for backward); CPU keeps a noise tensor in the input's dtype.
2. CUDA autocast's float32 list (layer_norm, softmax, log_softmax, sum, pow, ...) casts 16-bit inputs
   to fp32, where CPU autocast runs them in 16 bits.
3. CUDA autocast's lower-precision list has ``mv``, ``addmv`` and ``addr``, which CPU autocast runs in fp32.

Sources: PyTorch's AMP documentation, "Autocast Op Reference" (https://pytorch.org/docs/stable/amp.html);
``at::dropout``'s fused-kernel check (aten/src/ATen/native/Dropout.cpp). Not modelled: kernel-internal
scratch other than the softmax-backward rule of :mod:`memlab.estimate.attention`.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CUDA_FP32_OPS", "CUDA_LOWER_OPS", "checkpoint_context_fn", "cuda_semantics", "rule_notes"]

# CUDA's float32 autocast list (PyTorch AMP docs), by the Python name the op is called under. Kept
# only where CPU autocast differs (checked on torch 2.13 CPU: these return bf16 for bf16 inputs).
CUDA_FP32_OPS = frozenset({
    "pow", "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "acos", "asin", "cosh", "erfinv", "exp", "expm1",
    "log", "log10", "log1p", "log2", "reciprocal", "rsqrt", "sinh", "tan", "softplus", "layer_norm", "group_norm",
    "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "sum", "norm", "normalize", "cosine_similarity",
    "renorm", "dist", "pdist", "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "multi_margin_loss", "poisson_nll_loss", "soft_margin_loss", "triplet_margin_loss",
})
# CUDA's lower-precision list entries that CPU autocast leaves in fp32.
CUDA_LOWER_OPS = frozenset({"mv", "addmv", "addr"})


def _is16(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)


def _cast(obj: object, dtype: torch.dtype) -> object:
    if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.dtype != dtype:
        return obj.to(dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


class _CudaSemantics(TorchFunctionMode):
    """The rules of the module docstring; ``counts`` says how often each fired."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"dropout": 0, "fp32": 0, "lower": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "dropout" and func is torch.nn.functional.dropout:
            x = args[0] if args else kwargs["input"]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
            if training and not inplace and 0 < p < 1 and isinstance(x, torch.Tensor) and x.numel() > 0:
                self.counts["dropout"] += 1
                return torch.native_dropout(x, p, True)[0]
        elif torch.is_autocast_enabled("cpu") and kwargs.get("dtype") is None and not name.endswith("_"):
            if name in CUDA_FP32_OPS and any(_is16(a) for a in (*args, *kwargs.values())):
                self.counts["fp32"] += 1
                with torch.autocast("cpu", enabled=False):
                    return func(*_cast(args, torch.float32), **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
            if name in CUDA_LOWER_OPS:
                low = torch.get_autocast_dtype("cpu")
                self.counts["lower"] += 1
                with torch.autocast("cpu", enabled=False):
                    return func(*_cast(args, low), **{k: _cast(v, low) for k, v in kwargs.items()})
        return func(*args, **kwargs)


def cuda_semantics() -> _CudaSemantics:
    """A fresh mode to trace a CUDA step on CPU tensors (a ``TorchFunctionMode``: enter it around forward
    and backward)."""
    return _CudaSemantics()


def checkpoint_context_fn(mode: _CudaSemantics) -> Callable[[], tuple]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant) that runs the recompute
    in backward under ``mode`` (:func:`cuda_semantics`) too, so it keeps the forward's tensors (bool
    dropout masks, fp32 norms). Nothing extra in the forward: the mode is already on there.
    """
    return lambda: (contextlib.nullcontext(), mode)


def rule_notes(mode: _CudaSemantics) -> list[str]:
    """The rules that changed something in the step run under ``mode``, one note each (for ``MemoryEstimate.notes``)."""
    out = []
    c = mode.counts
    if c["dropout"]:
        out.append(f"CUDA rule: dropout keeps a 1-byte bool mask (fused native_dropout), not CPU's mask in the "
                   f"input dtype ({c['dropout']} calls in the last traced step)")
    if c["fp32"]:
        out.append(f"CUDA rule: autocast's CUDA float32 list (layer_norm, softmax, log_softmax, sum, pow, ...) runs "
                   f"in fp32 where CPU autocast runs 16-bit ({c['fp32']} calls in the last traced step)")
    if c["lower"]:
        out.append(f"CUDA rule: autocast's CUDA lower-precision mv/addmv/addr ({c['lower']} calls)")
    return out
