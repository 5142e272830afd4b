"""What a cast does: values a 16-bit format flushes to zero or to inf, and the ops autocast runs in 16 bits.

Underflow is why fp16 training needs loss scaling (Micikevicius et al. 2018, "Mixed Precision
Training", sec. 3.2); the op recorder shows which ops ``torch.autocast`` casts (its per-op lists
are in PyTorch's "Automatic Mixed Precision" docs).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from memlab.amp.formats import as_float_dtype
from memlab.core.validation import invalid

__all__ = ["round_trip", "underflow_fraction", "overflow_fraction", "OpRecord", "record_op_dtypes",
           "summarize_op_dtypes"]


def _tensor(t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise invalid("t", t, "a torch.Tensor")
    return t


def round_trip(t: torch.Tensor, dtype: torch.dtype | str = torch.float16) -> torch.Tensor:
    """``t`` cast to ``dtype`` (a name or dtype, :func:`memlab.amp.formats.as_float_dtype`) and back to
    its own dtype: what storing it in ``dtype`` keeps.

    Raises:
        ValueError: ``t`` is not a tensor or ``dtype`` not a floating-point format.
    """
    return _tensor(t).to(as_float_dtype(dtype)).to(t.dtype)


def underflow_fraction(t: torch.Tensor, dtype: torch.dtype | str = torch.float16) -> float:
    """Share of the non-zero finite values of ``t`` that become exactly zero when cast to ``dtype``.

    Values below half the smallest subnormal of ``dtype`` round to zero (2**-25 for fp16,
    about 4.6e-41 for bf16). 0.0 when ``t`` has no non-zero finite value.

    Raises:
        ValueError: ``t`` is not a tensor or ``dtype`` not a floating-point format.
    """
    t = _tensor(t).detach()
    dtype = as_float_dtype(dtype)
    nonzero = (t != 0) & torch.isfinite(t)
    n = int(nonzero.sum().item())
    if n == 0:
        return 0.0
    flushed = nonzero & (t.to(dtype) == 0)
    return int(flushed.sum().item()) / n


def overflow_fraction(t: torch.Tensor, dtype: torch.dtype | str = torch.float16) -> float:
    """Share of the finite values of ``t`` that become inf when cast to ``dtype`` (0.0 when none is finite).

    Raises:
        ValueError: ``t`` is not a tensor or ``dtype`` not a floating-point format.
    """
    t = _tensor(t).detach()
    dtype = as_float_dtype(dtype)
    finite = torch.isfinite(t)
    n = int(finite.sum().item())
    if n == 0:
        return 0.0
    return int((finite & torch.isinf(t.to(dtype))).sum().item()) / n


@dataclass(frozen=True)
class OpRecord:
    """One aten op that ran: its name, the dtypes of its floating tensor inputs, its output dtype."""

    name: str
    input_dtypes: tuple[torch.dtype, ...]
    output_dtype: torch.dtype | None


def _float_dtypes(xs: Iterable[Any]) -> tuple[torch.dtype, ...]:
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            out.append(x.dtype)
        elif isinstance(x, (list, tuple)):  # e.g. cat's list of tensors
            out.extend(_float_dtypes(x))
    return tuple(out)


def record_op_dtypes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[OpRecord]]:
    """Run ``fn(*args, **kwargs)`` and record every aten op with its input and output dtypes.

    A ``TorchDispatchMode`` sits below autocast in the dispatcher, so under ``torch.autocast`` it
    sees the ops as they really ran, after autocast inserted its casts (which show up as
    ``_to_copy``). Returns ``(fn's result, records)``, the records in the order the ops ran.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    records: list[OpRecord] = []

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            records.append(
                OpRecord(
                    func.overloadpacket.__name__,
                    _float_dtypes(list(args) + list((kwargs or {}).values())),
                    first.dtype if isinstance(first, torch.Tensor) else None,
                )
            )
            return out

    with _Recorder():
        result = fn(*args, **kwargs)
    return result, records


# ops that move, view or cast data but do no arithmetic
_VIEW_LIKE = {"view", "_unsafe_view", "transpose", "t", "expand", "slice", "split", "detach", "permute",
              "select", "unsqueeze", "squeeze", "reshape", "alias", "as_strided", "clone", "arange", "_to_copy"}


def summarize_op_dtypes(records: Sequence[OpRecord], *, compute_only: bool = True) -> dict[str, dict[str, int]]:
    """Count the ops of :func:`record_op_dtypes` by name and output dtype.

    Args:
        compute_only: leave out views, copies and casts (``_to_copy``), which do no arithmetic.

    Returns:
        ``{op name: {output dtype name: count}}``, sorted by op name; ops without a floating
        output are left out.
    """
    table: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        if compute_only and r.name in _VIEW_LIKE:
            continue
        if r.output_dtype is None or not r.output_dtype.is_floating_point:
            continue
        table[r.name][str(r.output_dtype).replace("torch.", "")] += 1
    return {k: dict(table[k]) for k in sorted(table)}
