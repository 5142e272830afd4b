"""Floating-point formats: how fp32, fp16 and bf16 split their bits between range and precision.

The numbers come from ``torch.finfo``; the bit view from reinterpreting a number's bytes as an
integer (IEEE 754; bf16 is fp32 with the low 16 mantissa bits dropped).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from memlab.core.validation import invalid

__all__ = ["FORMATS", "as_float_dtype", "format_info", "format_table", "format_table_str", "bit_fields"]

#: the course's short names of the three training formats
FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# an integer dtype of the same width, to read a float's raw bits
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}
_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


def as_float_dtype(dtype: Any, name: str = "dtype") -> torch.dtype:
    """The torch floating-point dtype that ``dtype`` names.

    Args:
        dtype: a torch dtype (float64/32/16, bfloat16) or a name: ``"fp32"``, ``"fp16"``, ``"bf16"``,
            ``"fp64"``, ``"float16"``, ``"half"``, ``"torch.bfloat16"`` ...
        name: the argument's name in the error message.

    Raises:
        ValueError: naming ``name``, the value and the accepted formats.
    """
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
        if key in ("fp64", "float64", "double"):
            return torch.float64
    if isinstance(dtype, torch.dtype) and dtype in _FLOAT_DTYPES:
        return dtype
    raise invalid(name, dtype, "a floating-point format: torch.float32, torch.float16, torch.bfloat16, "
                               "torch.float64 (or 'fp32', 'fp16', 'bf16', 'fp64')")


def format_info(dtype: torch.dtype | str) -> dict[str, Any]:
    """Bit layout, range and precision of a floating-point dtype or its name (:func:`as_float_dtype`),
    from ``torch.finfo``.

    Returns:
        A dict with name, dtype, bits, sign_bits (1), exponent_bits, mantissa_bits (stored fraction
        bits), max, smallest_normal, smallest_subnormal (= smallest_normal * eps), eps (the gap
        between 1.0 and the next number, 2**-mantissa_bits), decimal_digits (``finfo.precision``).

    Raises:
        ValueError: ``dtype`` is not a floating-point format.
    """
    dtype = as_float_dtype(dtype)
    fi = torch.finfo(dtype)
    mantissa = int(round(-math.log2(fi.eps)))
    name = {v: k for k, v in FORMATS.items()}.get(dtype, "fp64" if dtype == torch.float64 else str(dtype))
    return {
        "name": name,
        "dtype": dtype,
        "bits": fi.bits,
        "sign_bits": 1,
        "exponent_bits": fi.bits - 1 - mantissa,
        "mantissa_bits": mantissa,
        "max": float(fi.max),
        "smallest_normal": float(fi.smallest_normal),
        "smallest_subnormal": float(fi.smallest_normal) * float(fi.eps),
        "eps": float(fi.eps),
        "decimal_digits": int(round(-math.log10(fi.resolution))),
    }


def format_table(dtypes: Sequence[torch.dtype | str] = ("fp32", "fp16", "bf16")) -> list[dict[str, Any]]:
    """One :func:`format_info` row per dtype (or name), in the order given."""
    return [format_info(d) for d in dtypes]


def format_table_str(dtypes: Sequence[torch.dtype | str] = ("fp32", "fp16", "bf16")) -> str:
    """:func:`format_table` as aligned text: a header, a rule and one line per format."""
    header = ["format", "bits", "sign", "exponent", "mantissa", "max", "min normal", "min subnormal", "eps"]
    rows = [
        [r["name"], r["bits"], r["sign_bits"], r["exponent_bits"], r["mantissa_bits"],
         f"{r['max']:.4g}", f"{r['smallest_normal']:.4g}", f"{r['smallest_subnormal']:.4g}", f"{r['eps']:.4g}"]
        for r in format_table(dtypes)
    ]
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def bit_fields(x: float | torch.Tensor, dtype: torch.dtype | str = torch.float32) -> tuple[str, str, str]:
    """The (sign, exponent, mantissa) bits of ``x`` rounded to ``dtype``, as strings of 0/1.

    >>> bit_fields(1.0, torch.float16)
    ('0', '01111', '0000000000')

    ``x`` is a Python number or a one-element tensor; each field is most significant bit first.
    """
    dtype = as_float_dtype(dtype)
    info = format_info(dtype)
    t = torch.as_tensor(x, dtype=torch.float64).to(dtype).reshape(())
    # the signed integer view of the same bits, masked to an unsigned pattern of the format's width
    raw = int(t.view(_INT_VIEW[dtype]).item()) & ((1 << info["bits"]) - 1)
    s = format(raw, f"0{info['bits']}b")
    e = info["exponent_bits"]
    return s[0], s[1 : 1 + e], s[1 + e :]
