"""Mixed precision from scratch: number formats, dynamic loss scaling, fp32 master weights.

Three pieces, each checked against PyTorch in tests/test_amp.py:

* **Formats.** fp32, fp16 and bf16 differ in how their bits split between exponent (range) and
  mantissa (precision). :func:`format_table` lists range and epsilon from ``torch.finfo``;
  :func:`bit_fields` shows the sign / exponent / mantissa bits of a number;
  :func:`underflow_fraction` measures the share of non-zero values that a cast flushes to zero.

* **Dynamic loss scaling** (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.2;
  the dynamic variant is the one in torch.amp). Small gradients underflow in fp16, so the loss is
  multiplied by a scale S before backward; the chain rule makes every gradient S times larger.
  Before the optimizer step the gradients are multiplied by 1/S. If any gradient is inf/NaN the
  step is skipped and S shrinks; after ``growth_interval`` clean steps in a row S grows::

      found_inf:  S <- S * backoff_factor,  tracker <- 0
      otherwise:  tracker <- tracker + 1;  if tracker == growth_interval: S <- S * growth_factor, tracker <- 0

  :class:`DynamicLossScaler` does this with plain torch ops and runs bitwise in lockstep with
  ``torch.amp.GradScaler`` (same scale after every update, same skipped steps, same parameters,
  same misuse errors).

* **fp32 master weights** (Micikevicius et al. 2018, sec. 3.1). :class:`MasterWeights` keeps the
  model in 16 bits for compute and an fp32 copy for the update, so that an update much smaller
  than the weight (lr * grad < weight * 2**-11 in fp16) is not rounded away. The bytes per
  parameter for Adam become 2 (16-bit weights) + 2 (16-bit grads) + 4 (fp32 master) + 8 (Adam m,
  v) = 16 between steps, the same as fp32 training; during the update, when the 16-bit grads have
  been copied into fp32 grads of the masters, it is 2 + 4 + 4 + 8 = 18 (:func:`update_peak_bytes`,
  measured): "half precision" halves activations, not model states.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from memlab.accounting import unique_bytes

__all__ = [
    "FORMATS",
    "format_info",
    "format_table",
    "format_table_str",
    "bit_fields",
    "round_trip",
    "underflow_fraction",
    "overflow_fraction",
    "OpRecord",
    "record_op_dtypes",
    "summarize_op_dtypes",
    "unscale_grads_",
    "update_scale_",
    "OptState",
    "DynamicLossScaler",
    "MasterWeights",
    "master_step",
    "copy_grads_to_master",
    "copy_master_to_model",
]

# ----------------------------------------------------------------------------- number formats
FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def _as_float_dtype(dtype: Any, name: str = "dtype") -> torch.dtype:
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        aliases = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
        key = aliases.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
        if key in ("fp64", "float64", "double"):
            return torch.float64
    if isinstance(dtype, torch.dtype) and dtype in _FLOAT_DTYPES:
        return dtype
    raise ValueError(
        f"{name}={dtype!r} is not a supported floating-point format; allowed: torch.float32, "
        f"torch.float16, torch.bfloat16, torch.float64 (or 'fp32', 'fp16', 'bf16', 'fp64')"
    )


def format_info(dtype: torch.dtype | str) -> dict[str, Any]:
    """Bit layout, range and precision of a floating-point dtype, from ``torch.finfo``.

    Keys: name, bits, sign_bits (1), exponent_bits, mantissa_bits (stored fraction bits),
    max, smallest_normal, smallest_subnormal (= smallest_normal * eps), eps (the gap between
    1.0 and the next number, 2**-mantissa_bits), decimal_digits (``finfo.precision``).
    """
    dtype = _as_float_dtype(dtype)
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
    """One :func:`format_info` row per dtype."""
    return [format_info(d) for d in dtypes]


def format_table_str(dtypes: Sequence[torch.dtype | str] = ("fp32", "fp16", "bf16")) -> str:
    """:func:`format_table` as aligned text."""
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
    """
    dtype = _as_float_dtype(dtype)
    info = format_info(dtype)
    t = torch.as_tensor(x, dtype=torch.float64).to(dtype).reshape(())
    raw = int(t.view(_INT_VIEW[dtype]).item()) & ((1 << info["bits"]) - 1)
    s = format(raw, f"0{info['bits']}b")
    e = info["exponent_bits"]
    return s[0], s[1 : 1 + e], s[1 + e :]


def round_trip(t: torch.Tensor, dtype: torch.dtype | str = torch.float16) -> torch.Tensor:
    """``t`` cast to ``dtype`` and back to its own dtype: what storing it in ``dtype`` keeps."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t must be a torch.Tensor, got {type(t).__name__}")
    return t.to(_as_float_dtype(dtype)).to(t.dtype)


def underflow_fraction(t: torch.Tensor, dtype: torch.dtype | str = torch.float16) -> float:
    """Share of the non-zero finite values of ``t`` that become exactly zero when cast to ``dtype``.

    Values below half the smallest subnormal of ``dtype`` round to zero (2**-25 for fp16,
    about 4.6e-41 for bf16). Returns 0.0 when ``t`` has no non-zero finite value.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t must be a torch.Tensor, got {type(t).__name__}")
    dtype = _as_float_dtype(dtype)
    t = t.detach()
    nonzero = (t != 0) & torch.isfinite(t)
    n = int(nonzero.sum().item())
    if n == 0:
        return 0.0
    flushed = nonzero & (t.to(dtype) == 0)
    return int(flushed.sum().item()) / n


def overflow_fraction(t: torch.Tensor, dtype: torch.dtype | str = torch.float16) -> float:
    """Share of the finite values of ``t`` that become inf when cast to ``dtype``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t must be a torch.Tensor, got {type(t).__name__}")
    dtype = _as_float_dtype(dtype)
    t = t.detach()
    finite = torch.isfinite(t)
    n = int(finite.sum().item())
    if n == 0:
        return 0.0
    return int((finite & torch.isinf(t.to(dtype))).sum().item()) / n


# ----------------------------------------------------------------------------- autocast coverage
@dataclass(frozen=True)
class OpRecord:
    """One aten op that ran: its name, the dtypes of its floating tensor inputs, its output dtype."""

    name: str
    input_dtypes: tuple[torch.dtype, ...]
    output_dtype: torch.dtype | None


def record_op_dtypes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[OpRecord]]:
    """Run ``fn(*args, **kwargs)`` and record every aten op with its input and output dtypes.

    Uses a ``TorchDispatchMode``, which sits below autocast in the dispatcher, so under
    ``torch.autocast`` it sees the ops as they really ran (after autocast inserted its casts,
    which show up as ``_to_copy``). Returns ``(fn's result, records)``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    records: list[OpRecord] = []

    def _dtypes(xs: Iterable[Any]) -> tuple[torch.dtype, ...]:
        out = []
        for x in xs:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                out.append(x.dtype)
            elif isinstance(x, (list, tuple)):
                out.extend(_dtypes(x))
        return tuple(out)

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            records.append(
                OpRecord(
                    func.overloadpacket.__name__,
                    _dtypes(list(args) + list((kwargs or {}).values())),
                    first.dtype if isinstance(first, torch.Tensor) else None,
                )
            )
            return out

    with _Recorder():
        result = fn(*args, **kwargs)
    return result, records


_VIEW_LIKE = {"view", "_unsafe_view", "transpose", "t", "expand", "slice", "split", "detach", "permute",
              "select", "unsqueeze", "squeeze", "reshape", "alias", "as_strided", "clone", "arange", "_to_copy"}


def summarize_op_dtypes(records: Sequence[OpRecord], *, compute_only: bool = True) -> dict[str, dict[str, int]]:
    """{op name: {output dtype name: count}}, sorted by op name.

    ``compute_only`` leaves out views, copies and casts (``_to_copy``), which do no arithmetic.
    """
    table: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        if compute_only and r.name in _VIEW_LIKE:
            continue
        if r.output_dtype is None or not r.output_dtype.is_floating_point:
            continue
        table[r.name][str(r.output_dtype).replace("torch.", "")] += 1
    return {k: dict(table[k]) for k in sorted(table)}


# ----------------------------------------------------------------------------- scaler kernels
def unscale_grads_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply every tensor in ``grads`` by ``inv_scale`` in place; set ``found_inf`` to 1.0 if any
    element of any of them is inf or NaN. ``found_inf`` is never reset here (the caller zeroes it).

    What ``torch._amp_foreach_non_finite_check_and_unscale_`` does, in plain torch ops: fp32/fp64
    grads are multiplied in their own precision; fp16/bf16 grads in fp32 and rounded back; an
    ``inv_scale`` of exactly 1.0 leaves the values untouched. No host-device synchronisation.
    """
    if found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise ValueError(f"found_inf must be a 1-element float32 tensor, got {found_inf.dtype} with {found_inf.numel()} elements")
    if inv_scale.dtype != torch.float32 or inv_scale.numel() != 1:
        raise ValueError(f"inv_scale must be a 1-element float32 tensor, got {inv_scale.dtype} with {inv_scale.numel()} elements")
    is_one = inv_scale == 1.0
    for g in grads:
        bad = torch.logical_not(torch.isfinite(g)).any()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
        if g.dtype in (torch.float16, torch.bfloat16):
            scaled = (g.float() * inv_scale).to(g.dtype)
        else:
            scaled = g * inv_scale
        g.copy_(torch.where(is_one, g, scaled))


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> torch.Tensor:
    """The dynamic loss-scale update, in place (what ``torch._amp_update_scale_`` does).

    ``scale`` is a 0-dim float32 tensor, ``growth_tracker`` a 0-dim int32 tensor counting clean
    steps in a row, ``found_inf`` a 0-dim float32 tensor (> 0: this step saw inf/NaN).

    * inf/NaN: scale <- scale * backoff_factor; tracker <- 0.
    * clean: tracker + 1; when it reaches growth_interval, scale <- scale * growth_factor
      (unless that overflows fp32 to inf) and tracker <- 0.

    The products are formed in float64 and rounded to float32 once, as the C++ kernels do
    (float * double). No host-device synchronisation. Returns ``scale``.
    """
    found = found_inf.reshape(()) > 0
    successful = growth_tracker.reshape(()) + 1
    reached = successful == growth_interval
    backed = (scale.double() * backoff_factor).float()
    grown = (scale.double() * growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, scale)
    new_scale = torch.where(found, backed, torch.where(reached, grown, scale))
    zero = torch.zeros_like(growth_tracker)
    new_tracker = torch.where(found | reached, zero, successful.to(growth_tracker.dtype))
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    return scale


# ----------------------------------------------------------------------------- the scaler
class OptState(Enum):
    """Where an optimizer is within one iteration (between two ``update()`` calls)."""

    READY = 0  # nothing done yet
    UNSCALED = 1  # unscale_() ran: grads are true gradients, inf checks recorded
    STEPPED = 2  # step() ran


def _fresh_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


_FIX = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."


class DynamicLossScaler:
    """Dynamic loss scaling, step for step what ``torch.amp.GradScaler`` does.

    Usage (identical to GradScaler's)::

        scaler = DynamicLossScaler()
        scaler.scale(loss).backward()      # gradients are now S times too large
        scaler.unscale_(optimizer)         # optional: true gradients, e.g. to clip them
        stepped = scaler.step(optimizer)   # unscale if not done, skip the step on inf/NaN
        scaler.update()                    # back off on inf/NaN, grow after growth_interval clean steps

    The scale and the clean-step counter live in 0-dim tensors on the loss's device, created at
    the first ``scale()``. Unscaling multiplies by the fp32 reciprocal of the scale computed in
    fp64 (``scale.double().reciprocal().float()``), as GradScaler does, so gradients, skipped
    steps and parameters match it bitwise.

    One difference: ``step()`` returns whether the optimizer stepped (True / False) instead of
    ``optimizer.step()``'s return value. Misuse raises the same exception types with the same
    messages as GradScaler (e.g. calling ``unscale_`` twice in one iteration).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled={enabled!r} must be True or False")
        self._enabled = enabled
        if not enabled:
            return
        for name, val in (("init_scale", init_scale), ("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
                raise ValueError(f"{name}={val!r} must be a finite number")
        if init_scale <= 0:
            raise ValueError(f"init_scale={init_scale!r} must be > 0")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor={growth_factor!r} must be > 1.0 (the scale grows after clean steps)")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor!r} must be in (0, 1) (the scale shrinks after an inf/NaN)")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} must be an int >= 1")
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_state)

    # -- helpers
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _FIX)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + _FIX)
        return self._scale, self._growth_tracker

    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)

    # -- public API
    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or a nested list/tuple of tensors) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if self._scale is None:
                    self._lazy_init(val.device)
                if val.device not in per_device:
                    per_device[val.device] = self._scale.to(device=val.device, non_blocking=True, copy=True)
                return val * per_device[val.device]
            if isinstance(val, Iterable):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _unscale_grads(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if not allow_fp16 and p.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if p.grad.is_sparse:
                        if p.grad.dtype is torch.float16:
                            p.grad = p.grad.coalesce()  # duplicates summed first: the sum may overflow
                        g = p.grad._values()
                    else:
                        g = p.grad
                    groups[g.device][g.dtype].append(g)
            found: dict[torch.device, torch.Tensor] = {}
            inv: dict[torch.device, torch.Tensor] = {}
            for device, per_dtype in groups.items():
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv[device] = inv_scale.to(device=device, copy=True)
                for grads in per_dtype.values():
                    unscale_grads_(grads, found[device], inv[device])
        return found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this optimizer's gradients by the scale, in place, and record whether any is inf/NaN.

        Optional: ``step()`` does it when you have not. Call it once per optimizer per iteration,
        after all gradients were accumulated (e.g. before clipping them).
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        # the reciprocal in fp64, rounded once to fp32: 1/S exactly for powers of two, and the
        # same bits as GradScaler for any other scale
        inv_scale = self._scale.double().reciprocal().float()
        state["found_inf_per_device"] = self._unscale_grads(optimizer, inv_scale, allow_fp16=False)
        state["stage"] = OptState.UNSCALED

    def _found_inf(self, state: dict[str, Any], device: torch.device) -> torch.Tensor:
        return sum((t.to(device, non_blocking=True) for t in state["found_inf_per_device"].values()),
                   torch.zeros((), dtype=torch.float32, device=device))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale (if ``unscale_`` was not called), then ``optimizer.step()`` unless a gradient is inf/NaN.

        Returns True when the optimizer stepped, False when the step was skipped.
        """
        if not self._enabled:
            optimizer.step(*args, **kwargs)
            return True
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # fused optimizers unscale and skip inside their own kernel: they read
            # optimizer.grad_scale (None: grads already unscaled) and optimizer.found_inf
            if state["stage"] is OptState.READY:
                state["found_inf_per_device"] = self._unscale_grads(
                    optimizer, torch.ones((), dtype=torch.float32, device=scale.device), allow_fp16=True
                )
            found_inf = self._found_inf(state, scale.device)
            optimizer.grad_scale = (  # type: ignore[attr-defined]
                getattr(optimizer, "grad_scale", None)
                if state["stage"] is OptState.UNSCALED
                else scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
            # an optimizer holding its gradients off the device (OffloadedAdamW) records its own check in step()
            found_inf = self._found_inf(state, scale.device)
            return not bool(found_inf)

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        skipped = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
        if not skipped:
            optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return not skipped

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off after an iteration with inf/NaN gradients, grow after ``growth_interval`` clean ones.

        ``new_scale`` sets the scale by hand instead. Call once per iteration, after every
        ``step()``.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if not isinstance(new_scale, torch.Tensor) or new_scale.device.type != scale.device.type:
                    raise AssertionError(reason)
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                scale.copy_(new_scale.reshape(()))
        else:
            found = [
                t.to(device=scale.device, non_blocking=True)
                for st in self._per_optimizer_states.values()
                for t in st["found_inf_per_device"].values()
            ]
            if len(found) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            combined = found[0]
            for t in found[1:]:
                combined = combined + t
            update_scale_(scale, tracker, combined, self._growth_factor, self._backoff_factor, self._growth_interval)
        self._per_optimizer_states = defaultdict(_fresh_state)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled; init_scale before the first scale())."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_tracker(self) -> int:
        """Clean steps in a row since the scale last changed."""
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def state_dict(self) -> dict[str, Any]:
        """The keys GradScaler uses: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker
        (empty when disabled), so either class loads the other's checkpoint."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self.get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker") if k not in state_dict]
        if missing:
            raise KeyError(f"state_dict is missing {', '.join(missing)}; it must come from state_dict() of a scaler")
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])

    def __repr__(self) -> str:
        if not self._enabled:
            return "DynamicLossScaler(enabled=False)"
        return (
            f"DynamicLossScaler(scale={self.get_scale():g}, growth_factor={self._growth_factor:g}, "
            f"backoff_factor={self._backoff_factor:g}, growth_interval={self._growth_interval}, "
            f"growth_tracker={self.get_growth_tracker()})"
        )


# ----------------------------------------------------------------------------- master weights
@torch.no_grad()
def copy_grads_to_master(
    model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor], *, free_model_grads: bool = False
) -> None:
    """master.grad <- float32(model.grad) for each pair; a missing model grad clears the master's."""
    for p, m in zip(model_params, master_params, strict=True):
        if p.grad is None:
            m.grad = None
            continue
        if m.grad is None or m.grad.shape != p.grad.shape:
            m.grad = p.grad.to(torch.float32)
        else:
            m.grad.copy_(p.grad)
        if free_model_grads:
            p.grad = None


@torch.no_grad()
def copy_master_to_model(model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor]) -> None:
    """model <- master rounded to the model's dtype (round to nearest even, as ``Tensor.to`` does)."""
    for p, m in zip(model_params, master_params, strict=True):
        p.copy_(m)


def master_step(
    model_params: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: Any = None,
    *,
    free_model_grads: bool = False,
) -> bool:
    """One fp32-master-weights update of a 16-bit model (Micikevicius et al. 2018, sec. 3.1).

    1. the 16-bit gradients are copied into fp32 gradients of the masters;
    2. ``optimizer`` (built over ``master_params``) steps in fp32: through ``scaler.step`` when a
       scaler is given, which unscales the fp32 gradients and skips the step on inf/NaN;
    3. the masters are rounded back into the 16-bit model.

    Returns False when the scaler skipped the step (only knowable with a
    :class:`DynamicLossScaler`, whose ``step`` returns it; True otherwise).
    """
    copy_grads_to_master(model_params, master_params, free_model_grads=free_model_grads)
    if scaler is None:
        optimizer.step()
        stepped = True
    else:
        out = scaler.step(optimizer)
        stepped = out if isinstance(out, bool) else True
    if stepped:
        copy_master_to_model(model_params, master_params)
    return stepped


class MasterWeights:
    """A 16-bit model for compute with an fp32 master copy for the update (Micikevicius et al. 2018).

    ``MasterWeights(model, make_optimizer, dtype=torch.float16)``:

    1. copies every parameter to an fp32 *master* tensor (exact: the model's own values), then
       casts the model to ``dtype`` (forward and backward now run in 16 bits);
    2. builds the optimizer with ``make_optimizer(master_params)``: it only ever sees fp32;
    3. ``step(scaler=None)``: copies each 16-bit gradient into the fp32 master gradient
       (freeing the 16-bit one when ``free_model_grads``), lets the optimizer (or
       ``scaler.step(optimizer)``, which unscales the fp32 copies and skips on inf/NaN) update
       the masters, and rounds the masters back into the 16-bit model.

    The model's weights are therefore always the master weights rounded to ``dtype``, and the
    master weights follow exactly the updates an fp32 optimizer would make from the same
    gradients. Tied parameters (one Parameter used twice) get one master.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        dtype: torch.dtype | str = torch.float16,
        *,
        free_model_grads: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(make_optimizer):
            raise ValueError(f"make_optimizer={make_optimizer!r} must be callable: params -> torch.optim.Optimizer")
        dtype = _as_float_dtype(dtype)
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype} must be torch.float16 or torch.bfloat16 (the model's compute dtype)")
        self.model = model
        self.dtype = dtype
        self.free_model_grads = free_model_grads
        self.model_params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.model_params:
            raise ValueError("model has no parameter with requires_grad=True: nothing to train")
        self.master_params: list[nn.Parameter] = [
            nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.model_params
        ]
        model.to(dtype)
        self.optimizer = make_optimizer(self.master_params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(f"make_optimizer returned {type(self.optimizer).__name__}; expected a torch.optim.Optimizer")

    def copy_grads_to_master(self) -> None:
        """master.grad <- float32(model.grad) for every parameter (None stays None)."""
        copy_grads_to_master(self.model_params, self.master_params, free_model_grads=self.free_model_grads)

    def copy_master_to_model(self) -> None:
        """model weight <- master weight rounded to the model's dtype."""
        copy_master_to_model(self.model_params, self.master_params)

    def step(self, scaler: Any = None) -> bool:
        """One update (see :func:`master_step`). Returns False when a scaler skipped it."""
        return master_step(self.model_params, self.master_params, self.optimizer, scaler, free_model_grads=self.free_model_grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"master": [m.detach().clone() for m in self.master_params], "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master_params, state["master"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.copy_master_to_model()

    def memory_bytes(self) -> dict[str, int]:
        """Live bytes of each model state right now, each storage counted once.

        Keys: "model weights (16-bit)", "model grads (16-bit)", "master weights (fp32)",
        "master grads (fp32)", "optimizer state", "total".
        """
        out = {
            "model weights (16-bit)": unique_bytes(self.model_params),
            "model grads (16-bit)": unique_bytes(p.grad for p in self.model_params),
            "master weights (fp32)": unique_bytes(self.master_params),
            "master grads (fp32)": unique_bytes(m.grad for m in self.master_params),
            "optimizer state": unique_bytes(
                v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
            ),
        }
        out["total"] = sum(out.values())
        return out

    def __repr__(self) -> str:
        n = sum(m.numel() for m in self.master_params)
        return f"MasterWeights({n:,} params, model {self.dtype}, master float32, {type(self.optimizer).__name__})"


# ----------------------------------------------------------------------------- predict, then measure
UPDATE_RECIPES: dict[str, torch.dtype | None] = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _check_update_args(where: str, model: Any, recipe: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"{where}: model={type(model).__name__} must be an nn.Module")
    if recipe not in UPDATE_RECIPES:
        raise ValueError(f"{where}: recipe={recipe!r} is not known; allowed: {', '.join(map(repr, UPDATE_RECIPES))}")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen or not list(model.parameters()):
        raise ValueError(f"{where}: every parameter must train (requires_grad=True) and there must be one; "
                         f"frozen: {frozen[:3]}{' ...' if len(frozen) > 3 else ''}")


def update_peak_bytes(model: nn.Module, recipe: str) -> int:
    """Predicted peak bytes of one AdamW update (the second; Adam's state exists) of ``model``.

    The update :func:`measure_update_peak` measures: gradients as backward leaves them, then
    ``torch.optim.AdamW(..., foreach=False)`` (the for-loop, PyTorch's CPU default). ``recipe``:

    * ``"fp32"``: an fp32 model and its optimizer: 4 (weights) + 4 (grads) + 8 (Adam's m, v) =
      16 bytes per parameter;
    * ``"fp16"`` / ``"bf16"``: :class:`MasterWeights` (``free_model_grads=True``): the 16-bit grads
      are copied into fp32 grads of the fp32 masters (each 16-bit grad freed once copied), then
      the optimizer steps the masters: 2 (16-bit weights) + 4 (fp32 masters) + 4 (their grads)
      + 8 (m, v) = 18 bytes per parameter, more than fp32 training (Micikevicius et al. 2018
      keep an fp32 copy; it is activations that halve, not model states).

    Both add a 4-byte ``step`` tensor per parameter tensor, the model's buffers (floating-point
    ones cast to 16 bits with the model in the 16-bit recipes), and the for-loop
    AdamW's two fp32 temporaries (``exp_avg_sq.sqrt()`` and its quotient) the size of the largest
    parameter. Each parameter counted once (``model.parameters()`` skips tied duplicates). Within
    1% of :class:`memlab.profiler.MemoryTracker`'s measurement.
    """
    _check_update_args("update_peak_bytes", model, recipe)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)
    dtype = UPDATE_RECIPES[recipe]
    if dtype is None:
        buffers = unique_bytes(model.buffers())
    else:  # MasterWeights casts the model, floating-point buffers too, to 16 bits
        seen = {id(b.untyped_storage()): b for b in model.buffers()}
        buffers = sum(b.numel() * (2 if b.is_floating_point() else b.element_size()) for b in seen.values())
    per_param = 16 if dtype is None else 18
    return per_param * n + 2 * 4 * largest + 4 * len(params) + buffers


def measure_update_peak(model: nn.Module, recipe: str, *, seed: int = 0) -> int:
    """Measured peak bytes of one AdamW update of ``model`` (modified: cast and stepped).

    ``"fp32"``: ``AdamW(model.parameters(), lr=1e-3, foreach=False)``; ``"fp16"`` / ``"bf16"``:
    ``MasterWeights(model, that optimizer, dtype)``. Random gradients (in each parameter's dtype,
    as backward would leave them) drive a first update, so Adam's state exists; after
    ``zero_grad(set_to_none=True)`` and fresh gradients, the second update runs inside a
    :class:`memlab.profiler.MemoryTracker` over the model and the optimizer. Returns its peak.
    """
    from memlab.profiler import MemoryTracker

    _check_update_args("measure_update_peak", model, recipe)
    dtype = UPDATE_RECIPES[recipe]

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)

    if dtype is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make(params)
        update: Callable[[], Any] = optimizer.step

        def zero() -> None:
            optimizer.zero_grad(set_to_none=True)
    else:
        mw = MasterWeights(model, make, dtype)
        params, optimizer, update, zero = mw.model_params, mw.optimizer, mw.step, mw.zero_grad
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        zero()
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device=p.device, dtype=p.dtype)
        if optimizer.state:
            break
        update()
    with MemoryTracker(model, optimizer) as tracker:
        update()
    return tracker.peak_bytes


__all__ += ["UPDATE_RECIPES", "update_peak_bytes", "measure_update_peak"]
