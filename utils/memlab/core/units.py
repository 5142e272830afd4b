"""Byte units: the constants, one formatter and one parser of sizes such as ``"24GB"``."""
from __future__ import annotations

import math
import re

__all__ = ["KiB", "MiB", "GiB", "TiB", "GB", "format_bytes", "parse_size"]

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
GB = 10**9  # what a card's box says: "24 GB"

_FIXED = {"KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "GB": GB}

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_ALLOWED = ("a number of bytes (24e9) or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB "
                 "(e.g. 24GB, 80GiB)")


def format_bytes(n: float, unit: str = "auto") -> str:
    """Human-readable bytes with two decimals, sign kept (a difference may be negative):
    ``format_bytes(1536) == '1.50 KiB'``.

    Args:
        unit: ``"auto"`` (binary, B .. TiB) or a fixed ``"KiB"``, ``"MiB"``, ``"GiB"``, ``"TiB"``, ``"GB"``.

    Raises:
        ValueError: an unknown ``unit``.
    """
    if unit in _FIXED:
        return f"{n / _FIXED[unit]:,.2f} {unit}"
    if unit != "auto":
        raise ValueError(f"unit={unit!r} is invalid; allowed: 'auto', {', '.join(map(repr, _FIXED))}")
    for suffix in ("TiB", "GiB", "MiB", "KiB"):
        if abs(n) >= _FIXED[suffix]:
            return f"{n / _FIXED[suffix]:,.2f} {suffix}"
    return f"{int(n)} B"


def parse_size(text: str | int | float, *, name: str = "size") -> int:
    """Bytes in a size such as ``"24GB"`` (10**9), ``"80GiB"`` (2**30), ``"24e9"`` or ``512``.

    Units are case-insensitive: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of
    1024). A card sold as "24 GB" usually has 24 GiB. Returns a positive int.

    Args:
        name: the argument's name in the error message.

    Raises:
        ValueError: naming ``name``, the value and what is allowed.
    """
    if isinstance(text, bool):
        raise ValueError(f"{name}={text!r} is invalid; allowed: {_SIZE_ALLOWED}")
    shown = text if not isinstance(text, int) or text.bit_length() < 64 else f"<an int of {text.bit_length()} bits>"
    try:
        if isinstance(text, (int, float)):
            value, unit = float(text), ""
        else:
            m = _SIZE_RE.match(str(text))
            if not m or m.group(2).lower() not in _UNITS:
                raise ValueError(f"{name}={text!r} is invalid; allowed: {_SIZE_ALLOWED}")
            value, unit = float(m.group(1)), m.group(2).lower()
        nbytes = value * _UNITS[unit]
    except OverflowError:  # an int beyond a float (10**400), a product beyond one ("1e300 TiB")
        nbytes = math.inf
    if not math.isfinite(nbytes) or nbytes <= 0:
        raise ValueError(f"{name}={shown!r} is invalid; allowed: a positive size, {_SIZE_ALLOWED}")
    return int(round(nbytes))
