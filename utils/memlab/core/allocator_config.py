"""The settings of PyTorch's CUDA caching allocator (``PYTORCH_CUDA_ALLOC_CONF``) and its request rounding.

What :class:`memlab.estimate.caching_allocator.CachingAllocatorModel` is configured with (it re-exports these
names), and what ``memlab explain`` sizes a real snapshot's blocks by; the two size rules the allocator applies first: ``round_size`` (512-byte multiples, or ``roundup_power2_divisions`` steps) and
``get_allocation_size`` (the segment a new request opens), written from PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/cuda/CUDAAllocatorConfig.cpp`` (sources in
:mod:`memlab.estimate.caching_allocator`'s docstring).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from memlab.core.units import MiB
from memlab.core.validation import check_bool, check_number, invalid

__all__ = ["AllocatorConfig", "round_size", "allocation_size", "DEFAULT_CONFIG", "MIN_BLOCK", "SMALL_SIZE",
           "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE", "NO_LIMIT"]

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 1 * MiB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small-pool segment (and expandable page of the small pool)
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: a segment for 1-10 MiB requests (and expandable page of the large pool)
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a segment is the request rounded to 2 MiB
ROUND_LARGE = 2 * MiB  # kRoundLarge
_INTERVALS = 16  # roundup_power2_divisions: one setting per power-of-two interval from 1 MiB to 64 GiB
NO_LIMIT = 2**64 - 1  # max_split_size unset (SIZE_MAX)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the model follows (:meth:`parse` reads the string).

    Args:
        max_split_size_mb: blocks this large (MiB, more than 20) are never split; None: no limit (PyTorch's default).
        expandable_segments: one growing segment per pool and stream.
        roundup_power2_divisions: an int (a power of two: steps between two powers of two, for every size),
            or a mapping from a size in MiB (a power of two: the interval from it to twice it; the first also sets
            every interval below) or ``">"`` (every interval after the last) to such an int, as
            ``roundup_power2_divisions:[256:1,512:2,>:4]``; None or 0/1: plain 512-byte rounding.
        max_non_split_rounding_mb: with ``max_split_size_mb``, how much larger (MiB, at least 20) an unsplittable
            cached block may be and still serve a large request (PyTorch's default: 20).
    """

    max_split_size_mb: float | None = None
    expandable_segments: bool = False
    roundup_power2_divisions: int | Mapping[Any, int] | None = None
    max_non_split_rounding_mb: float = 20

    def __post_init__(self) -> None:
        if self.max_split_size_mb is not None:
            # PyTorch refuses less than a large segment: "max_split_size_mb too small"
            check_number("max_split_size_mb", self.max_split_size_mb, minimum=20, strict_minimum=True)
        check_bool("expandable_segments", self.expandable_segments)
        check_number("max_non_split_rounding_mb", self.max_non_split_rounding_mb, minimum=20)
        object.__setattr__(self, "_divisions", _division_table(self.roundup_power2_divisions))

    @property
    def max_split_bytes(self) -> int:
        """``max_split_size`` in bytes (SIZE_MAX when unset)."""
        return NO_LIMIT if self.max_split_size_mb is None else int(self.max_split_size_mb * MiB)

    def divisions(self, size: int) -> int:
        """The ``roundup_power2_divisions`` setting that applies to a request of ``size`` bytes."""
        index = max(size.bit_length() - 1 - 20, 0)  # interval 0: below 2 MiB; k: [2^(20+k), 2^(21+k))
        return self._divisions[min(index, _INTERVALS - 1)]  # type: ignore[attr-defined]

    def describe(self) -> str:
        """The options as ``PYTORCH_CUDA_ALLOC_CONF`` spells them ("PyTorch's defaults" when none is set)."""
        parts = []
        if self.max_split_size_mb is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_mb:g}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.roundup_power2_divisions not in (None, 0, 1):
            d = self.roundup_power2_divisions
            parts.append("roundup_power2_divisions:" + (str(d) if isinstance(d, int) else
                                                          "[" + ",".join(f"{k}:{v}" for k, v in d.items()) + "]"))
        if self.max_non_split_rounding_mb != 20:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_mb:g}")
        return "PYTORCH_CUDA_ALLOC_CONF=" + ",".join(parts) if parts else "PyTorch's default allocator settings"

    @classmethod
    def parse(cls, conf: str) -> "AllocatorConfig":
        """The config a ``PYTORCH_CUDA_ALLOC_CONF`` string sets (options this model does not follow are refused).

        Raises:
            ValueError: naming the option or value that is not understood.
        """
        if not isinstance(conf, str):
            raise invalid("conf", conf, "a PYTORCH_CUDA_ALLOC_CONF string such as 'expandable_segments:True'")
        kw: dict[str, Any] = {}
        for key, val in re.findall(r"([a-z_0-9]+):(\[[^\]]*\]|[^,]+)", conf.replace(" ", "")):
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                kw[key] = float(val)
            elif key == "expandable_segments":
                if val not in ("True", "False"):
                    raise invalid("expandable_segments", val, "'True' or 'False'")
                kw[key] = val == "True"
            elif key == "roundup_power2_divisions":
                if val.startswith("["):
                    pairs = [p.split(":") for p in val[1:-1].split(",") if p]
                    kw[key] = {(k if k == ">" else int(k)): int(v) for k, v in pairs}
                else:
                    kw[key] = int(val)
            else:
                raise invalid("conf", conf, "options max_split_size_mb, expandable_segments, roundup_power2_divisions "
                                            "and max_non_split_rounding_mb (others are not modelled)")
        return cls(**kw)


def _division_table(spec: Any) -> list[int]:
    # the allocator config's parseRoundUpPower2Divisions: one value per interval. In a list, the first size also
    # fills every interval below it, a later size sets its own interval only (the ones between keep 0: no
    # rounding), and ">" fills every interval after the last size given
    allowed = "None, a power-of-two int, or a mapping of MiB sizes (powers of two) or '>' to power-of-two ints"
    if spec is None:
        return [0] * _INTERVALS
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec not in (0, 1) and not _is_pow2(spec):
            raise invalid("roundup_power2_divisions", spec, allowed)
        return [spec] * _INTERVALS
    if not isinstance(spec, Mapping):
        raise invalid("roundup_power2_divisions", spec, allowed)
    table, last, first = [0] * _INTERVALS, -1, True
    for key, val in spec.items():
        if isinstance(val, bool) or not isinstance(val, int) or (val != 0 and not _is_pow2(val)):
            raise invalid(f"roundup_power2_divisions[{key!r}]", val, "0 or a power-of-two int")
        if key == ">":
            table[last + 1:] = [val] * (_INTERVALS - last - 1)
            continue
        if isinstance(key, bool) or not isinstance(key, int) or not _is_pow2(key):
            raise invalid("roundup_power2_divisions", spec, allowed)
        index = min(key.bit_length() - 1, _INTERVALS - 1)
        if first:
            table[:index] = [val] * index
            first = False
        table[index], last = val, index
    return table


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """The block size the allocator hands out for a request of ``size`` bytes (``round_size``)."""
    cfg = config or DEFAULT_CONFIG
    if size < MIN_BLOCK:
        return MIN_BLOCK
    div = cfg.divisions(size)
    if div > 1 and size > MIN_BLOCK * div:
        if _is_pow2(size):
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (div.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """The segment a rounded request of ``size`` bytes makes when no cached block fits (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


DEFAULT_CONFIG = AllocatorConfig()  # PyTorch's defaults
