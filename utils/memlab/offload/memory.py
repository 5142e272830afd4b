"""Bytes of weights, gradients and optimizer state on the device and on the host, with and without offload.

Mixed-precision AdamW keeps 16 bytes per parameter (2 weights + 2 grads + 4 fp32 master + 8
moments); ZeRO-Offload (Ren et al. 2021) leaves 2 + 2 on the device and moves the rest to the host.
"""
from __future__ import annotations

from torch import nn

from memlab.core.validation import check_choice, check_int

__all__ = ["OFFLOAD_RECIPES", "DEVICE_RECIPES", "device_host_bytes", "predict_device_bytes"]

# bytes per parameter (device, host) of weights + grads + optimizer state; activations not counted
OFFLOAD_RECIPES: dict[str, tuple[int, int]] = {
    "fp32-adamw": (16, 0),  # 4 weights + 4 grads + 8 moments, all on the device
    "mixed-adamw": (16, 0),  # 2 weights + 2 grads + 4 fp32 master + 8 moments, all on the device
    "offload-adamw": (4, 16),  # device: 2 + 2; host: 4 master + 4 fp32 grad slot + 8 moments
    "offload-adamw-grads": (2, 16),  # gradients leave the device during backward
}

#: what :func:`predict_device_bytes` knows
DEVICE_RECIPES = ("adamw", "offload", "offload grads")


def device_host_bytes(n_params: int, recipe: str) -> dict[str, int]:
    """``{"device": bytes, "host": bytes}`` of weights + grads + optimizer state for ``n_params``
    16-bit-trained parameters.

    Activations and the pinned staging buffers (2 host bytes per 16-bit parameter on CUDA) are not counted.

    Args:
        recipe: ``fp32-adamw`` and ``mixed-adamw`` (16 bytes/param on the device), ``offload-adamw``
            (4 on the device, 16 on the host) or ``offload-adamw-grads`` (2 on the device).

    Raises:
        ValueError: a negative or non-int ``n_params``, or an unknown recipe.
    """
    check_int("n_params", n_params, minimum=0)
    check_choice("recipe", recipe, OFFLOAD_RECIPES)
    dev, host = OFFLOAD_RECIPES[recipe]
    return {"device": dev * n_params, "host": host * n_params}


def predict_device_bytes(model: nn.Module, recipe: str) -> int:
    """Device bytes of ``model``'s parameters, buffers, gradients and optimizer state after a step.

    Tied parameters count once. The scalar step counters (4 bytes per tensor) are left out.

    Args:
        model: the model, on its device, in the dtype it trains in.
        recipe: ``"adamw"`` (torch AdamW on the model as it is: weights, grads and two moments in
            the parameters' dtype), ``"offload"`` (OffloadedAdamW: weights and grads stay, states
            leave) or ``"offload grads"`` (OffloadedAdamW with ``offload_gradients=True``: only the
            weights stay).

    Raises:
        ValueError: an unknown recipe.
    """
    check_choice("recipe", recipe, DEVICE_RECIPES)
    params = list({id(p): p for p in model.parameters()}.values())
    weights = sum(p.numel() * p.element_size() for p in params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    per = {"adamw": 3, "offload": 1, "offload grads": 0}[recipe]
    return weights + buffers + per * trained
