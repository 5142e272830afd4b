"""CUDA semantics for a trace that runs on a CPU-only torch (``estimate_training_memory(device="cuda")``).

A CPU build of torch cannot create CUDA fake tensors, so a question about a CUDA card is traced with
CPU fake tensors. Where the CPU and CUDA paths of an operator keep different tensors, the trace
would answer for the wrong card. :func:`cuda_semantics` is a ``TorchFunctionMode`` that, during the
traced step, reroutes those operators to what CUDA runs. Each rule is stated in the estimate's notes
(:func:`rule_notes`) and tested op by op in ``tests/test_estimate_cuda_rules.py``:

1. **Dropout keeps a 1-byte mask.** ``torch.dropout`` on a CUDA tensor with ``0 < p < 1`` in training
   takes the fused kernel: ``aten::native_dropout``, which returns the output and a ``bool`` mask that
   autograd keeps for backward (1 byte per element). The CPU path multiplies by a noise tensor in the
   input's dtype (4 bytes per element in fp32, 2 in bf16) and keeps that. The rule calls
   ``native_dropout`` (it exists on CPU too, with the same bool mask).
2. **CUDA autocast's float32 list.** Under ``torch.autocast("cuda")`` the ops on CUDA's float32 list
   (PyTorch's "CUDA Ops that can autocast to float32": layer_norm, group_norm, softmax, log_softmax,
   softmin, sum, cumsum, cumprod, norm, normalize, pow, exp, log, rsqrt, reciprocal, softplus, ...)
   cast 16-bit inputs to fp32 and return fp32; CPU autocast (checked on this torch, op by op) runs
   them in 16 bits. So on CUDA a LayerNorm under bf16 autocast keeps an fp32 copy of its input for
   backward and returns fp32 (the next linear casts it back to 16 bits). The rule casts the floating
   inputs of those ops to fp32 and runs them with autocast off, as CUDA's cast policy does.
3. **CUDA autocast's lower-precision list** has ``mv``, ``addmv`` and ``addr``, which CPU autocast
   runs in fp32: the rule casts them to the autocast dtype.

Sources: PyTorch's AMP documentation, "Autocast Op Reference" (https://pytorch.org/docs/stable/amp.html,
sections "CUDA Ops that can autocast to float16/float32" and "CPU Ops that can autocast to
bfloat16/float32"); the dropout dispatch is ``at::dropout``'s fused-kernel check
(aten/src/ATen/native/Dropout.cpp: CUDA input, 0 < p < 1, non-empty -> ``native_dropout``).
Not modelled (kernel-internal, no tensor an op returns): CUDA kernels' own scratch other than the
softmax-backward rule of :mod:`memlab.estimate`; CPU-only fp32 ops (FFTs, linalg) that LLM training does not run.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CUDA_FP32_OPS", "CUDA_LOWER_OPS", "cuda_semantics", "rule_notes"]

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
    """The mode to trace a CUDA step on CPU tensors (enter it around forward and backward)."""
    return _CudaSemantics()


def rule_notes(mode: _CudaSemantics) -> list[str]:
    """The rules that changed something in the traced step, in words for ``MemoryEstimate.notes``."""
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
