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

from memlab.core.env import parse_device, parse_small, read_env
from memlab.core.units import GiB
from memlab.core.validation import check_int

T = TypeVar("T")

# the parsing lives in memlab.core.env, so ``memlab doctor`` can report on a bad value without
# importing this module (which refuses it)
DEVICE: torch.device
SMALL: bool
DEVICE, SMALL = read_env()


def pick(full: T, small: T) -> T:
    """``small`` at small scale (:data:`SMALL`: CPU, or ``MEMLAB_SMALL=1``), else ``full``."""
    return small if SMALL else full


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy (when installed) and torch (CPU and every CUDA device) with ``seed``, an
    int >= 0 (NumPy gets it modulo 2**32, its limit).

    Raises:
        ValueError: for a seed that is not an int >= 0.
    """
    check_int("seed", seed, minimum=0)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency, but stay robust
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device


def bf16_supported(device: torch.device | None = None) -> bool:
    """Whether bfloat16 arithmetic runs on ``device`` (default :data:`DEVICE`; on CPU: whether a
    small bf16 matmul gives the right answer)."""
    device = DEVICE if device is None else torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        a = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
        return bool((a @ a).float().sum().item() == 64.0)
    except Exception:  # pragma: no cover - depends on the build
        return False


def describe() -> str:
    """The course's device and scale in one line: device, GPU name and memory (GiB), 16-bit
    support, torch version and scale."""
    scale = "small scale" if SMALL else "full scale"
    if DEVICE.type == "cuda":
        idx = DEVICE.index if DEVICE.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        gib = props.total_memory / GiB
        dtypes = "fp16, bf16" if torch.cuda.is_bf16_supported() else "fp16 (no bf16)"
        return (
            f"device cuda:{idx} ({props.name}, {gib:.1f} GiB, compute {props.major}.{props.minor}); "
            f"16-bit: {dtypes}; torch {torch.__version__}; {scale}"
        )
    dtypes = "bf16, fp16 (emulated on CPU)" if bf16_supported(DEVICE) else "fp16 only"
    return f"device {DEVICE} ({os.cpu_count()} cores); 16-bit: {dtypes}; torch {torch.__version__}; {scale}"


__all__ = ["DEVICE", "SMALL", "pick", "seed_everything", "describe", "bf16_supported", "read_env", "parse_device",
           "parse_small"]
