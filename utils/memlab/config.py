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


def _device_from_env() -> torch.device:
    name = os.environ.get("MEMLAB_DEVICE", "").strip()
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(
            f"MEMLAB_DEVICE={name!r} is not a device torch understands; allowed: 'cpu', 'cuda', 'cuda:N'"
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"MEMLAB_DEVICE={name!r} asks for CUDA but torch.cuda.is_available() is False")
    return dev


def _small_from_env(device: torch.device) -> bool:
    raw = os.environ.get("MEMLAB_SMALL")
    if raw is None:
        return device.type != "cuda"
    val = raw.strip().lower()
    if val in _TRUE:
        return True
    if val in _FALSE:
        return device.type != "cuda"
    raise ValueError(f"MEMLAB_SMALL={raw!r} is not understood; allowed: 1/0, true/false, yes/no, on/off")


DEVICE: torch.device = _device_from_env()
SMALL: bool = _small_from_env(DEVICE)


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
