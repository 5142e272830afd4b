"""A linear layer whose frozen weight is stored in NF4, as QLoRA's base model (bitsandbytes.nn.Linear4bit).

Dettmers, Pagnoni, Holtzman, Zettlemoyer 2023, "QLoRA", arXiv:2305.14314: the weight is kept in
4 bits with double-quantized scales and dequantized to the compute dtype for each matmul.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memlab.core.validation import check_choice, check_positive_int, invalid
from memlab.quant.codebooks import cached_codebook
from memlab.quant.blockwise import (FLOAT_DTYPES, NF4_BLOCKSIZES, check_blocksize, dequantize_nf4, double_dequantize,
                                    double_quantize, quantize_nf4)

__all__ = ["Linear4bit", "fake_nf4_state"]


def fake_nf4_state(weight: torch.Tensor, blocksize: int, double_quant: bool,
                   blocksize2: int = 256) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(packed, scales)``: the buffers :meth:`Linear4bit.quantize_` leaves for ``weight``, made at their shapes on
    its device without the quantization's arithmetic (for fake tensors, whose values a trace never reads): ``packed``
    uint8 ``(ceil(n / 2), 1)``; ``scales`` the double-quantized ``(codes, absmax2, offset)`` (uint8 one per block,
    float32 one per ``blocksize2`` blocks, a float32 scalar) or ``(absmax,)`` (float32 one per block). Shapes,
    dtypes, strides and storage bytes equal the arithmetic's (``tests/ch06/test_quant_fake_state.py``)."""
    n, dev = weight.numel(), weight.device
    blocks = -(-n // blocksize)
    packed = torch.empty((-(-n // 2), 1), dtype=torch.uint8, device=dev)
    if not double_quant:
        return packed, (torch.empty(blocks, dtype=torch.float32, device=dev),)
    return packed, (torch.empty(blocks, dtype=torch.uint8, device=dev),
                    torch.empty(-(-blocks // blocksize2), dtype=torch.float32, device=dev),
                    torch.empty((), dtype=torch.float32, device=dev))


def _dequantize_state(state: tuple, shape: tuple[int, int], dtype: torch.dtype, blocksize: int) -> torch.Tensor:
    # the weight from a Linear4bit's 4-bit state ``(packed, absmax)`` or ``(packed, codes, absmax2, offset)``
    if len(state) == 2:
        packed, absmax = state
    else:
        packed, codes, absmax2, offset = state
        absmax = double_dequantize(codes, absmax2, offset)
    return dequantize_nf4(packed, absmax, shape, dtype, blocksize)


class _MatMul4bit(torch.autograd.Function):
    """``F.linear(x, dequantize(W), bias)`` whose backward keeps only the 4-bit state, as QLoRA does.

    Letting autograd record ``F.linear`` on the dequantized weight would save that 16-bit (or 32-bit)
    copy of every frozen weight until backward: 4x (8x) the NF4 bytes, per layer, for the whole
    forward. Here the dequantized weight lives only inside forward; backward dequantizes again for the
    input gradient ``grad @ W`` (the weight is frozen: no weight gradient, so the input itself is not
    saved). The 4-bit state is held by reference (it is the layer's own storage, alive anyway), as
    bitsandbytes' ``MatMul4Bit`` does; nothing goes through ``save_for_backward``, so saved-tensor
    hooks (activation offloading, checkpointing) never see or copy the weight.

    Under autocast the matmul runs in autocast's dtype (as ``F.linear`` would) and the input gradient is
    computed in that same dtype, then cast back to the input's dtype.
    """

    @staticmethod
    def forward(ctx, x, bias, state, shape, blocksize, compute_dtype):  # noqa: D401
        w = _dequantize_state(state, shape, compute_dtype, blocksize)
        out = nn.functional.linear(x, w, bias)
        ctx.state, ctx.shape, ctx.blocksize = state, shape, blocksize
        ctx.x_dtype, ctx.mm_dtype = x.dtype, out.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = _dequantize_state(ctx.state, ctx.shape, ctx.mm_dtype, ctx.blocksize)
            grad_x = grad.to(ctx.mm_dtype).matmul(w).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_bias, None, None, None, None


class Linear4bit(nn.Module):
    """A linear layer whose frozen weight is stored in NF4 (optionally with double-quantized scales).

    forward: ``y = x.to(compute_dtype) @ dequantize(W).T + bias``, computed in ``compute_dtype``
    and cast back to x's dtype (as bitsandbytes.nn.Linear4bit does). The weight is not a
    parameter: it never gets a gradient. The bias (kept in compute_dtype) may be trained.
    For backward only the 4-bit state is kept; the weight is dequantized again for the input
    gradient (:class:`_MatMul4bit`), so a layer keeps no 16-bit weight between forward and backward.
    ``.to(dtype)`` / ``.half()`` cast the bias but keep the quantization scales float32.

    Args:
        compute_dtype: the dtype the matmul runs in (float32, float16 or bfloat16).
        blocksize: weights per absmax block, one of :data:`NF4_BLOCKSIZES`.
        double_quant: quantize the absmax too (QLoRA's double quantization).

    Raises:
        ValueError: naming the argument, for a bad size, dtype or block size.
    """

    _QUANT_STATE = ("absmax", "absmax2", "absmax_offset")

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 compute_dtype: torch.dtype = torch.bfloat16, blocksize: int = 64, double_quant: bool = True) -> None:
        super().__init__()
        check_positive_int("in_features", in_features)
        check_positive_int("out_features", out_features)
        check_choice("compute_dtype", compute_dtype, FLOAT_DTYPES)
        check_blocksize(blocksize, NF4_BLOCKSIZES)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.blocksize, self.double_quant = compute_dtype, blocksize, double_quant
        w = torch.empty(out_features, in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's initialisation
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype)) if bias else None
        self.quantize_(w)

    def quantize_(self, weight: torch.Tensor) -> None:
        """Store ``weight`` (``(out_features, in_features)``, float) in NF4, replacing the layer's buffers.

        Raises:
            ValueError: for a weight of another shape.
        """
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise invalid("weight.shape", tuple(weight.shape), f"{(self.out_features, self.in_features)}")
        if isinstance(weight, FakeTensor):  # an estimate's trace: the buffers at their sizes, no arithmetic
            packed, scales = fake_nf4_state(weight, self.blocksize, self.double_quant)
        else:
            packed, absmax = quantize_nf4(weight.detach(), self.blocksize)
            if packed.device.type != "meta" and not isinstance(packed, FakeTensor):
                # dequantize's byte-pair table built now, not inside the first forward (a tracker there counted its
                # 2 KiB)
                cached_codebook("nf4_pairs", str(packed.device))
            scales = double_quantize(absmax) if self.double_quant else (absmax,)
        self.register_buffer("weight_packed", packed, persistent=True)
        names = ("absmax_codes", "absmax2", "absmax_offset") if self.double_quant else ("absmax",)
        for name, t in zip(names, scales):
            self.register_buffer(name, t)
        if self.double_quant:
            self.absmax = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16, blocksize: int = 64,
                    double_quant: bool = True) -> "Linear4bit":
        """A new Linear4bit from an ``nn.Linear`` (left unchanged): its weight quantized in its own dtype, as
        bitsandbytes does, and its bias copied in ``compute_dtype``.

        Raises:
            TypeError: when ``linear`` is not an ``nn.Linear``.
            ValueError: for a bad block size.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear: linear={type(linear).__name__} is invalid; allowed: an nn.Linear")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.compute_dtype, m.blocksize, m.double_quant = compute_dtype, blocksize, double_quant
        check_blocksize(blocksize, NF4_BLOCKSIZES)
        m.weight_dtype = linear.weight.dtype
        m.quantize_(linear.weight)
        m.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(compute_dtype).clone())
        return m

    def absmax_fp32(self) -> torch.Tensor:
        """The first-level float32 absmax, one per block, dequantized when double-quantized."""
        if self.double_quant:
            return double_dequantize(self.absmax_codes, self.absmax2, self.absmax_offset)
        return self.absmax

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored weight, dequantized to ``dtype`` (None: ``compute_dtype``)."""
        return dequantize_nf4(self.weight_packed, self.absmax_fp32(), (self.out_features, self.in_features),
                              dtype or self.compute_dtype, self.blocksize)

    def quant_state(self) -> tuple[torch.Tensor, ...]:
        """The stored 4-bit state: ``(weight_packed, absmax)`` or, with double quant,
        ``(weight_packed, absmax_codes, absmax2, absmax_offset)``."""
        if self.double_quant:
            return self.weight_packed, self.absmax_codes, self.absmax2, self.absmax_offset
        return self.weight_packed, self.absmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` computed in ``compute_dtype``, returned in ``x``'s dtype."""
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _MatMul4bit.apply(x.to(self.compute_dtype), bias, self.quant_state(),
                                (self.out_features, self.in_features), self.blocksize, self.compute_dtype)
        return out.to(x.dtype)

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda()...: the quantization scales move but stay float32 (as in bitsandbytes)
        kept = {n: self._buffers[n] for n in self._QUANT_STATE if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for n, old in kept.items():
            new = self._buffers[n]
            if new.dtype != old.dtype:  # cast by fn: take the original values to the new device instead
                self._buffers[n] = old.to(device=new.device)
        return self

    def storage_bytes(self) -> int:
        """Bytes of the stored weight and its scales: every buffer (the bias, a parameter, is not counted)."""
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.compute_dtype}, blocksize={self.blocksize}, double_quant={self.double_quant}")
