"""Device and scale, decided once for the whole course.

* ``DEVICE``: ``torch.device("cuda")`` when a CUDA GPU is present, else CPU. The environment
  variable ``MEMLAB_DEVICE`` (``cpu``, ``cuda``, ``cuda:1`` ...) overrides the choice.
* ``SMALL``: True on CPU, or when ``MEMLAB_SMALL=1``. Notebooks size their experiments with
  ``pick(full=..., small=...)`` so that the same cell runs in seconds on a laptop and at full
  scale on a GPU.
"""
from __future__ import annotations

import os
import random
from typing import TypeVar

import torch

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def device_from_env(raw: str | None = None, *, cuda_available: bool | None = None) -> torch.device:
    """The device ``MEMLAB_DEVICE`` names (empty or unset: CUDA when present, else CPU).

    Args:
        raw: the variable's value (default: read ``MEMLAB_DEVICE`` from the environment now).
        cuda_available: whether a CUDA GPU is present (default: ``torch.cuda.is_available()``).

    Returns:
        The device.

    Raises:
        ValueError: naming the variable, when torch does not understand it or it asks for CUDA without one.
    """
    name = (os.environ.get("MEMLAB_DEVICE", "") if raw is None else raw).strip()
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not name:
        return torch.device("cuda" if cuda else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(
            f"MEMLAB_DEVICE={name!r} is not a device torch understands; allowed: 'cpu', 'cuda', 'cuda:N'"
        ) from exc
    if dev.type == "cuda" and not cuda:
        raise ValueError(f"MEMLAB_DEVICE={name!r} asks for CUDA but torch.cuda.is_available() is False")
    return dev


def small_from_env(device: torch.device, raw: str | None = None) -> bool:
    """Whether the course runs at small scale: ``MEMLAB_SMALL``, else True off CUDA.

    Args:
        device: the device the course runs on.
        raw: the variable's value (default: read ``MEMLAB_SMALL`` from the environment now).

    Returns:
        True for small scale.

    Raises:
        ValueError: naming the variable, when its value is not one of the allowed spellings.
    """
    raw = os.environ.get("MEMLAB_SMALL") if raw is None else raw
    if raw is None:
        return device.type != "cuda"
    val = raw.strip().lower()
    if val in _TRUE:
        return True
    if val in _FALSE:
        return device.type != "cuda"
    raise ValueError(f"MEMLAB_SMALL={raw!r} is not understood; allowed: 1/0, true/false, yes/no, on/off")


DEVICE: torch.device = device_from_env()
SMALL: bool = small_from_env(DEVICE)


def pick(full: T, small: T) -> T:
    """Return ``small`` at small scale (CPU or ``MEMLAB_SMALL=1``), else ``full``."""
    return small if SMALL else full


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy (when installed) and torch (CPU and every CUDA device)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency, but stay robust
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device


def bf16_supported(device: torch.device | None = None) -> bool:
    """Whether bfloat16 arithmetic runs on ``device`` (default: ``DEVICE``)."""
    device = DEVICE if device is None else torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        a = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
        return bool((a @ a).float().sum().item() == 64.0)
    except Exception:  # pragma: no cover - depends on the build
        return False


def describe() -> str:
    """One line: device, GPU name and memory, 16-bit support, scale."""
    scale = "small scale" if SMALL else "full scale"
    if DEVICE.type == "cuda":
        idx = DEVICE.index if DEVICE.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        gib = props.total_memory / 2**30
        dtypes = "fp16, bf16" if torch.cuda.is_bf16_supported() else "fp16 (no bf16)"
        return (
            f"device cuda:{idx} ({props.name}, {gib:.1f} GiB, compute {props.major}.{props.minor}); "
            f"16-bit: {dtypes}; torch {torch.__version__}; {scale}"
        )
    dtypes = "bf16, fp16 (emulated on CPU)" if bf16_supported(DEVICE) else "fp16 only"
    return f"device {DEVICE} ({os.cpu_count()} cores); 16-bit: {dtypes}; torch {torch.__version__}; {scale}"


__all__ = ["DEVICE", "SMALL", "pick", "seed_everything", "describe", "bf16_supported"]
