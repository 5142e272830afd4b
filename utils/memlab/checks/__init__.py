"""The graded checks, one module per chapter (``ch00.py``, ``ch01.py`` ...).

Each check is plain code a learner can read: it calls your function or class on a few inputs
and compares the answer with memlab's own implementation, raising AssertionError with a
message that says what was expected. ``memlab.grading.check`` runs them.

Helpers below keep the messages uniform: "name: got X, expected Y".
"""
from __future__ import annotations

import math
from typing import Any

from memlab.grading import register

__all__ = ["register", "expect", "expect_equal", "expect_close", "expect_tensor_close", "expect_type"]


def expect(condition: bool, message: str) -> None:
    """Fail with ``message`` unless ``condition`` holds."""
    if not condition:
        raise AssertionError(message)


def expect_type(name: str, got: Any, kind: type | tuple[type, ...]) -> None:
    names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    expect(isinstance(got, kind), f"{name}: expected a {names}, got {type(got).__name__} ({got!r:.80})")


def expect_equal(name: str, got: Any, want: Any) -> None:
    expect(got == want, f"{name}: got {got!r}, expected {want!r}")


def expect_close(name: str, got: Any, want: float, rtol: float = 1e-6, atol: float = 0.0) -> None:
    try:
        g = float(got)
    except (TypeError, ValueError):
        raise AssertionError(f"{name}: expected a number, got {type(got).__name__} ({got!r:.80})") from None
    ok = math.isfinite(g) and abs(g - want) <= atol + rtol * abs(want)
    expect(ok, f"{name}: got {g:.6g}, expected {want:.6g} (tolerance {atol + rtol * abs(want):.3g})")


def expect_tensor_close(name: str, got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Shapes and dtypes must match; values within tolerance. Reports the max abs diff."""
    import torch

    expect_type(name, got, torch.Tensor)
    expect(tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    expect(got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}")
    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    if torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
        return
    diff = (g - w).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    raise AssertionError(f"{name}: values differ, max abs diff {diff.max().item():.3g} (rtol={rtol}, atol={atol})")
