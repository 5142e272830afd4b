"""The course's two environment variables, parsed in one place: ``MEMLAB_DEVICE`` and ``MEMLAB_SMALL``.

:mod:`memlab.config` reads them once at import (and refuses a bad value there);
``memlab doctor`` reports on them without importing :mod:`memlab.config` (which would raise).
Nothing here imports torch at module level: :func:`parse_device` imports it when called.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping

from memlab.core.validation import invalid

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TRUE_WORDS", "FALSE_WORDS", "SMALL_ALLOWED", "DEVICE_ALLOWED", "parse_device", "parse_small",
           "read_env"]

#: spellings of MEMLAB_SMALL that mean "small scale"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
#: spellings that mean "the device's default" (small on CPU, full on CUDA); empty counts as unset
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})
SMALL_ALLOWED = "1/0, true/false, yes/no, on/off"
DEVICE_ALLOWED = "a device torch understands: 'cpu', 'cuda', 'cuda:N'"


def parse_device(raw: str | None, *, cuda_available: bool | None = None) -> "torch.device":
    """The device ``MEMLAB_DEVICE`` asks for (``raw``, None when unset), or when it is unset or
    empty the automatic choice: ``cuda`` when available, else ``cpu``.

    Args:
        cuda_available: whether a CUDA GPU is present; None asks ``torch.cuda.is_available()``.

    Raises:
        ValueError: ``MEMLAB_DEVICE=... is invalid; allowed: ...`` for a name torch does not
            understand, or a CUDA device without CUDA.
    """
    import torch

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    name = (raw or "").strip()
    if not name:
        return torch.device("cuda" if cuda_available else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise invalid("MEMLAB_DEVICE", raw, DEVICE_ALLOWED) from exc
    if dev.type == "cuda" and not cuda_available:
        raise invalid("MEMLAB_DEVICE", raw, "'cpu' (it asks for CUDA but torch.cuda.is_available() is False)")
    return dev


def parse_small(raw: str | None, *, device_type: str) -> bool:
    """Whether the course runs at small scale: True when ``MEMLAB_SMALL`` (``raw``, None when
    unset) is one of TRUE_WORDS; unset or one of FALSE_WORDS, ``device_type != "cuda"`` (a CPU
    always runs small: the full sizes need a GPU).

    Raises:
        ValueError: ``MEMLAB_SMALL=... is invalid; allowed: 1/0, true/false, yes/no, on/off``.
    """
    if raw is None:
        return device_type != "cuda"
    val = raw.strip().lower()
    if val in TRUE_WORDS:
        return True
    if val in FALSE_WORDS:
        return device_type != "cuda"
    raise invalid("MEMLAB_SMALL", raw, SMALL_ALLOWED)


def read_env(environ: Mapping[str, str] | None = None, *,
             cuda_available: bool | None = None) -> tuple["torch.device", bool]:
    """``(device, small)`` from ``MEMLAB_DEVICE`` and ``MEMLAB_SMALL`` of ``environ`` (default
    ``os.environ``), as :mod:`memlab.config` sets them; ``cuda_available`` None asks torch.

    Raises:
        ValueError: naming the variable, its value and what is allowed.
    """
    env = os.environ if environ is None else environ
    device = parse_device(env.get("MEMLAB_DEVICE"), cuda_available=cuda_available)
    return device, parse_small(env.get("MEMLAB_SMALL"), device_type=device.type)
