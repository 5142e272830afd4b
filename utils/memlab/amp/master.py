"""fp32 master weights: a 16-bit model for compute, an fp32 copy for the update.

Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.1: an update much smaller than the
weight (lr * grad < weight * 2**-11 in fp16) is rounded away in 16 bits, so the optimizer steps an
fp32 copy and the 16-bit model is that copy rounded.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from memlab.accounting import unique_bytes
from memlab.amp.formats import as_float_dtype
from memlab.core.validation import invalid

__all__ = ["copy_grads_to_master", "copy_master_to_model", "master_step", "MasterWeights"]


@torch.no_grad()
def copy_grads_to_master(
    model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor], *, free_model_grads: bool = False
) -> None:
    """master.grad <- float32(model.grad) for each pair (the fp32 masters in the 16-bit parameters'
    order); a missing model grad clears the master's. ``free_model_grads`` drops each 16-bit gradient
    once copied (its bytes are free for the update)."""
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

    Args:
        scaler: None, a :class:`memlab.amp.DynamicLossScaler` or a ``torch.amp.GradScaler``.

    Returns:
        False when the scaler skipped the step (only knowable with a DynamicLossScaler, whose
        ``step`` returns it); True otherwise.
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

    Args:
        model: the model, cast to ``dtype`` in place.
        make_optimizer: ``params -> torch.optim.Optimizer``, called with the fp32 masters.
        dtype: the compute dtype, torch.float16 or torch.bfloat16 (or "fp16", "bf16").

    Raises:
        ValueError: naming the argument that is not usable.
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
            raise invalid("model", model, "an nn.Module")
        if not callable(make_optimizer):
            raise invalid("make_optimizer", make_optimizer, "a callable params -> torch.optim.Optimizer")
        dtype = as_float_dtype(dtype)
        if dtype not in (torch.float16, torch.bfloat16):
            raise invalid("dtype", dtype, "torch.float16 or torch.bfloat16 (the model's compute dtype)")
        self.model = model
        self.dtype = dtype
        self.free_model_grads = free_model_grads
        self.model_params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.model_params:
            raise invalid("model", model, "a model with a parameter that requires grad (nothing to train)")
        self.master_params: list[nn.Parameter] = [
            nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.model_params
        ]
        model.to(dtype)
        self.optimizer = make_optimizer(self.master_params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise invalid("make_optimizer", make_optimizer,
                          f"a callable returning a torch.optim.Optimizer (it returned {type(self.optimizer).__name__})")

    def copy_grads_to_master(self) -> None:
        """master.grad <- float32(model.grad) for every parameter (None stays None)."""
        copy_grads_to_master(self.model_params, self.master_params, free_model_grads=self.free_model_grads)

    def copy_master_to_model(self) -> None:
        """model weight <- master weight rounded to the model's dtype."""
        copy_master_to_model(self.model_params, self.master_params)

    def step(self, scaler: Any = None) -> bool:
        """One update (see :func:`master_step`); False when a scaler skipped it, else True."""
        return master_step(self.model_params, self.master_params, self.optimizer, scaler, free_model_grads=self.free_model_grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the 16-bit and the fp32 gradients (``set_to_none``: free their bytes rather than fill zeros)."""
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"master": copies of the fp32 masters, "optimizer": the optimizer's state_dict}``."""
        return {"master": [m.detach().clone() for m in self.master_params], "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the masters and the optimizer from :meth:`state_dict`, then round the masters into the model."""
        with torch.no_grad():
            for m, saved in zip(self.master_params, state["master"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.copy_master_to_model()

    def memory_bytes(self) -> dict[str, int]:
        """Live bytes of each model state right now, each storage counted once: "model weights (16-bit)",
        "model grads (16-bit)", "master weights (fp32)", "master grads (fp32)", "optimizer state", "total"."""
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

