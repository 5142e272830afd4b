"""4-bit NormalFloat (NF4), blockwise quantization, double quantization and a 4-bit linear layer.

QLoRA (Dettmers, Pagnoni, Holtzman, Zettlemoyer 2023, arXiv:2305.14314) stores a frozen base
model in NF4: each block of ``blocksize`` weights is scaled by its absolute maximum into [-1, 1]
and every value is replaced by the index of the nearest of 16 levels,

    q_i = argmin_j |w_i / absmax_b - c_j|,        w_i ~= c_{q_i} * absmax_b,

where the levels ``c_j`` are quantiles of the standard normal distribution (so each level is used
about equally often by normally distributed weights) normalised to [-1, 1], with an exact zero.
Two 4-bit indices share a byte. The fp32 ``absmax`` (32 / 64 = 0.5 bits per parameter at
blocksize 64) is itself quantized to 8 bits in blocks of 256 ("double quantization",
0.5 -> 8/64 + 32/(64*256) = 0.127 bits per parameter).

Everything here is written to be **bit-exact with bitsandbytes 0.50 on CPU**; the behaviour it
copies was read in ``bitsandbytes/functional.py`` (``create_normal_map``, ``create_dynamic_map``,
``quantize_4bit``) and ``bitsandbytes/backends/default/ops.py`` (the ``quantize_4bit`` and
``quantize_blockwise`` kernels, ``_dequantize_4bit_compute``):

* the codebook: quantiles at ``linspace(0.9677083, 0.5, 9)`` (positive side, 8 values) and
  ``linspace(0.9677083, 0.5, 8)`` (negative side, 7 values) in float32, ``ndtri`` in float64,
  cast to float32, sorted, divided by the max in float32;
* scaling: a full block is multiplied by ``1 / absmax`` (absmax clamped at 1e-38 so an all-zero
  block maps to code 0.0), a trailing partial block is *divided* by its absmax; then clamp to
  [-1, 1]. (So an all-zero full block stores absmax 0.0 and an all-zero partial block 1e-38:
  bitsandbytes' quirk, copied.)
* nearest code: ``bucketize`` on the float32 midpoints ``(c_j + c_{j+1}) / 2``, so a value
  exactly on a midpoint goes to the *lower* code (the tie rule);
* packing: element ``2k`` in the high nibble, ``2k + 1`` in the low nibble; an odd count is
  padded with one zero value (which quantizes to code 7, the 0.0 level, in the last byte's low
  nibble); the packed tensor has shape ``(ceil(n / 2), 1)`` as bitsandbytes returns it;
* dequantization: ``code[q] * absmax`` in float32, then cast to the target dtype.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
from torch import nn

__all__ = [
    "NF4_OFFSET", "nf4_codebook", "fp4_codebook", "int4_codebook", "dynamic_map",
    "nf4_codes", "quantize_nf4", "dequantize_nf4", "pack_nibbles", "unpack_nibbles",
    "quantize_blockwise", "dequantize_blockwise", "double_quantize", "double_dequantize",
    "Linear4bit", "bits_per_param", "Adam8bit",
]

NF4_OFFSET = 0.9677083  # bitsandbytes' create_normal_map default: the outermost quantile used
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def nf4_codebook(offset: float | None = None) -> torch.Tensor:
    """The 16 NF4 levels, derived from normal quantiles (QLoRA sec. 3, eq. 4), float32, sorted.

    8 quantiles ``ndtri(p)`` at ``p = linspace(offset, 0.5, 9)[:-1]`` for the positive half and 7 at
    ``linspace(offset, 0.5, 8)[:-1]`` (negated) for the negative half, plus an exact 0, then normalised
    so the largest is 1.0. With the default offset (0.9677083, bitsandbytes' choice) equal bitwise to
    ``bitsandbytes.functional.get_4bit_type("nf4")``.
    """
    offset = NF4_OFFSET if offset is None else offset
    if not 0.5 < offset < 1.0:
        raise ValueError(f"nf4_codebook: offset must be in (0.5, 1), got {offset!r}")
    # float32 whatever torch.get_default_dtype() is (bitsandbytes' linspace is float32; a bf16 default once moved
    # 2.4% of the codes for the rest of the process, the cache keeping the first table built)
    pos = torch.linspace(offset, 0.5, 9, dtype=torch.float32)[:-1].double()  # 8 probabilities, the last (0.5) dropped
    neg = torch.linspace(offset, 0.5, 8, dtype=torch.float32)[:-1].double()  # 7 probabilities
    values = torch.cat([torch.special.ndtri(pos), torch.zeros(1, dtype=torch.float64), -torch.special.ndtri(neg)])
    values = values.float().sort().values
    return values / values.max()


@functools.lru_cache(maxsize=None)
def _real_codebook(name: str, device: str) -> torch.Tensor:
    """Read-only cached codebooks for the hot paths (never handed to a caller to mutate), always real tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    table = {"nf4": nf4_codebook, "dynamic": lambda: dynamic_map(True), "udynamic": lambda: dynamic_map(False),
             # byte -> its two NF4 values (high nibble, low nibble): one gather per byte when dequantizing
             "nf4_pairs": lambda: torch.stack([nf4_codebook()[torch.arange(256) >> 4], nf4_codebook()[torch.arange(256) & 0xF]], 1)}
    # built for real, and unseen, even when first asked for inside a FakeTensorMode and a MemoryTracker
    # (memlab.estimate's traces): every dispatch mode is set aside, or the tracker would count the
    # cache's tables as the first trace's activations
    with _disable_current_modes():
        out = table[name]().to(device)
    assert out.dtype == torch.float32, f"memlab.quant: codebook {name} built as {out.dtype}"
    return out


def _codebook_cached(name: str, device: str, like: torch.Tensor | None = None) -> torch.Tensor:
    """The cached codebook; under a FakeTensorMode (``like`` is fake: memlab.estimate's traces) a fake copy."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(like, FakeTensor):
        return like.new_zeros(_real_codebook(name, "cpu").shape, dtype=torch.float32)  # values do not matter on fake tensors, shapes do
    return _real_codebook(name, device)


def fp4_codebook() -> torch.Tensor:
    """A 4-bit float (1 sign, 2 exponent, 1 mantissa bit, bias 2 as in bitsandbytes' FP4), sorted, max 1."""
    mags = [0.0, 0.0625, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]  # subnormals 0 and 0.5*2^-3, then 1.m x 2^(e-2) x 4
    values = torch.tensor(sorted({*mags, *(-m for m in mags)}) + [0.0], dtype=torch.float32)  # -0 == 0: 15 distinct + a spare 0
    values = values.sort().values
    return values / values.max()


def int4_codebook() -> torch.Tensor:
    """Symmetric absmax int4: the 15 levels k/7, k = -7..7, plus a spare zero (16 entries), sorted."""
    return torch.cat([torch.arange(-7, 8, dtype=torch.float32) / 7, torch.zeros(1, dtype=torch.float32)]).sort().values


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The 8-bit dynamic (tree) quantization map of Dettmers 2015 (arXiv:1511.04561), as bitsandbytes builds it.

    For exponent i = 0..6 a set of evenly spaced fractions in [0.1, 1] (midpoints of a linspace)
    times 10^(i-6); signed maps mirror them. Plus 0 and 1.0; 256 values sorted. Used for double
    quantization (signed) and for the 8-bit Adam states (signed for m, unsigned for v).
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        n = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        b = torch.linspace(0.1, 1, int(n), dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional > 0:
        b = torch.linspace(0.1, 1, additional + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


# ----------------------------------------------------------------------------- blockwise scaling
def _check_float(w: torch.Tensor, what: str) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _FLOATS:
        raise ValueError(f"{what}: expected float32, float16 or bfloat16, got {w.dtype}")
    if w.numel() == 0:
        raise ValueError(f"{what}: empty tensor")


def _check_blocksize(blocksize: int, allowed: Sequence[int] | None = None) -> None:
    if type(blocksize) is not int or blocksize <= 0:
        raise ValueError(f"blocksize must be a positive int, got {blocksize!r}")
    if allowed is not None and blocksize not in allowed:
        raise ValueError(f"blocksize must be one of {tuple(allowed)}, got {blocksize}")


def _scale_blocks(w: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten to float32, per-block absmax, and the values scaled into [-1, 1] (bitsandbytes' arithmetic)."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    rem = n % blocksize
    full = n - rem
    blocks = flat[:full].reshape(full // blocksize, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1), -1, 1).reshape(-1)
    if rem:  # the trailing partial block: divided, not multiplied by the reciprocal (as bitsandbytes does)
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    return scaled, absmax


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level of the sorted ``code``; a tie (exactly on a midpoint) goes to the lower level."""
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, midpoints, out_int32=True)


def pack_nibbles(q: torch.Tensor, pad: int = 7) -> torch.Tensor:
    """Two 4-bit codes per byte: element 2k in the high nibble, 2k+1 in the low nibble.

    An odd count is padded with code ``pad`` (7, NF4's 0.0 level: bitsandbytes pads with the value
    0.0 before quantizing). Returns a flat uint8 tensor of ceil(n / 2) bytes, so that
    ``pack_nibbles(nf4_codes(w)[0])`` equals ``quantize_nf4(w)[0].flatten()``.
    """
    q = q.reshape(-1)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("pack_nibbles: codes must be in 0..15")
    q = q.to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_full((1,), pad)])
    return (q[0::2] << 4) | q[1::2]


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: the first ``n`` codes as int64."""
    p = packed.reshape(-1)
    if p.dtype != torch.uint8:
        p = p.view(torch.uint8)
    q = torch.empty(p.numel() * 2, dtype=torch.int64, device=p.device)
    q[0::2] = (p >> 4).long()
    q[1::2] = (p & 0xF).long()
    if n > q.numel():
        raise ValueError(f"unpack_nibbles: {p.numel()} bytes hold at most {q.numel()} codes, asked for {n}")
    return q[:n]


# ----------------------------------------------------------------------------- NF4
def nf4_codes(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise NF4 codes before packing: ``(codes uint8 of length numel, absmax float32 per block)``."""
    _check_float(w, "nf4_codes")
    _check_blocksize(blocksize)
    scaled, absmax = _scale_blocks(w.detach(), blocksize)
    return _nearest(scaled, _codebook_cached("nf4", str(scaled.device), scaled)).to(torch.uint8), absmax


def quantize_nf4(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4-quantize ``w`` blockwise: returns ``(packed, absmax)``.

    ``packed``: uint8 of shape ``(ceil(n / 2), 1)``, two codes per byte; ``absmax``: float32, one
    per block (the last block may be partial). Equal to
    ``bitsandbytes.functional.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")``'s output and
    ``quant_state.absmax`` (compress_statistics=False).
    """
    _check_float(w, "quantize_nf4")
    _check_blocksize(blocksize, (32, 64, 128, 256, 512, 1024, 2048, 4096))
    scaled, absmax = _scale_blocks(w.detach(), blocksize)
    if scaled.numel() % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])  # pad with the value 0.0 (-> code 7)
    q = _nearest(scaled, _codebook_cached("nf4", str(scaled.device), scaled)).to(torch.uint8)
    packed = ((q[0::2] << 4) | q[1::2]).unsqueeze(1)
    return packed, absmax


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape: Sequence[int] | torch.Size,
                   dtype: torch.dtype = torch.float32, blocksize: int = 64) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4`: ``code[q] * absmax`` in float32, cast to ``dtype``, reshaped to ``shape``."""
    if dtype not in _FLOATS:
        raise ValueError(f"dequantize_nf4: dtype must be float32, float16 or bfloat16, got {dtype}")
    _check_blocksize(blocksize)
    n = math.prod(shape)
    nblocks = -(-n // blocksize)
    if absmax.numel() != nblocks:
        raise ValueError(f"dequantize_nf4: {n} values in blocks of {blocksize} need {nblocks} absmax, got {absmax.numel()}")
    p = packed.reshape(-1)
    p = p if p.dtype == torch.uint8 else p.view(torch.uint8)
    if 2 * p.numel() < n:
        raise ValueError(f"dequantize_nf4: {p.numel()} bytes hold {2 * p.numel()} codes, shape {tuple(shape)} needs {n}")
    pairs = _codebook_cached("nf4_pairs", str(p.device), absmax)
    values = pairs.index_select(0, p.long()).reshape(-1)[:n]  # (bytes, 2) -> high, low, ...; index_select: 4x faster than [] on CPU
    return _scale_back(values, absmax, blocksize).reshape(tuple(shape)).to(dtype)


def _scale_back(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``values * absmax`` of each value's block, in float32 (full blocks as one broadcast multiply)."""
    n = values.numel()
    full = n - n % blocksize
    absmax = absmax.float()
    out = (values[:full].view(-1, blocksize) * absmax[: full // blocksize].unsqueeze(1)).reshape(-1)
    if full < n:
        out = torch.cat([out, values[full:] * absmax[full // blocksize]])
    return out


# ----------------------------------------------------------------------------- 8-bit blockwise (dynamic map)
def quantize_blockwise(x: torch.Tensor, code: torch.Tensor | None = None,
                       blocksize: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise quantization with a sorted 256-level ``code`` (default: the signed dynamic map).

    Returns ``(q uint8 of x's shape, absmax float32 per block)``. Same arithmetic as bitsandbytes'
    ``quantize_blockwise`` default kernel (scale by 1/absmax, nearest code by midpoints).
    """
    _check_float(x, "quantize_blockwise")
    _check_blocksize(blocksize)
    code = _codebook_cached("dynamic", str(x.device), x) if code is None else code
    scaled, absmax = _scale_blocks(x.detach(), blocksize)
    q = _nearest(scaled, code.to(scaled.device).float()).to(torch.uint8)
    return q.reshape(x.shape), absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor | None = None,
                         blocksize: int = 256, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``code[q] * absmax`` in float32, cast to ``dtype``."""
    if q.dtype != torch.uint8:
        raise ValueError(f"dequantize_blockwise: codes must be uint8, got {q.dtype}")
    _check_blocksize(blocksize)
    code = _codebook_cached("dynamic", str(q.device), absmax) if code is None else code.to(q.device).float()
    values = code.index_select(0, q.reshape(-1).long())
    return _scale_back(values, absmax, blocksize).reshape(q.shape).to(dtype)


def double_quantize(absmax: torch.Tensor, blocksize: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the first-level ``absmax`` (QLoRA sec. 3 "Double Quantization").

    ``offset = absmax.mean()``; ``(codes, absmax2) = quantize_blockwise(absmax - offset, dynamic_map(), blocksize)``.
    Returns ``(codes uint8, absmax2 float32, offset float32 scalar)``. bitsandbytes'
    ``quantize_4bit(..., compress_statistics=True)`` does the same (functional.py) but its CPU
    kernel is a C lookup routine: see tests/test_quant.py for how the two compare.
    """
    if absmax.dtype != torch.float32:
        raise ValueError(f"double_quantize: absmax must be float32, got {absmax.dtype}")
    offset = absmax.mean()
    codes, absmax2 = quantize_blockwise(absmax - offset, _codebook_cached("dynamic", str(absmax.device), absmax), blocksize)
    return codes, absmax2, offset


def double_dequantize(codes: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
                      blocksize: int = 256) -> torch.Tensor:
    """Inverse of :func:`double_quantize`: the float32 first-level absmax, ``code[q] * absmax2 + offset``."""
    return dequantize_blockwise(codes, absmax2, None, blocksize) + offset


def bits_per_param(blocksize: int = 64, double_quant: bool = True, blocksize2: int = 256) -> float:
    """Storage bits per weight of NF4: 4 for the code, plus the scales.

    Without double quant: 4 + 32/blocksize. With it: 4 + 8/blocksize + 32/(blocksize*blocksize2)
    (the fp32 offset, one per tensor, is ignored). 4.5 and 4.127 at blocksize 64.
    """
    if double_quant:
        return 4 + 8 / blocksize + 32 / (blocksize * blocksize2)
    return 4 + 32 / blocksize


# ----------------------------------------------------------------------------- Linear4bit
def _dequantize_state(state: tuple, shape: tuple[int, int], dtype: torch.dtype, blocksize: int) -> torch.Tensor:
    """The weight from a Linear4bit's 4-bit state ``(packed, absmax)`` or ``(packed, codes, absmax2, offset)``."""
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
    """

    _QUANT_STATE = ("absmax", "absmax2", "absmax_offset")

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 compute_dtype: torch.dtype = torch.bfloat16, blocksize: int = 64, double_quant: bool = True) -> None:
        super().__init__()
        if type(in_features) is not int or type(out_features) is not int or in_features <= 0 or out_features <= 0:
            raise ValueError(f"in_features and out_features must be positive ints, got {in_features!r}, {out_features!r}")
        if compute_dtype not in _FLOATS:
            raise ValueError(f"compute_dtype must be float32, float16 or bfloat16, got {compute_dtype}")
        _check_blocksize(blocksize, (32, 64, 128, 256, 512, 1024, 2048, 4096))
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.blocksize, self.double_quant = compute_dtype, blocksize, double_quant
        w = torch.empty(out_features, in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's initialisation
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype)) if bias else None
        self.quantize_(w)

    def quantize_(self, weight: torch.Tensor) -> None:
        """Store ``weight`` (out_features x in_features) in NF4, replacing any stored weight."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)}, expected {(self.out_features, self.in_features)}")
        packed, absmax = quantize_nf4(weight.detach(), self.blocksize)
        self.register_buffer("weight_packed", packed, persistent=True)
        if self.double_quant:
            codes, absmax2, offset = double_quantize(absmax)
            self.register_buffer("absmax_codes", codes)
            self.register_buffer("absmax2", absmax2)
            self.register_buffer("absmax_offset", offset)
            self.absmax = None
        else:
            self.register_buffer("absmax", absmax)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16, blocksize: int = 64,
                    double_quant: bool = True) -> "Linear4bit":
        """Quantize an ``nn.Linear``'s weight (in its own dtype, as bitsandbytes does) and copy its bias."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear: expected an nn.Linear, got {type(linear).__name__}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.compute_dtype, m.blocksize, m.double_quant = compute_dtype, blocksize, double_quant
        _check_blocksize(blocksize, (32, 64, 128, 256, 512, 1024, 2048, 4096))
        m.weight_dtype = linear.weight.dtype
        m.quantize_(linear.weight)
        m.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(compute_dtype).clone())
        return m

    def absmax_fp32(self) -> torch.Tensor:
        if self.double_quant:
            return double_dequantize(self.absmax_codes, self.absmax2, self.absmax_offset)
        return self.absmax

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self.weight_packed, self.absmax_fp32(), (self.out_features, self.in_features),
                              dtype or self.compute_dtype, self.blocksize)

    def quant_state(self) -> tuple[torch.Tensor, ...]:
        """The stored 4-bit state: ``(weight_packed, absmax)`` or, with double quant,
        ``(weight_packed, absmax_codes, absmax2, absmax_offset)``."""
        if self.double_quant:
            return self.weight_packed, self.absmax_codes, self.absmax2, self.absmax_offset
        return self.weight_packed, self.absmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _MatMul4bit.apply(x.to(self.compute_dtype), bias, self.quant_state(),
                                (self.out_features, self.in_features), self.blocksize, self.compute_dtype)
        return out.to(x.dtype)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.cuda()``...: the quantization scales move but stay float32 (as in bitsandbytes)."""
        kept = {n: self._buffers[n] for n in self._QUANT_STATE if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for n, old in kept.items():
            new = self._buffers[n]
            if new.dtype != old.dtype:  # cast by fn: take the original values to the new device instead
                self._buffers[n] = old.to(device=new.device)
        return self

    def storage_bytes(self) -> int:
        """Bytes of the stored weight and its scales (not the bias)."""
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.compute_dtype}, blocksize={self.blocksize}, double_quant={self.double_quant}")


# ----------------------------------------------------------------------------- 8-bit Adam
class Adam8bit(torch.optim.Optimizer):
    """Adam with both moments stored in 8 bits, blockwise (Dettmers, Lewis, Shleifer, Zettlemoyer 2022,
    "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861).

    Each step: dequantize ``m`` (signed dynamic map) and ``v`` (unsigned dynamic map) with their
    per-block absmax, do the fp32 Adam update (decoupled weight decay, bias corrections)

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
        p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps),

    and requantize both moments (blocksize 256). A parameter with fewer than ``min_8bit_size``
    (4096) elements keeps fp32 moments, as bitsandbytes does. State: 2 bytes per parameter plus
    2 x 4 bytes per 256-value block (2.03 B/param) instead of 8.
    Follows bitsandbytes/backends/cpu/ops.py ``_optimizer_update_8bit_blockwise_cpu`` and
    ``_optimizer_update_32bit_cpu``; bitsandbytes requantizes with a C lookup routine whose code
    can differ from the exact nearest level by one step near a midpoint, so parameters agree
    within a tolerance (tests/test_quant.py), not bitwise.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, blocksize: int = 256, min_8bit_size: int = 4096) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Adam8bit: invalid lr {lr!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Adam8bit: invalid betas {betas!r}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"Adam8bit: invalid eps {eps!r} or weight_decay {weight_decay!r}")
        _check_blocksize(blocksize)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.blocksize, self.min_8bit_size = blocksize, min_8bit_size
        self.qmap1, self.qmap2 = _codebook_cached("dynamic", "cpu"), _codebook_cached("udynamic", "cpu")

    def _init(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        st["step"] = 0
        if p.numel() < self.min_8bit_size:
            st["state1"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            st["state2"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        else:
            blocks = -(-p.numel() // self.blocksize)
            st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
            st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
            st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p] if p in self.state else self._init(p)
                st["step"] += 1
                t = st["step"]
                g = p.grad.float()
                pf = p.data.float()
                c1, c2 = 1.0 - b1**t, math.sqrt(1.0 - b2**t)
                if wd > 0.0:
                    pf.mul_(1.0 - lr * wd)
                if st["state1"].dtype == torch.float32:  # small tensor: bitsandbytes' 32-bit formula
                    m, v = st["state1"], st["state2"]
                    m.mul_(b1).add_(g, alpha=1.0 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                    pf.add_(m / (v.sqrt() + eps * c2), alpha=-lr * c2 / c1)
                else:
                    bs = self.blocksize
                    q1, q2 = self.qmap1.to(p.device), self.qmap2.to(p.device)
                    m = dequantize_blockwise(st["state1"], st["absmax1"], q1, bs)
                    v = dequantize_blockwise(st["state2"], st["absmax2"], q2, bs)
                    m.mul_(b1).add_(g, alpha=1.0 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                    pf.addcdiv_(m, (v.sqrt() / c2).add_(eps), value=-lr / c1)
                    st["state1"], st["absmax1"] = quantize_blockwise(m, q1, bs)
                    st["state2"], st["absmax2"] = quantize_blockwise(v, q2, bs)
                p.data.copy_(pf)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``Optimizer.load_state_dict`` casts every floating parameter's state to the parameter's dtype:
        the uint8 codes would become moments of the wrong meaning (or bf16) and the fp32 moments of small tensors
        fp16/bf16 (and the next step would take the 8-bit branch). The state is loaded, then each tensor is put back
        in the dtype it was saved in (copied from the saved values, never a round trip through the cast)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for k, v in saved.get(pid, {}).items():
                if isinstance(v, torch.Tensor) and k != "step":
                    self.state[p][k] = v.to(device=p.device, copy=True)

    def __getstate__(self) -> dict:
        """deepcopy and pickle keep the block size and the 8-bit threshold (torch's Optimizer keeps only
        defaults, state and param_groups); the quantization maps are rebuilt on load."""
        state = super().__getstate__()
        state.update(blocksize=self.blocksize, min_8bit_size=self.min_8bit_size)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.qmap1, self.qmap2 = _codebook_cached("dynamic", "cpu"), _codebook_cached("udynamic", "cpu")

    def state_bytes(self) -> int:
        """Bytes of all optimizer state tensors (moments and block scales)."""
        return sum(x.numel() * x.element_size() for st in self.state.values() for x in st.values()
                   if isinstance(x, torch.Tensor))
