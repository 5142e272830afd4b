"""Fused linear + cross-entropy as Triton kernels, behind a ``torch.autograd.Function``.

The kernels live at module level in :mod:`memlab.loss.triton_kernels`, imported on first use (it
imports triton). CUDA tensors run them compiled; CPU tensors run them in Triton's interpreter
(``TRITON_INTERPRET=1``, which must be set before triton is first imported), as chapter 05's
FlashAttention kernels do. The forward keeps the per-token logsumexp and target logit; the backward
recomputes each logits tile inside the kernel (Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models", arXiv:2411.09009).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

from memlab.core.validation import invalid
from memlab.loss.reference import check_loss_args

__all__ = ["triton_available", "triton_interpreted", "load_triton_kernels", "TritonFusedLinearCrossEntropy",
           "triton_fused_linear_cross_entropy"]

# tokens, classes and hidden units per tile (powers of two >= 16, tl.dot's smallest)
BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_HIDDEN = 32, 64, 32


def triton_available() -> bool:
    """Whether ``import triton`` (and ``triton.language``) works here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def triton_interpreted() -> bool:
    """Whether Triton kernels run in the interpreter here (CPU tensors work) rather than compiled (CUDA):
    TRITON_INTERPRET=1 when triton was imported."""
    import triton.language as tl_
    from triton.runtime.interpreter import InterpretedFunction

    # the mode is fixed when triton.language is imported (its own @jit helpers are made then)
    return isinstance(tl_.zeros, InterpretedFunction)


_KERNELS: dict[str, Any] = {}


def load_triton_kernels() -> Any:
    """Import and return :mod:`memlab.loss.triton_kernels` on first use (it imports triton)."""
    if "k" not in _KERNELS:
        from memlab.loss import triton_kernels

        _KERNELS["k"] = triton_kernels
    return _KERNELS["k"]


def _setup(x: torch.Tensor) -> Any:
    # the kernels module, after checking that they can run on x's device
    if x.device.type == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # chosen at triton's import: choose it now
    if not triton_available():
        raise RuntimeError("triton_fused_linear_cross_entropy needs triton (pip install triton; Linux x86_64); "
                           "fused_linear_cross_entropy is the same loss in PyTorch")
    if x.device.type not in ("cpu", "cuda"):
        raise invalid("triton_fused_linear_cross_entropy: hidden.device", str(x.device),
                      "cpu (Triton's interpreter), cuda (compiled)")
    if x.device.type == "cpu" and not triton_interpreted():
        raise RuntimeError("triton_fused_linear_cross_entropy on cpu tensors runs in Triton's interpreter, which is "
                           "chosen when triton is first imported: set TRITON_INTERPRET=1 before importing triton "
                           "(or torch modules that import it)")
    return load_triton_kernels()


class TritonFusedLinearCrossEntropy(torch.autograd.Function):
    """Linear head + cross-entropy as two Triton kernels; saves the inputs and the fp32 logsumexp.

    ``apply(hidden, weight, targets, bias, ignore_index, chunk_size, softcap, z_loss, divisor)`` as
    :class:`~memlab.loss.FusedLinearCrossEntropy`; ``chunk_size`` tokens go to each kernel launch.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None, ignore_index: int, chunk_size: int, softcap: float | None,
                z_loss: float, divisor: Any) -> torch.Tensor:
        if hidden.dtype == torch.float64:  # tl.dot has no fp64 products on every GPU
            raise invalid("triton_fused_linear_cross_entropy: hidden.dtype", hidden.dtype,
                          "float16, bfloat16, float32 (fused_linear_cross_entropy for float64)")
        kern = _setup(hidden)
        dtype = hidden.dtype
        h, w, b = _kernel_operands(hidden, weight, bias)
        n, d = h.shape
        v = w.shape[0]
        valid = targets != ignore_index
        t = torch.where(valid, targets, -1).contiguous()  # -1 matches no class
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        tgt = torch.empty(n, dtype=torch.float32, device=h.device)
        prec = "ieee" if h.dtype == torch.float32 else "tf32"
        for s in range(0, n, chunk_size):
            m = min(chunk_size, n - s)
            kern.lce_fwd[(-(-m // BLOCK_TOKENS),)](
                h[s:], w, b if b is not None else w, t[s:], lse[s:], tgt[s:], m, v, d, h.stride(0), w.stride(0),
                float(softcap or 1.0), HAS_BIAS=b is not None, SOFTCAP=softcap is not None, PREC=prec,
                BM=BLOCK_TOKENS, BV=BLOCK_VOCAB, BD=BLOCK_HIDDEN)
        per_token = lse - tgt
        if z_loss:
            per_token = per_token + z_loss * lse.square()
        denom = valid.sum().clamp(min=1) if divisor is None else divisor
        ctx.save_for_backward(h, w, b, t, lse)
        ctx.opts = (chunk_size, softcap, z_loss, denom, dtype)
        return torch.where(valid, per_token, 0).sum() / denom

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # None for targets and the options
        h, w, b, t, lse = ctx.saved_tensors
        chunk_size, softcap, z_loss, denom, dtype = ctx.opts
        kern = _setup(h)
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        need_b = bool(need_b and b is not None)
        n, d = h.shape
        v = w.shape[0]
        scale = torch.where(t >= 0, grad_loss.float() / denom, 0).float().contiguous()
        dh = torch.zeros(n, d, dtype=torch.float32, device=h.device) if need_h else lse
        dw = torch.zeros(v, d, dtype=torch.float32, device=h.device) if need_w else lse
        db = torch.zeros(v, dtype=torch.float32, device=h.device) if need_b else lse
        prec = "ieee" if h.dtype == torch.float32 else "tf32"
        for s in range(0, n, chunk_size):
            m = min(chunk_size, n - s)
            kern.lce_bwd[(-(-m // BLOCK_TOKENS), -(-v // BLOCK_VOCAB))](
                h[s:], w, b if b is not None else w, t[s:], lse[s:], scale[s:], dh[s:] if need_h else dh, dw, db,
                m, v, d, h.stride(0), w.stride(0), float(softcap or 1.0), float(z_loss),
                HAS_BIAS=b is not None, SOFTCAP=softcap is not None, ZLOSS=bool(z_loss), NEED_H=bool(need_h),
                NEED_W=bool(need_w), NEED_B=need_b, PREC=prec, BM=BLOCK_TOKENS, BV=BLOCK_VOCAB, BD=BLOCK_HIDDEN)
        return (dh.to(dtype) if need_h else None, dw.to(dtype) if need_w else None, None,
                db.to(dtype) if need_b else None, None, None, None, None, None)


def _kernel_operands(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    # contiguous in the last dim; under the interpreter bf16 runs in fp32 (NumPy has no bfloat16)
    interp = hidden.device.type == "cpu"
    ops = []
    for x in (hidden, weight, bias):
        if x is not None:
            if interp and x.dtype == torch.bfloat16:
                x = x.float()
            if x.stride(-1) != 1:
                x = x.contiguous()
        ops.append(x)
    return ops[0], ops[1], ops[2]


def triton_fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                      bias: torch.Tensor | None = None, ignore_index: int = -100,
                                      chunk_size: int = 1024, softcap: float | None = None,
                                      z_loss: float = 0.0) -> torch.Tensor:
    """:func:`~memlab.loss.fused_linear_cross_entropy` with its forward and backward as Triton kernels.

    CUDA tensors run compiled; CPU tensors run in Triton's interpreter (slow: small sizes only),
    chosen when triton is first imported (memlab sets ``TRITON_INTERPRET=1`` itself when triton is
    not imported yet). Logits tiles are computed in fp32 from the inputs (``tl.dot`` accumulates in
    fp32; exact "ieee" products for fp32, not TF32); gradients accumulate in fp32 buffers and are
    cast to the inputs' dtype. Under the interpreter bf16 runs in fp32 (NumPy has no bfloat16).
    fp64 is not supported here (use :func:`~memlab.loss.fused_linear_cross_entropy`).

    Args:
        chunk_size: tokens per kernel launch; memory does not depend on it (no logits tile leaves a kernel).

    Raises:
        ValueError: as :func:`~memlab.loss.fused_linear_cross_entropy`, or fp64.
        RuntimeError: triton is missing, or CPU tensors without Triton's interpreter.
    """
    h, t = check_loss_args("triton_fused_linear_cross_entropy", hidden, weight, targets, bias,
                           chunk_size=chunk_size, ignore_index=ignore_index, softcap=softcap, z_loss=z_loss)
    if h.dtype == torch.float64:
        raise invalid("triton_fused_linear_cross_entropy: hidden.dtype", h.dtype,
                      "float16, bfloat16, float32 (fused_linear_cross_entropy for float64)")
    return TritonFusedLinearCrossEntropy.apply(h, weight, t, bias, ignore_index, chunk_size,
                                               None if softcap is None else float(softcap), float(z_loss), None)
