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
4. NF4 linears (:class:`memlab.quant.Linear4bit`, QLoRA's base) allocate what bitsandbytes allocates on CUDA:
   memlab's pure-PyTorch dequantize keeps int64 indices and fp32 values alive together (about 8 bytes per
   weight), where ``bitsandbytes.functional.dequantize_4bit``'s CUDA kernel writes the weight in the compute
   dtype (2 bytes per weight for bf16/fp16), after dequantizing the blocks' absmax to fp32 (double quant: 4
   bytes per 64 weights); nothing else. Forward holds that weight while ``F.linear`` runs, backward
   dequantizes it again for the input gradient. Before bitsandbytes 0.43.2, ``MatMul4Bit`` kept its input on
   ``ctx`` for backward whenever it required a gradient (outside saved-tensor hooks, so checkpointing does
   not free it); from 0.43.2 on it keeps none. The version followed is the one installed, else 0.43.2
   (:func:`bnb_version`; ``cuda_semantics(bnb_version=...)`` names another). Not modelled: quantizing at load
   time (from fp16 older releases made an fp16 copy beside the bf16 weight), bitsandbytes' inference gemv path.
5. Attention dropout inside a fused kernel: CUDA's flash and memory-efficient SDPA kernels take ``dropout_p`` and
   draw the mask inside the kernel (backward draws it again from the saved RNG state), so they keep what they keep
   without dropout; CPU's flash kernel refuses ``dropout_p > 0`` and SDPA falls back to the math kernel, which keeps
   the b x h x s x s probabilities and the dropout mask. Where the step's CUDA kernel is a fused one
   (:func:`memlab.estimate.attention.attention_plan` sets ``fused_attention``), the trace runs SDPA with
   ``dropout_p=0`` on the CPU flash kernel: the same saved tensors. Measured on an H200 (gpt2 at 2 layers, bf16,
   4 x 256, attention dropout 0.1): the CUDA fake trace 1,506,729,584 B, the CPU trace before this rule
   1,591,562,872 B (+5.6%), with it 1,506,726,520 B, 3,064 B under (not located; the CUDA kernel's RNG seed and
   offset are not modelled).

Sources: PyTorch's AMP documentation, "Autocast Op Reference" (https://pytorch.org/docs/stable/amp.html);
``at::dropout``'s fused-kernel check (aten/src/ATen/native/Dropout.cpp); SDPA's kernel choice
(aten/src/ATen/native/transformers/sdp_utils_cpp.cpp: ``check_for_dropout`` among the CPU flash kernel's
constraints only); bitsandbytes'
``bitsandbytes/autograd/_functions.py`` (``MatMul4Bit``) and ``bitsandbytes/functional.py``
(``dequantize_4bit``), releases 0.41-0.45 (https://github.com/bitsandbytes-foundation/bitsandbytes). Not modelled:
kernel-internal scratch other than the softmax-backward rule of :mod:`memlab.estimate.attention`.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CUDA_FP32_OPS", "CUDA_LOWER_OPS", "BNB_INPUT_KEPT_BEFORE", "bnb_version", "checkpoint_context_fn",
           "cuda_semantics", "rule_notes"]

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
# every name a rule of _CudaSemantics acts on: any other call goes straight through
_WATCHED = frozenset({"dropout", "scaled_dot_product_attention", *CUDA_FP32_OPS, *CUDA_LOWER_OPS})
_SDPA_DROPOUT_AT = 4  # F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ...)


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

    def __init__(self, bnb: tuple[str, str] | None = None) -> None:
        super().__init__()
        self.counts = {"dropout": 0, "fp32": 0, "lower": 0, "nf4": 0, "attention_dropout": 0}
        self.fused_attention = False  # rule 5 on: the step's CUDA attention kernel is flash or memory-efficient
        self.bnb_version, self.bnb_source = bnb or bnb_version()
        self.bnb_keeps_input = _version_tuple(self.bnb_version) < BNB_INPUT_KEPT_BEFORE
        self._depth = 0
        self._saved_forward: Any = None

    def __enter__(self):  # rule 4: Linear4bit runs bitsandbytes' CUDA matmul while the mode is on
        if self._depth == 0:
            from memlab.quant import Linear4bit

            self._saved_forward = Linear4bit.forward
            Linear4bit.forward = _bnb_forward(self)  # type: ignore[method-assign]
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            from memlab.quant import Linear4bit

            Linear4bit.forward = self._saved_forward  # type: ignore[method-assign]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in _WATCHED:  # no rule for it (most calls): as the branches below would leave it
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if name == "dropout" and func is torch.nn.functional.dropout:
            x = args[0] if args else kwargs["input"]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
            if training and not inplace and 0 < p < 1 and isinstance(x, torch.Tensor) and x.numel() > 0:
                self.counts["dropout"] += 1
                return torch.native_dropout(x, p, True)[0]
        elif name == "scaled_dot_product_attention":
            if self.fused_attention and func is torch.nn.functional.scaled_dot_product_attention:
                args, kwargs, p = _without_dropout(args, kwargs)
                self.counts["attention_dropout"] += int(p > 0)
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


def _without_dropout(args: tuple, kwargs: dict) -> tuple[tuple, dict, float]:
    """SDPA's arguments with ``dropout_p`` set to 0, and the ``dropout_p`` it had (rule 5)."""
    if len(args) > _SDPA_DROPOUT_AT:
        p = args[_SDPA_DROPOUT_AT]
        return (*args[:_SDPA_DROPOUT_AT], 0.0, *args[_SDPA_DROPOUT_AT + 1:]), kwargs, p
    p = kwargs.get("dropout_p", 0.0)
    return args, ({**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs), p


def cuda_semantics(bnb_version: str | None = None) -> _CudaSemantics:
    """A fresh mode to trace a CUDA step on CPU tensors (a ``TorchFunctionMode``: enter it around forward
    and backward). ``bnb_version``: the bitsandbytes release whose ``MatMul4Bit`` the NF4 rule follows (such as
    ``"0.43.1"``); None: the installed one (:func:`bnb_version`).

    Raises:
        ValueError: a ``bnb_version`` that is not a release number.
    """
    if bnb_version is None:
        return _CudaSemantics()
    if not isinstance(bnb_version, str) or not re.fullmatch(r"\d+(\.\d+){0,2}\S*", bnb_version):
        raise ValueError(f"bnb_version={bnb_version!r} is invalid; allowed: a bitsandbytes release such as '0.43.1', "
                         f"or None (the installed one)")
    return _CudaSemantics((bnb_version, "given"))


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
    if c["attention_dropout"]:
        out.append(f"CUDA rule: attention dropout runs inside CUDA's fused SDPA kernel (no mask, no s x s matrix "
                   f"kept), traced with the CPU flash kernel at dropout_p=0 ({c['attention_dropout']} calls in the "
                   f"last traced step)")
    if c["lower"]:
        out.append(f"CUDA rule: autocast's CUDA lower-precision mv/addmv/addr ({c['lower']} calls)")
    if c["nf4"]:
        kept = ("kept for backward (MatMul4Bit before 0.43.2)" if mode.bnb_keeps_input else
                "not kept (MatMul4Bit from 0.43.2 on)")
        out.append(f"CUDA rule: NF4 linears allocate what bitsandbytes' CUDA kernels allocate: the dequantized weight "
                   f"in the compute dtype (and the fp32 absmax of its blocks) while each matmul runs, again in "
                   f"backward, nothing else; the input {kept}; bitsandbytes {mode.bnb_version} ({mode.bnb_source}); "
                   f"{c['nf4']} calls in the last traced step")
    return out


# ---------------------------------------------------------------- rule 4: NF4 linears as bitsandbytes runs them on CUDA
BNB_INPUT_KEPT_BEFORE = (0, 43, 2)  # bitsandbytes' MatMul4Bit kept its input for backward before this release


def _version_tuple(version: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", version)[:3]
    return tuple(int(n) for n in nums) + (0,) * (3 - len(nums))


def bnb_version() -> tuple[str, str]:
    """The bitsandbytes version the NF4 rule follows and where it comes from: the one installed, else the first
    release whose ``MatMul4Bit`` keeps no input (0.43.2)."""
    from importlib import metadata

    try:
        return metadata.version("bitsandbytes"), "installed"
    except metadata.PackageNotFoundError:
        return ".".join(map(str, BNB_INPUT_KEPT_BEFORE)), "bitsandbytes not installed: a release from 0.43.2 on assumed"


def _bnb_dequantize(layer: Any, dtype: torch.dtype) -> torch.Tensor:
    # bitsandbytes.functional.dequantize_4bit on CUDA: the blocks' absmax dequantized to fp32 (double quant), then one
    # kernel writes the weight in `dtype`; nothing else. On fake tensors only the two allocations are made.
    from torch._subclasses.fake_tensor import FakeTensor

    packed = layer.weight_packed
    if not isinstance(packed, FakeTensor):
        return layer.dequantized_weight(dtype)  # real values (memlab's dequantize: CPU transients are real)
    n = layer.out_features * layer.in_features
    absmax = None
    if layer.double_quant:
        absmax = torch.empty(-(-n // layer.blocksize), dtype=torch.float32, device=packed.device)
    w = torch.empty((layer.out_features, layer.in_features), dtype=dtype, device=packed.device)
    del absmax
    return w


class _BnbMatMul4Bit(torch.autograd.Function):
    """``bitsandbytes.autograd._functions.MatMul4Bit`` as its CUDA path allocates: forward dequantizes the weight
    (a transient in the compute dtype) for ``F.linear``; backward dequantizes it again for the input gradient. The
    input is held on ``ctx`` (not saved: saved-tensor hooks never see it) by releases before 0.43.2."""

    @staticmethod
    def forward(ctx, x, bias, layer, keep_input):  # noqa: D401
        w = _bnb_dequantize(layer, x.dtype)
        out = torch.nn.functional.linear(x, w, bias)
        del w
        ctx.layer, ctx.x_dtype = layer, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.kept = x if keep_input and x.requires_grad else None
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = _bnb_dequantize(ctx.layer, grad.dtype)
            grad_x = grad.matmul(w).to(ctx.x_dtype)
            del w
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        ctx.kept = None
        return grad_x, grad_bias, None, None


def _bnb_forward(mode: "_CudaSemantics") -> Callable:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        # bitsandbytes.nn.Linear4bit.forward: input and bias cast to the compute dtype, out cast back
        mode.counts["nf4"] += 1
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _BnbMatMul4Bit.apply(x.to(self.compute_dtype), bias, self, mode.bnb_keeps_input)
        return out.to(x.dtype)

    return forward
