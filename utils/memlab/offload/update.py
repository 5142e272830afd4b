"""The AdamW update rule on tensors, in torch's single-tensor op order, and flat fp32 buffers.

AdamW: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2; the op
order follows ``torch/optim/adam.py`` (``_single_tensor_adam``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from memlab.core.validation import check_number, check_positive_int, invalid

__all__ = ["adamw_step_", "bias_corrections", "check_hparams", "FlatBuffer", "pack"]


# ----------------------------------------------------------------------------- argument checks
def _real(name: str, value: Any) -> float:
    # a tensor hyper-parameter would silently turn the step's Python-float arithmetic into tensor ops
    if isinstance(value, torch.Tensor):
        raise invalid(name, value, "a Python float (not a tensor)")
    return check_number(name, value)


def check_hparams(lr: Any, beta1: Any, beta2: Any, eps: Any, weight_decay: Any) -> None:
    """Check AdamW's hyper-parameters, each a finite Python number (not a tensor): ``lr >= 0``,
    ``beta1`` and ``beta2`` in [0, 1), ``eps > 0``, ``weight_decay >= 0``.

    Raises:
        ValueError: naming the first bad argument, its value and what is allowed.
    """
    if _real("lr", lr) < 0:
        raise invalid("lr", lr, "a finite number >= 0")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= _real(name, b) < 1.0:
            raise invalid(name, b, "a finite number in [0, 1)")
    if _real("eps", eps) <= 0:
        raise invalid("eps", eps, "a finite number > 0")
    if _real("weight_decay", weight_decay) < 0:
        raise invalid("weight_decay", weight_decay, "a finite number >= 0")


def bias_corrections(step: int, beta1: float, beta2: float) -> tuple[float, float]:
    """Adam's bias corrections ``(1 - beta1**step, 1 - beta2**step)`` for update number ``step``
    (counting from 1), in Python floats (double) as torch computes them.

    Raises:
        ValueError: ``step`` is not an int >= 1.
    """
    check_positive_int("step", step)
    return 1 - beta1**step, 1 - beta2**step


# ----------------------------------------------------------------------------- the update rule
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update in place on ``param``, ``exp_avg`` and ``exp_avg_sq``.

    The ops and their order are those of torch's single-tensor AdamW, so the results are bitwise
    equal to ``torch.optim.AdamW(foreach=False)``. ``param`` may be the fp32 master copy; ``grad``
    and the moments have its shape; ``step`` is the number of this update (1 for the first).

    Raises:
        ValueError: a bad hyper-parameter or step, or a tensor whose shape is not ``param``'s.
    """
    check_hparams(lr, beta1, beta2, eps, weight_decay)
    check_positive_int("step", step)
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(t, torch.Tensor) or t.shape != param.shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} has shape {got}; it must have param's shape {tuple(param.shape)}")
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    step_size = lr / bc1
    denom = (exp_avg_sq.sqrt() / bc2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


# ----------------------------------------------------------------------------- flat buffers
class FlatBuffer:
    """One flat contiguous buffer holding several tensors, with a view shaped like each.

    ``offsets[i]`` is where tensor ``i`` starts; ``views[i]`` shares the buffer's storage, so
    writing a view writes the buffer and one kernel call over ``flat`` updates every tensor.
    ``pin_memory`` page-locks the (CPU) buffer, for asynchronous copies to and from CUDA.
    """

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        self.flat = torch.zeros(total, dtype=dtype, device=device, pin_memory=pin_memory)
        self.views = [self.flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def __len__(self) -> int:
        return len(self.views)

    # pickle copies each tensor's storage separately: keep only ``flat`` and cut the views again
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "views"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.views = [self.flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def segment(self, i: int) -> torch.Tensor:
        """The flat 1-D slice (a view of ``flat``) of tensor ``i``."""
        return self.flat[self.offsets[i]:self.offsets[i + 1]]


def pack(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
         pin_memory: bool = False) -> FlatBuffer:
    """Copy ``tensors`` (cast to ``dtype``) into one :class:`FlatBuffer`, in order: ``views[i]`` equals ``tensors[i]``."""
    tensors = list(tensors)
    buf = FlatBuffer([t.shape for t in tensors], dtype=dtype, device=device, pin_memory=pin_memory)
    with torch.no_grad():
        for v, t in zip(buf.views, tensors):
            v.copy_(t.detach())
    return buf
