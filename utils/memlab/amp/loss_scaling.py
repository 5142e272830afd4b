"""Dynamic loss scaling from scratch, step for step what ``torch.amp.GradScaler`` does.

Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.2 (the dynamic variant is the one in
torch.amp). Small gradients underflow in fp16, so the loss is multiplied by a scale S before
backward; the chain rule makes every gradient S times larger. Before the optimizer step the
gradients are multiplied by 1/S. If any gradient is inf/NaN the step is skipped and S shrinks;
after ``growth_interval`` clean steps in a row S grows::

    found_inf:  S <- S * backoff_factor,  tracker <- 0
    otherwise:  tracker <- tracker + 1;  if tracker == growth_interval: S <- S * growth_factor, tracker <- 0

The two kernels (:func:`unscale_grads_`, :func:`update_scale_`) are plain-torch twins of
``torch._amp_foreach_non_finite_check_and_unscale_`` and ``torch._amp_update_scale_``.
"""
from __future__ import annotations

from collections import defaultdict
from enum import Enum
from typing import Any, Iterable, Sequence

import torch

from memlab.core.validation import check_bool, check_number, check_positive_int, invalid

__all__ = ["unscale_grads_", "update_scale_", "OptState", "DynamicLossScaler"]


def _check_flag(name: str, t: Any) -> None:
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == 1):
        shown = f"{t.dtype} tensor of {t.numel()} elements" if isinstance(t, torch.Tensor) else t
        raise invalid(name, shown, "a 1-element float32 tensor")


def unscale_grads_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply every gradient by ``inv_scale`` in place and flag any inf/NaN in ``found_inf``.

    What ``torch._amp_foreach_non_finite_check_and_unscale_`` does, in plain torch ops: fp32/fp64
    grads are multiplied in their own precision; fp16/bf16 grads in fp32 and rounded back; an
    ``inv_scale`` of exactly 1.0 leaves the values untouched. No host-device synchronisation
    (``torch.where`` instead of a Python ``if`` on a tensor).

    Args:
        grads: the gradients, unscaled in place.
        found_inf: a 1-element float32 tensor, set to 1.0 when an element of a gradient is inf or
            NaN; never reset here (the caller zeroes it).
        inv_scale: a 1-element float32 tensor, 1 / scale.

    Raises:
        ValueError: ``found_inf`` or ``inv_scale`` is not a 1-element float32 tensor.
    """
    _check_flag("found_inf", found_inf)
    _check_flag("inv_scale", inv_scale)
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

    * inf/NaN: scale <- scale * backoff_factor; tracker <- 0.
    * clean: tracker + 1; when it reaches growth_interval, scale <- scale * growth_factor
      (unless that overflows fp32 to inf) and tracker <- 0.

    The products are formed in float64 and rounded to float32 once, as the C++ kernels do
    (float * double). No host-device synchronisation.

    Args:
        scale: a 0-dim float32 tensor, updated in place and returned.
        growth_tracker: a 0-dim int32 tensor counting clean steps in a row, updated in place.
        found_inf: a 0-dim float32 tensor, > 0 when this step saw inf/NaN.
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

    Args:
        init_scale: the first scale S (GradScaler's default 2**16).
        growth_factor: S is multiplied by it after ``growth_interval`` clean steps (> 1).
        backoff_factor: S is multiplied by it after a step with inf/NaN gradients (in (0, 1)).
        growth_interval: clean steps in a row before S grows (an int >= 1).
        enabled: False makes every method a no-op (scale() returns its input, step() steps).

    Raises:
        ValueError: an argument out of range, named with its value.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._enabled = check_bool("enabled", enabled)
        if not enabled:  # GradScaler ignores the other arguments then, and so do we
            return
        check_number("init_scale", init_scale, minimum=0.0, strict_minimum=True)
        # the scale must grow after clean steps and shrink after an inf/NaN, or it never settles
        check_number("growth_factor", growth_factor, minimum=1.0, strict_minimum=True)
        check_number("backoff_factor", backoff_factor, minimum=0.0, strict_minimum=True, maximum=1.0)
        if backoff_factor == 1.0:
            raise invalid("backoff_factor", backoff_factor, "a finite number > 0 and < 1")
        check_positive_int("growth_interval", growth_interval)
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
        """Whether the scaler scales (False: every method is a pass-through)."""
        return self._enabled

    def scale(self, outputs: Any) -> Any:
        """The loss (or a nested list/tuple of tensors) times the current scale S, in the same structure
        (``outputs`` itself when disabled)."""
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

        Raises:
            RuntimeError: called twice in one iteration, or after ``step()`` (GradScaler's messages).
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
        """Unscale (if ``unscale_`` was not called), then ``optimizer.step(*args, **kwargs)`` unless a
        gradient is inf/NaN. Returns True when the optimizer stepped, False when the step was skipped.

        Raises:
            RuntimeError: a closure, or a second ``step()`` before ``update()``.
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

        Call once per iteration, after every ``step()``. ``new_scale`` (a float or a 1-element tensor)
        sets the scale by hand instead.
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
        """The clean steps in a row since the scale last changed."""
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    # GradScaler's getters and setters, unchecked as there (a checkpoint may set them)
    def get_growth_factor(self) -> float:
        """The factor S grows by."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the factor S grows by, from now on."""
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The factor S shrinks by."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the factor S shrinks by, from now on."""
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The clean steps in a row before S grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the clean steps in a row before S grows, from now on."""
        self._growth_interval = new_interval

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, under the keys GradScaler uses, so either class loads the other's checkpoint:
        ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker`` (an empty
        dict when disabled)."""
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
        """Restore what :meth:`state_dict` (ours or GradScaler's) saved.

        Raises:
            RuntimeError: the state is empty (saved by a disabled scaler), as GradScaler says.
            KeyError: a key is missing.
        """
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

