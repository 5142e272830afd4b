"""The quantization levels: NF4 (QLoRA), FP4, int4 and the 8-bit dynamic map, as bitsandbytes builds them.

NF4's 16 levels are quantiles of the standard normal distribution normalised to [-1, 1] with an
exact zero (Dettmers, Pagnoni, Holtzman, Zettlemoyer 2023, "QLoRA", arXiv:2305.14314, sec. 3);
the dynamic map is Dettmers 2015's tree quantization (arXiv:1511.04561).
"""
from __future__ import annotations

import functools

import torch

from memlab.core.validation import check_number, invalid

__all__ = ["NF4_OFFSET", "nf4_codebook", "fp4_codebook", "int4_codebook", "dynamic_map"]
# cached_codebook is the hot paths' shared table (blockwise, adam8bit)

NF4_OFFSET = 0.9677083  # bitsandbytes' create_normal_map default: the outermost quantile used


def nf4_codebook(offset: float | None = None) -> torch.Tensor:
    """The 16 NF4 levels, derived from normal quantiles (QLoRA sec. 3, eq. 4), float32, sorted.

    8 quantiles ``ndtri(p)`` at ``p = linspace(offset, 0.5, 9)[:-1]`` for the positive half and 7 at
    ``linspace(offset, 0.5, 8)[:-1]`` (negated) for the negative half, plus an exact 0, then normalised
    so the largest is 1.0. With the default offset (0.9677083, bitsandbytes' choice) equal bitwise to
    ``bitsandbytes.functional.get_4bit_type("nf4")``. ``offset`` is the outermost probability used,
    in (0.5, 1); None is :data:`NF4_OFFSET`.

    Raises:
        ValueError: for an offset outside (0.5, 1).
    """
    offset = NF4_OFFSET if offset is None else offset
    check_number("offset", offset, minimum=0.5, strict_minimum=True)
    if not offset < 1.0:  # ndtri(1) is infinite
        raise invalid("offset", offset, "a number with 0.5 < offset < 1")
    # float32 whatever torch.get_default_dtype() is (bitsandbytes' linspace is float32; a bf16 default once moved
    # 2.4% of the codes for the rest of the process, the cache keeping the first table built)
    pos = torch.linspace(offset, 0.5, 9, dtype=torch.float32)[:-1].double()  # 8 probabilities, the last (0.5) dropped
    neg = torch.linspace(offset, 0.5, 8, dtype=torch.float32)[:-1].double()  # 7 probabilities
    values = torch.cat([torch.special.ndtri(pos), torch.zeros(1, dtype=torch.float64), -torch.special.ndtri(neg)])
    values = values.float().sort().values
    return values / values.max()


@functools.lru_cache(maxsize=None)
def _real_codebook(name: str, device: str) -> torch.Tensor:
    # read-only cached codebooks for the hot paths (never handed to a caller to mutate), always real tensors
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


def cached_codebook(name: str, device: str, like: torch.Tensor | None = None) -> torch.Tensor:
    """The cached, read-only float32 codebook ``name`` ("nf4", "nf4_pairs", "dynamic", "udynamic") on ``device``;
    a fake copy of its shape when ``like`` is a FakeTensor (memlab.estimate's traces)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(like, FakeTensor):
        return like.new_zeros(_real_codebook(name, "cpu").shape, dtype=torch.float32)  # values do not matter on fake tensors, shapes do
    return _real_codebook(name, device)


def fp4_codebook() -> torch.Tensor:
    """A 4-bit float (1 sign, 2 exponent, 1 mantissa bit, bias 2 as in bitsandbytes' FP4): 16 float32
    levels (15 distinct and a spare zero), sorted, normalised to a maximum of 1.0."""
    mags = [0.0, 0.0625, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]  # subnormals 0 and 0.5*2^-3, then 1.m x 2^(e-2) x 4
    values = torch.tensor(sorted({*mags, *(-m for m in mags)}) + [0.0], dtype=torch.float32)  # -0 == 0: 15 distinct + a spare 0
    values = values.sort().values
    return values / values.max()


def int4_codebook() -> torch.Tensor:
    """Symmetric absmax int4: the 15 levels k/7, k = -7..7, plus a spare zero (16 float32 entries), sorted."""
    return torch.cat([torch.arange(-7, 8, dtype=torch.float32) / 7, torch.zeros(1, dtype=torch.float32)]).sort().values


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The 8-bit dynamic (tree) quantization map of Dettmers 2015 (arXiv:1511.04561), as bitsandbytes builds it.

    For exponent i = 0..6 a set of evenly spaced fractions in [0.1, 1] (midpoints of a linspace)
    times 10^(i-6); signed maps mirror them. Plus 0 and 1.0; 256 values sorted. Used for double
    quantization (signed) and for the 8-bit Adam states (signed for m, unsigned for v).

    Args:
        signed: mirror the positive values (for signed data such as Adam's first moment).
        max_exponent_bits: exponent bits of the tree encoding (bitsandbytes' default 7).
        total_bits: bits per code (8: 256 values, ``2**total_bits`` float32 values in all).
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
