"""The language-model loss written plainly, and chunk by chunk through autograd.

The loss of a causal language model is the head's matmul followed by cross-entropy over the
vocabulary. For ``N`` tokens, hidden size ``H``, vocabulary ``V``, head ``W`` ``(V, H)``::

    z = h W^T (+ b)                       the logits, (N, V)
    loss = mean over tokens i with t_i != ignore_index of  logsumexp(z_i) - z_i[t_i]

Written this way the ``(N, V)`` logits exist, autograd keeps the log-softmax output (another
``(N, V)`` in fp32) for backward, and backward makes ``(N, V)`` gradients. :func:`chunked_cross_entropy`
computes the same loss a chunk of tokens at a time: the transient copies shrink to a chunk, but
autograd still keeps every chunk's log-probabilities, a whole ``(N, V)`` fp32 tensor, exactly what
the plain loss keeps (chapter 05's chunked attention, again): the training peak never falls below
it. :mod:`memlab.loss.fused` keeps nothing of that size.
"""
from __future__ import annotations

from typing import Any

import torch

from memlab.core.validation import check_int, check_number, check_positive_int, invalid

__all__ = ["materialized_cross_entropy", "chunked_cross_entropy"]
# check_loss_args and accumulation_dtype are the shared internals of reference, fused and triton_fused

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss accumulates in: fp64 for fp64 inputs, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_loss_args(where: str, hidden: Any, weight: Any, targets: Any, bias: Any = None, *,
                    chunk_size: Any = 1024, ignore_index: Any = -100, softcap: Any = None,
                    z_loss: Any = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the loss's arguments; return ``(hidden as (N, H), targets as int64 (N,))``.
    ``where`` names the caller in errors."""
    check_positive_int(f"{where}: chunk_size", chunk_size)
    check_int(f"{where}: ignore_index", ignore_index)
    if softcap is not None:
        check_number(f"{where}: softcap", softcap, minimum=0.0, strict_minimum=True)
    check_number(f"{where}: z_loss", z_loss, minimum=0.0)
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise invalid(f"{where}: {name}", type(t).__name__, "a torch.Tensor")
    if hidden.dim() < 1 or hidden.dtype not in _FLOATS:
        raise invalid(f"{where}: hidden", f"{tuple(hidden.shape)} {hidden.dtype}",
                      "a (..., H) tensor of float16, bfloat16, float32 or float64")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise invalid(f"{where}: weight.shape", tuple(weight.shape), f"(V, {hidden.shape[-1]}): hidden's last dim H")
    if weight.dtype != hidden.dtype:
        raise invalid(f"{where}: weight.dtype", weight.dtype, f"hidden's dtype {hidden.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)
                             or bias.dtype != hidden.dtype):
        shown = f"{tuple(bias.shape)} {bias.dtype}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise invalid(f"{where}: bias", shown, f"None or a ({weight.shape[0]},) tensor of {hidden.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise invalid(f"{where}: targets.dtype", targets.dtype, "an integer dtype (int64)")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise invalid(f"{where}: targets.shape", tuple(targets.shape), f"hidden's shape without its last dim, "
                      f"{tuple(hidden.shape[:-1])}")
    if not (hidden.device == weight.device == targets.device) or (bias is not None and bias.device != hidden.device):
        raise ValueError(f"{where}: hidden, weight, targets (and bias) must be on one device; got {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    t = targets.reshape(-1).long()
    vocab = weight.shape[0]
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    # on fake tensors (memlab.estimate's trace) there are no values to check
    if t.numel() and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor) and bool(bad.any()):
        raise invalid(f"{where}: targets", int(t[bad][0]), f"a class in [0, {vocab}) or ignore_index={ignore_index}")
    return hidden.reshape(-1, hidden.shape[-1]), t


def materialized_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               ignore_index: int = -100, bias: torch.Tensor | None = None,
                               softcap: float | None = None, z_loss: float = 0.0) -> torch.Tensor:
    """The loss the plain way: all ``(N, V)`` logits, upcast, then ``F.cross_entropy`` (the reference).

    Logits are computed in the inputs' dtype and upcast to the accumulation dtype (fp32, fp64 for
    fp64), as transformers' causal-LM loss does; ``softcap`` applies ``softcap * tanh(z / softcap)``
    after the upcast; ``z_loss`` adds ``z_loss * logsumexp(z)^2`` averaged like the loss. The mean
    runs over tokens whose target is not ``ignore_index`` (0 when there are none).
    """
    import torch.nn.functional as F

    h, t = check_loss_args("materialized_cross_entropy", hidden, weight, targets, bias, ignore_index=ignore_index,
                           softcap=softcap, z_loss=z_loss)
    z = F.linear(h, weight, bias).to(accumulation_dtype(h.dtype))
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    valid = t != ignore_index
    total = F.cross_entropy(z, t, ignore_index=ignore_index, reduction="sum")
    if z_loss:
        total = total + z_loss * (torch.logsumexp(z, -1).square() * valid).sum()
    return total / valid.sum().clamp(min=1)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunk_size: int = 1024, ignore_index: int = -100,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The head's matmul and cross-entropy ``chunk_size`` tokens at a time, through autograd.

    Same value as :func:`materialized_cross_entropy`: ``hidden`` ``(..., H)``, ``weight``
    ``(V, H)``, ``targets`` ``(...)``; the mean over tokens whose target is not ``ignore_index``
    (0, not NaN, when every target is ignored), accumulated in fp32 (fp64 for fp64 inputs) whatever
    the inputs' dtype. Autograd keeps each chunk's log-probabilities for backward: the chunks
    together save the plain loss's whole ``(N, V)`` fp32 tensor, so only the transient copies (the
    logits, the gradients in backward) shrink to a chunk.

    Raises:
        ValueError: a bad tensor (shape, dtype, device, a target outside ``[0, V)``), ``chunk_size`` < 1.
    """
    import torch.nn.functional as F

    h, t = check_loss_args("chunked_cross_entropy", hidden, weight, targets, bias, chunk_size=chunk_size,
                           ignore_index=ignore_index)
    acc = accumulation_dtype(h.dtype)
    total = torch.zeros((), dtype=acc, device=h.device)
    for s in range(0, h.shape[0], chunk_size):
        z = F.linear(h[s:s + chunk_size], weight, bias).to(acc)
        total = total + F.cross_entropy(z, t[s:s + chunk_size], ignore_index=ignore_index, reduction="sum")
    return total / (t != ignore_index).sum().clamp(min=1)
