"""FlashAttention-2 forward and backward as Triton kernels, behind a ``torch.autograd.Function``.

The kernels live at module level in :mod:`memlab.attention.triton_kernels`, imported on first use
(it imports triton). CUDA tensors run them compiled; CPU tensors run them in Triton's interpreter
(``TRITON_INTERPRET=1``, which must be set before triton is first imported). Dao 2023,
"FlashAttention-2", arXiv:2307.08691.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

from memlab.attention.masks import check_attention_args, diagonal_offset
from memlab.core.validation import check_positive_int, invalid

__all__ = ["triton_available", "triton_interpreted", "load_triton_kernels", "TritonFlashAttentionFunction",
           "triton_flash_attention"]


def triton_available() -> bool:
    """Whether ``import triton`` (and ``triton.language``) works here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


_KERNELS: dict[str, Any] = {}


def load_triton_kernels() -> Any:
    """Import and return :mod:`memlab.attention.triton_kernels` on first use (it imports triton); its
    kernels are interpreted when ``TRITON_INTERPRET=1`` was set before triton's first import."""
    if "k" not in _KERNELS:
        from memlab.attention import triton_kernels

        _KERNELS["k"] = triton_kernels
    return _KERNELS["k"]


def _precision(q: torch.Tensor) -> str:
    # fp32 inputs: exact fp32 products ("ieee", not TF32); fp16/bf16: tensor-core dots, fp32 accumulation
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _pow2(n: int) -> int:
    # a power-of-two tile >= 16 covering n (tl.dot's smallest)
    return max(16, 1 << (max(1, n) - 1).bit_length())


def triton_interpreted() -> bool:
    """Whether Triton kernels run in the interpreter here (CPU tensors work) rather than compiled (CUDA):
    TRITON_INTERPRET=1 when triton was imported."""
    import triton.language as tl_
    from triton.runtime.interpreter import InterpretedFunction

    # the mode is fixed when triton.language is imported (its own @jit helpers, such as tl.zeros,
    # are made then); setting the environment variable later changes nothing
    return isinstance(tl_.zeros, InterpretedFunction)


def _triton_setup(q: torch.Tensor) -> Any:
    if q.device.type == "cpu" and "triton" not in sys.modules:
        # CPU tensors need Triton's interpreter, chosen when triton is imported: choose it now
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not triton_available():
        raise RuntimeError("triton_flash_attention needs triton (pip install triton; Linux x86_64); "
                           "everything else in memlab.attention runs without it")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"triton_flash_attention: q.device={q.device} is not supported; allowed: cpu (Triton's "
                         f"interpreter), cuda (compiled)")
    if q.device.type == "cpu" and not triton_interpreted():
        raise RuntimeError("triton_flash_attention on cpu tensors runs in Triton's interpreter, which is chosen when "
                           "triton is first imported: set TRITON_INTERPRET=1 before importing triton (or torch "
                           "modules that import it), e.g. os.environ['TRITON_INTERPRET'] = '1' at the top")
    return load_triton_kernels()


class TritonFlashAttentionFunction(torch.autograd.Function):
    """FA2 forward and backward as Triton kernels (interpreted on CPU, compiled on CUDA)."""

    @staticmethod
    def forward(ctx, q, k, v, mode, scale, g, block_m, block_n):  # type: ignore[override]
        # mode: the parsed causal mode; g: the GQA group size; returns (output, logsumexp)
        kern = _triton_setup(q)
        out_dtype = q.dtype
        if q.dtype == torch.bfloat16 and triton_interpreted():
            # the interpreter computes with NumPy, which has no bfloat16: run its kernels in fp32
            q, k, v = q.float(), k.float(), v.float()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, h, lq, d = q.shape
        hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
        o = torch.empty(b, h, lq, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
        grid = (-(-lq // block_m), b * h)
        kern.fwd[grid](q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                       h, g, lq, lk, d, dv, scale, diagonal_offset(mode, lq, lk),
                       CAUSAL=mode is not None, PREC=_precision(q), BM=block_m, BN=block_n, BD=_pow2(d),
                       BDV=_pow2(dv))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.opts = (mode, scale, g, block_m, block_n, hk, out_dtype)
        ctx.mark_non_differentiable(lse)
        return o.to(out_dtype), lse

    @staticmethod
    def backward(ctx, do, _dlse):  # type: ignore[override]
        # the logsumexp's gradient is ignored; None per option
        q, k, v, o, lse = ctx.saved_tensors
        mode, scale, g, block_m, block_n, hk, out_dtype = ctx.opts
        kern = _triton_setup(q)
        do = do.to(q.dtype).contiguous()
        b, h, lq, d = q.shape
        lk, dvd = k.shape[2], v.shape[-1]
        delta = (do.float() * o.float()).sum(-1).contiguous()  # D = rowsum(dO * O), (B, H, Lq)
        dq = torch.empty(b, h, lq, d, dtype=torch.float32, device=q.device)
        dk = torch.empty(b, hk, lk, d, dtype=torch.float32, device=q.device)
        dv = torch.empty(b, hk, lk, dvd, dtype=torch.float32, device=q.device)
        common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), v.stride(1), v.stride(2))
        off = diagonal_offset(mode, lq, lk)
        meta = dict(CAUSAL=mode is not None, PREC=_precision(q), BM=block_m, BN=block_n, BD=_pow2(d), BDV=_pow2(dvd))
        kern.bwd_dq[(-(-lq // block_m), b * h)](q, k, v, do, lse, delta, dq, *common,
                                                h, g, lq, lk, d, dvd, scale, off, **meta)
        kern.bwd_dkdv[(-(-lk // block_n), b * hk)](q, k, v, do, lse, delta, dk, dv, *common,
                                                   h, hk, g, lq, lk, d, dvd, scale, off, **meta)
        return dq.to(out_dtype), dk.to(out_dtype), dv.to(out_dtype), None, None, None, None, None


def triton_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                           scale: float | None = None, block_q: int = 64, block_k: int = 64,
                           return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward and backward as Triton kernels, same options as :func:`flash_attention`.

    CUDA tensors run compiled; CPU tensors run in Triton's interpreter (slow: small sizes only).
    The interpreter is chosen when triton is first imported: with CPU tensors, set
    ``TRITON_INTERPRET=1`` before anything imports triton (memlab sets it itself when triton is not
    imported yet; importing ``torch.nn.attention.bias`` or ``torch._dynamo`` first imports triton).
    Operands keep their dtype in ``tl.dot`` (tensor cores for fp16 / bf16; exact "ieee" products
    for fp32, not TF32), accumulating in fp32; fp64 is not supported here (use
    :func:`flash_attention`). Under the interpreter bf16 runs in fp32 (NumPy has no bfloat16).

    Args:
        block_q: query rows per program, a power of two >= 16 (``tl.dot``'s smallest tile).
        block_k: keys per loop step, a power of two >= 16.
        return_lse: also return the logsumexp (fp32, not differentiable).

    Raises:
        ValueError: a bad tensor or option, fp64, or a block size that is not a power of two >= 16.
        RuntimeError: triton is missing, or CPU tensors without Triton's interpreter.
    """
    mode, scale, g = check_attention_args("triton_flash_attention", q, k, v, causal, scale)
    if q.dtype == torch.float64:
        raise ValueError("triton_flash_attention: q.dtype=torch.float64 is not supported; allowed: float16, "
                         "bfloat16, float32 (use flash_attention for fp64)")
    for name, val in (("block_q", block_q), ("block_k", block_k)):
        check_positive_int(f"triton_flash_attention: {name}", val)
        if val < 16 or val & (val - 1):
            raise invalid(f"triton_flash_attention: {name}", val, "a power of two >= 16")
    o, lse = TritonFlashAttentionFunction.apply(q, k, v, mode, scale, g, block_q, block_k)
    return (o, lse) if return_lse else o
