"""Blockwise absmax quantization: NF4 (4-bit, packed two per byte), 8-bit with a code, double quantization.

QLoRA (Dettmers, Pagnoni, Holtzman, Zettlemoyer 2023, arXiv:2305.14314) stores a frozen base
model in NF4: each block of ``blocksize`` weights is scaled by its absolute maximum into [-1, 1]
and every value is replaced by the index of the nearest of 16 levels (:mod:`memlab.quant.codebooks`),

    q_i = argmin_j |w_i / absmax_b - c_j|,        w_i ~= c_{q_i} * absmax_b.

Two 4-bit indices share a byte. The fp32 ``absmax`` (32 / 64 = 0.5 bits per parameter at
blocksize 64) is itself quantized to 8 bits in blocks of 256 ("double quantization",
0.5 -> 8/64 + 32/(64*256) = 0.127 bits per parameter).
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor  # loaded by ``import torch`` already

from memlab.core.native import NATIVE_FLAGS, build_library
from memlab.core.validation import check_choice, check_positive_int, invalid
from memlab.quant.codebooks import cached_codebook

__all__ = ["NF4_BLOCKSIZES", "nf4_codes", "quantize_nf4", "dequantize_nf4", "pack_nibbles", "unpack_nibbles",
           "quantize_blockwise", "dequantize_blockwise", "double_quantize", "double_dequantize", "bits_per_param",
           "NF4_KERNEL_PATH", "load_nf4_kernel", "nf4_kernel_name"]

# Everything here is written to be **bit-exact with bitsandbytes 0.50 on CPU**; the behaviour it
# copies was read in ``bitsandbytes/functional.py`` (``create_normal_map``, ``create_dynamic_map``,
# ``quantize_4bit``) and ``bitsandbytes/backends/default/ops.py`` (the ``quantize_4bit`` and
# ``quantize_blockwise`` kernels, ``_dequantize_4bit_compute``):
#
# * the codebook: quantiles at ``linspace(0.9677083, 0.5, 9)`` (positive side, 8 values) and
#   ``linspace(0.9677083, 0.5, 8)`` (negative side, 7 values) in float32, ``ndtri`` in float64,
#   cast to float32, sorted, divided by the max in float32;
# * scaling: a full block is multiplied by ``1 / absmax`` (absmax clamped at 1e-38 so an all-zero
#   block maps to code 0.0), a trailing partial block is *divided* by its absmax; then clamp to
#   [-1, 1]. (So an all-zero full block stores absmax 0.0 and an all-zero partial block 1e-38:
#   bitsandbytes' quirk, copied.)
# * nearest code: ``bucketize`` on the float32 midpoints ``(c_j + c_{j+1}) / 2``, so a value
#   exactly on a midpoint goes to the *lower* code (the tie rule);
# * packing: element ``2k`` in the high nibble, ``2k + 1`` in the low nibble; an odd count is
#   padded with one zero value (which quantizes to code 7, the 0.0 level, in the last byte's low
#   nibble); the packed tensor has shape ``(ceil(n / 2), 1)`` as bitsandbytes returns it;
# * dequantization: ``code[q] * absmax`` in float32, then cast to the target dtype.

#: the block sizes bitsandbytes' 4-bit quantization accepts (functional.quantize_4bit); one table for
#: quantize_nf4 and Linear4bit, so a layer never holds a block size the reference could not reproduce
NF4_BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: the dtypes quantized and dequantized here (and Linear4bit's compute dtypes)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLOATS_ALLOWED = "torch.float32, torch.float16 or torch.bfloat16"


# ----------------------------------------------------------------------------- blockwise scaling
def _check_float(w: torch.Tensor, what: str) -> None:
    # a non-empty float32/float16/bfloat16 tensor, else TypeError/ValueError naming ``what``'s argument
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{what}: w={type(w).__name__} is invalid; allowed: a torch.Tensor")
    if w.dtype not in FLOAT_DTYPES:
        raise invalid(f"{what}: w.dtype", w.dtype, _FLOATS_ALLOWED)
    if w.numel() == 0:
        raise invalid(f"{what}: w.numel()", 0, "a non-empty tensor")


def check_blocksize(blocksize: int, allowed: Sequence[int] | None = None) -> None:
    """Raise ValueError unless ``blocksize`` is a positive int, one of ``allowed`` when given."""
    check_positive_int("blocksize", blocksize)
    if allowed is not None:
        check_choice("blocksize", blocksize, allowed)


def _scale_blocks(w: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    # flatten to float32, per-block absmax, and the values scaled into [-1, 1] (bitsandbytes' arithmetic)
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
    # index of the nearest level of the sorted ``code``; a tie (exactly on a midpoint) goes to the lower level
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, midpoints, out_int32=True)


def pack_nibbles(q: torch.Tensor, pad: int = 7) -> torch.Tensor:
    """Two 4-bit codes per byte: element 2k in the high nibble, 2k+1 in the low nibble.

    An odd count is padded with code ``pad`` (7, NF4's 0.0 level: bitsandbytes pads with the value
    0.0 before quantizing). ``pack_nibbles(nf4_codes(w)[0])`` equals ``quantize_nf4(w)[0].flatten()``.
    ``q`` of any shape is flattened; the result is a flat uint8 tensor of ceil(n / 2) bytes.

    Raises:
        ValueError: for a code outside 0..15.
    """
    q = q.reshape(-1)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise invalid("pack_nibbles: q's codes from min to max", (int(q.min()), int(q.max())), "codes in 0..15")
    q = q.to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_full((1,), pad)])
    return (q[0::2] << 4) | q[1::2]


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: the first ``n`` codes (int64) of ``packed`` (uint8, or any dtype
    viewed as uint8; any shape).

    Raises:
        ValueError: when the bytes hold fewer than ``n`` codes.
    """
    p = packed.reshape(-1)
    if p.dtype != torch.uint8:
        p = p.view(torch.uint8)
    q = torch.empty(p.numel() * 2, dtype=torch.int64, device=p.device)
    q[0::2] = (p >> 4).long()
    q[1::2] = (p & 0xF).long()
    if n > q.numel():
        raise invalid("unpack_nibbles: n", n, f"at most {q.numel()} (the codes {p.numel()} bytes hold)")
    return q[:n]


# ----------------------------------------------------------------------------- NF4
def nf4_codes(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise NF4 codes before packing: ``(codes, absmax)``, uint8 codes of length ``w.numel()``
    (``w`` float32/float16/bfloat16, flattened) and float32 absmax per block.

    Raises:
        TypeError: when ``w`` is not a tensor.
        ValueError: for a non-float or empty ``w``, or a bad ``blocksize``.
    """
    _check_float(w, "nf4_codes")
    check_blocksize(blocksize)
    scaled, absmax = _scale_blocks(w.detach(), blocksize)
    return _nearest(scaled, cached_codebook("nf4", str(scaled.device), scaled)).to(torch.uint8), absmax


def quantize_nf4(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4-quantize ``w`` blockwise: returns ``(packed, absmax)``.

    ``packed``: uint8 of shape ``(ceil(n / 2), 1)``, two codes per byte; ``absmax``: float32, one
    per block (the last block may be partial). Equal to
    ``bitsandbytes.functional.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")``'s output and
    ``quant_state.absmax`` (compress_statistics=False). ``blocksize`` is one of :data:`NF4_BLOCKSIZES`.

    Raises:
        TypeError: when ``w`` is not a tensor.
        ValueError: for a non-float or empty ``w``, or a block size bitsandbytes does not offer.
    """
    _check_float(w, "quantize_nf4")
    check_blocksize(blocksize, NF4_BLOCKSIZES)
    scaled, absmax = _scale_blocks(w.detach(), blocksize)
    if scaled.numel() % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])  # pad with the value 0.0 (-> code 7)
    q = _nearest(scaled, cached_codebook("nf4", str(scaled.device), scaled)).to(torch.uint8)
    packed = ((q[0::2] << 4) | q[1::2]).unsqueeze(1)
    return packed, absmax


# ----------------------------------------------------------------------------- NF4 dequantize, the C++ path
#: the C++ source of the CPU dequantize (package data), built with the system compiler on first use
NF4_KERNEL_PATH = Path(__file__).with_name("nf4.cpp")
_NF4_FLAGS = (*NATIVE_FLAGS, "-std=c++17")
_NF4_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernel's output format codes
_NF4_LOCK = threading.Lock()
_NF4_KERNEL: Any = None
_NF4_KERNEL_NAME: str | None = None
NF4_CPP_NAME = "C++/OpenMP (g++ -O3 -march=native)"
NF4_TORCH_NAME = "torch (index_select)"


def load_nf4_kernel(force: str | None = None) -> str:
    """Build (once, cached in ``~/.cache/memlab`` or ``$MEMLAB_CACHE``: :mod:`memlab.core.native`) and load the
    C++ NF4 dequantize; return the name of the path :func:`dequantize_nf4` now takes on CPU tensors.

    Both paths give the same bits. The C++ one (``nf4.cpp``) allocates and writes only the output; the torch
    one gathers from a byte table with ``index_select`` piece by piece (two piece buffers beside the output):
    the path of every other device and of an ``absmax`` that is not float32. Fake CPU tensors (memlab.estimate's
    traces) allocate what the path chosen here allocates.

    Args:
        force: ``"cpp"``, ``"torch"`` or ``"auto"``; None reads the environment variable ``MEMLAB_NF4_KERNEL``
            (default ``"auto"``: the C++ kernel when it builds, else torch).

    Raises:
        ValueError: an unknown choice.
        RuntimeError: ``"cpp"`` was forced and the kernel did not build (no compiler, a compiler error).
    """
    global _NF4_KERNEL, _NF4_KERNEL_NAME
    choice = check_choice("kernel", (force or os.environ.get("MEMLAB_NF4_KERNEL", "auto")).strip().lower(),
                          ("auto", "cpp", "torch"))
    with _NF4_LOCK:
        if choice == "torch":
            _NF4_KERNEL, _NF4_KERNEL_NAME = None, NF4_TORCH_NAME
            return _NF4_KERNEL_NAME
        if _NF4_KERNEL is not None:
            return _NF4_KERNEL_NAME  # type: ignore[return-value]
        try:
            fn = build_library(NF4_KERNEL_PATH, "nf4", _NF4_FLAGS).memlab_nf4_dequantize
            fp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            fn.argtypes = [fp, fp, fp, fp, i64, i64, ci, ci]
            fn.restype = ci
            _NF4_KERNEL, _NF4_KERNEL_NAME = fn, NF4_CPP_NAME
        except Exception as exc:  # noqa: BLE001  (no compiler, no OpenMP, a read-only cache ...)
            if choice == "cpp":
                raise RuntimeError(f"the C++ NF4 dequantize kernel did not build: {exc}") from exc
            _NF4_KERNEL, _NF4_KERNEL_NAME = None, f"{NF4_TORCH_NAME} (C++ kernel unavailable: {type(exc).__name__})"
        return _NF4_KERNEL_NAME


def nf4_kernel_name() -> str:
    """Which path :func:`dequantize_nf4` takes on contiguous CPU tensors: ``"C++/OpenMP ..."`` or ``"torch ..."``
    (loading the kernel on the first call)."""
    return _NF4_KERNEL_NAME if _NF4_KERNEL_NAME is not None else load_nf4_kernel()


def _takes_native(p: torch.Tensor, absmax: torch.Tensor) -> bool:
    # whether the C++ path dequantizes these inputs (real or fake: a trace on CPU fake tensors allocates what the real
    # call allocates): contiguous CPU tensors (dequantize_nf4's flat views: a strided input is copied by reshape, as
    # on the torch path), a float32 absmax, and the kernel loaded
    if p.device.type != "cpu" or absmax.device.type != "cpu" or absmax.dtype != torch.float32:
        return False
    if not (p.is_contiguous() and absmax.is_contiguous()):
        return False
    nf4_kernel_name()  # loads the kernel on the first call
    return _NF4_KERNEL is not None


def _run_native(p: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, blocksize: int) -> None:
    # the C++ kernel into ``out`` (flat, contiguous, float32 / float16 / bfloat16, on the CPU)
    code = cached_codebook("nf4", "cpu")
    rc = _NF4_KERNEL(p.data_ptr(), absmax.data_ptr(), code.data_ptr(), out.data_ptr(), out.numel(), blocksize,
                     _NF4_KINDS[out.dtype], torch.get_num_threads())
    if rc != 0:  # unreachable after dequantize_nf4's checks: a kernel that disagrees with them is a bug
        raise RuntimeError(f"memlab_nf4_dequantize returned {rc} for n={out.numel()}, blocksize={blocksize}, "
                           f"dtype={out.dtype}")


#: NF4 dequantize on a CPU works through the weight in pieces whose buffers (int32 indices, 4 B a packed byte, and,
#: unless a float32 output with an even count takes the gather itself, float32 values, 8 B a packed byte) hold at
#: most this many bytes: a piece stays in the caches while it is gathered, scaled and (float16 / bfloat16) cast,
#: and a large weight allocates no whole-weight temporaries (the lookup before the pieces held 6 B a weight beside
#: a float16 / bfloat16 output), which a busy allocator returns to the system and faults in again page by page on
#: the next call. Other devices take the weight in one piece.
NF4_DEQUANT_BUFFER_BYTES = 3 << 19  # 1.5 MiB
# Measured and not used (issue 42): a 65536-entry table of four float32 values per byte pair (1 MiB, complex128
# words) halves the index conversions and gathers (torch's index_select costs per index, not per byte): the
# 1024 x 1024 float32 call went from 0.29 to 0.25 ms in some processes but to 0.35-0.6 ms in others on the same
# loaded 2-core machine (the table lives in L2, the byte table's 2 KiB in L1), where the byte table stays at
# 0.28-0.32 ms; a float16 / bfloat16 output gained nothing from it.


def _dequant_piece(n: int, blocksize: int, device: torch.device, direct: bool) -> int:
    # weights per piece: the whole weight off the CPU; else equal pieces of whole blocks (and an even count) with
    # buffers within NF4_DEQUANT_BUFFER_BYTES (at least one such unit)
    if device.type != "cpu":
        return n
    unit = blocksize if blocksize % 2 == 0 else 2 * blocksize  # whole blocks and whole bytes
    most = unit * max(1, 2 * (NF4_DEQUANT_BUFFER_BYTES // (4 if direct else 12)) // unit)
    if n <= most:
        return n
    return -(-n // (-(-n // most) * unit)) * unit


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape: Sequence[int] | torch.Size,
                   dtype: torch.dtype = torch.float32, blocksize: int = 64) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4`: ``code[q] * absmax`` in float32, cast to ``dtype`` (float32, float16
    or bfloat16), reshaped to ``shape``.

    CPU inputs with a float32 ``absmax`` go through the C++ kernel when it builds, the rest through torch ops,
    with the same bits (:func:`load_nf4_kernel`); fake tensors allocate what their device's path allocates.

    Raises:
        ValueError: for a bad ``dtype`` or ``blocksize``, or too few absmax values or bytes for ``shape``.
    """
    check_choice("dequantize_nf4: dtype", dtype, FLOAT_DTYPES)
    check_blocksize(blocksize)
    n = math.prod(shape)
    nblocks = -(-n // blocksize)
    if absmax.numel() != nblocks:
        raise invalid("dequantize_nf4: absmax.numel()", absmax.numel(),
                      f"{nblocks} ({n} values in blocks of {blocksize})")
    p = packed.reshape(-1)
    p = p if p.dtype == torch.uint8 else p.view(torch.uint8)
    if 2 * p.numel() < n:
        raise invalid("dequantize_nf4: packed bytes", p.numel(), f">= {-(-n // 2)} for shape {tuple(shape)}")
    am = absmax.reshape(-1)
    if _takes_native(p, am):  # only the output is allocated; a fake one (a trace) is not computed
        out = p.new_empty(n, dtype=dtype)
        if not (isinstance(out, FakeTensor) or isinstance(p, FakeTensor) or isinstance(am, FakeTensor)):
            _run_native(p, am, out, blocksize)
        return out.reshape(tuple(shape))
    # Each byte becomes its two float32 values (high nibble, low nibble) as one 8-byte word of a 256-entry table,
    # gathered by a 1-d index_select with int32 indices, piece by piece (NF4_DEQUANT_BUFFER_BYTES): the bytes
    # converted to int32 into one reused index buffer, gathered straight into a float32 output (or into one reused
    # float32 buffer), every block scaled in place by its absmax, and a float16 / bfloat16 piece rounded once on
    # the copy into the output (float32 product, then the cast: what ``.to(dtype)`` of the product gives).
    # Allocated: the output, the index buffer (4 B a byte of one piece) and, unless the output is float32 with an
    # even count, the value buffer (8 B a byte of one piece). A weight that is one piece and goes through the value
    # buffer frees its indices before its output is allocated (peak: the larger of indices + values and values +
    # output, as the whole-weight lookup before the pieces had).
    direct = dtype == torch.float32 and n % 2 == 0
    device = p.device
    step = _dequant_piece(n, blocksize, device, direct)
    piece_bytes = (step + 1) // 2
    one = step == n and not direct
    # new_empty: fake buffers for a fake input, in or out of the fake mode
    out = None if one else p.new_empty(n, dtype=dtype)
    idx = p.new_empty(piece_bytes, dtype=torch.int32)
    buf = None if direct else p.new_empty(piece_bytes, dtype=torch.int64)
    if isinstance(p, FakeTensor) or isinstance(absmax, FakeTensor) or device.type == "meta":
        if one:  # a trace (memlab.estimate): the same allocations and frees, nothing computed
            del idx
            out = p.new_empty(n, dtype=dtype)
        return out.reshape(tuple(shape))
    table = _nf4_pair_words(str(device))
    am_rows = absmax.reshape(-1, 1)
    am_rows = am_rows if am_rows.dtype == torch.float32 else am_rows.float()
    if one:
        idx.copy_(p[:piece_bytes])
        torch.index_select(table, 0, idx, out=buf)
        del idx
        vals = buf.view(torch.float32)
        _scale_blocks_(vals if 2 * piece_bytes == n else vals[:n], am_rows, 0, blocksize)
        out = p.new_empty(n, dtype=dtype)
        out.copy_(vals if 2 * piece_bytes == n else vals[:n])
        return out.reshape(tuple(shape))
    for s in range(0, n, step):
        m = min(step, n - s)  # weights in this piece: whole blocks (and even) but for the last piece
        nb = (m + 1) // 2  # its bytes
        i = idx if nb == piece_bytes else idx[:nb]
        i.copy_(p[s // 2: s // 2 + nb])
        if buf is None:  # float32, even count: gathered straight into the output
            vals = out if m == n else out[s: s + m]
            torch.index_select(table, 0, i, out=vals.view(torch.int64))
        else:
            words = buf if nb == piece_bytes else buf[:nb]
            torch.index_select(table, 0, i, out=words)
            vals = words.view(torch.float32)
            vals = vals if 2 * nb == m else vals[:m]
        _scale_blocks_(vals, am_rows, s // blocksize, blocksize)
        if buf is not None:
            (out if m == n else out[s: s + m]).copy_(vals)
    return out.reshape(tuple(shape))


def _scale_blocks_(vals: torch.Tensor, am_rows: torch.Tensor, k: int, blocksize: int) -> None:
    # ``vals`` (float32, starting at block ``k``) times each value's absmax, in place; ``am_rows``: absmax as a column
    m = vals.numel()
    full = m - m % blocksize
    if full:
        rows = am_rows if k == 0 and full // blocksize == am_rows.shape[0] else am_rows[k: k + full // blocksize]
        (vals if full == m else vals[:full]).view(-1, blocksize).mul_(rows)
    if full < m:  # the trailing partial block (the weight's last)
        vals[full:].mul_(am_rows[k + full // blocksize])


@functools.lru_cache(maxsize=None)
def _nf4_pair_words(device: str) -> torch.Tensor:
    # the cached byte -> (high, low) float32 pair table seen as 256 int64 words (a view: no copy), made outside
    # every dispatch mode, as the table itself is (a MemoryTracker never sees it)
    from torch.utils._python_dispatch import _disable_current_modes

    table = cached_codebook("nf4_pairs", device)
    with _disable_current_modes():
        return table.view(torch.int64).view(256)


def _scale_back(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    # ``values * absmax`` of each value's block, in float32 (full blocks as one broadcast multiply)
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

    Same arithmetic as bitsandbytes' ``quantize_blockwise`` default kernel (scale by 1/absmax,
    nearest code by midpoints). Returns ``(q, absmax)``: uint8 codes of ``x``'s shape, float32
    absmax per block.

    Raises:
        TypeError: when ``x`` is not a tensor.
        ValueError: for a non-float or empty ``x``, or a bad ``blocksize``.
    """
    _check_float(x, "quantize_blockwise")
    check_blocksize(blocksize)
    code = cached_codebook("dynamic", str(x.device), x) if code is None else code
    scaled, absmax = _scale_blocks(x.detach(), blocksize)
    q = _nearest(scaled, code.to(scaled.device).float()).to(torch.uint8)
    return q.reshape(x.shape), absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor | None = None,
                         blocksize: int = 256, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``code[q] * absmax`` in float32, cast to ``dtype``, ``q``'s shape.

    Raises:
        ValueError: for codes that are not uint8, or a bad ``blocksize``.
    """
    if q.dtype != torch.uint8:
        raise invalid("dequantize_blockwise: q.dtype", q.dtype, "torch.uint8")
    check_blocksize(blocksize)
    code = cached_codebook("dynamic", str(q.device), absmax) if code is None else code.to(q.device).float()
    values = code.index_select(0, q.reshape(-1).long())
    return _scale_back(values, absmax, blocksize).reshape(q.shape).to(dtype)


def double_quantize(absmax: torch.Tensor, blocksize: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the first-level ``absmax`` (QLoRA sec. 3 "Double Quantization").

    ``offset = absmax.mean()``; ``(codes, absmax2) = quantize_blockwise(absmax - offset, dynamic_map(), blocksize)``.
    bitsandbytes' ``quantize_4bit(..., compress_statistics=True)`` does the same (functional.py) but its CPU
    kernel is a C lookup routine that can pick a code one level off the nearest.

    Returns:
        ``(codes, absmax2, offset)``: uint8, float32 per second-level block, float32 scalar.

    Raises:
        ValueError: when ``absmax`` is not float32.
    """
    if absmax.dtype != torch.float32:
        raise invalid("double_quantize: absmax.dtype", absmax.dtype, "torch.float32")
    offset = absmax.mean()
    dynamic = cached_codebook("dynamic", str(absmax.device), absmax)
    codes, absmax2 = quantize_blockwise(absmax - offset, dynamic, blocksize)
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
