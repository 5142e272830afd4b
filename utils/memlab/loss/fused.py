"""Fused linear + cross-entropy: a ``torch.autograd.Function`` that never keeps a tokens x vocabulary tensor.

The forward computes the logits a chunk of tokens at a time and keeps, per token, only the
logsumexp ``lse_i`` and the target's logit ``z_i[t_i]``. The backward recomputes each chunk's
logits and turns them into the gradient of the logits, for a mean over ``n`` counted tokens::

    dL/dz_ij = g / n * (softmax(z_i)_j - [j = t_i])           g: the loss's incoming gradient
    dL/dh = (dL/dz) W,    dL/dW = (dL/dz)^T h,    dL/db = sum_i dL/dz_i

accumulating ``dL/dW`` (and ``dL/db``) over chunks in fp32 (fp64 for fp64 inputs). The largest
tensor alive is one chunk's logits, ``chunk_size x V``. The technique: Wijmans et al. 2024, "Cut
Your Losses in Large-Vocabulary Language Models" (arXiv:2411.09009, Apple's Cut Cross-Entropy)
and Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (Hsu et al. 2024, arXiv:2410.10989).

Options:

* ``ignore_index``: those tokens count neither in the sum nor in ``n``; all ignored gives 0.
* ``softcap`` (Gemma 2, Team Gemma 2024, arXiv:2408.00118): ``z <- softcap * tanh(z / softcap)``
  before the softmax; its derivative ``1 - tanh^2`` multiplies ``dL/dz``.
* ``z_loss`` (PaLM, Chowdhery et al. 2022, arXiv:2204.02311): adds ``z_loss * lse_i^2``, averaged
  like the loss; its gradient adds ``2 z_loss lse_i softmax(z_i)`` per token.
* a tied head (``weight`` is the embedding's parameter): autograd adds this gradient to the
  embedding's, as for any parameter used twice.

Under bf16/fp16 a chunk's logits are computed in the inputs' dtype (as the model's head does) and
upcast; the softmax, the sums and the head's gradient accumulate in fp32.
"""
from __future__ import annotations

from typing import Any

import torch

from memlab.loss.reference import accumulation_dtype, check_loss_args

__all__ = ["FusedLinearCrossEntropy", "fused_linear_cross_entropy"]


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    # whether autocast is on for this device, and its dtype (the backward recomputes under the same)
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # an older torch, or a device type without autocast
        return False, torch.float32


class ChunkScratch:
    """One chunk's logits buffer (in the accumulation dtype, plus one in the inputs' dtype when that is
    lower), reused by every chunk: a fresh ``chunk x V`` tensor per chunk would cost the CPU allocator
    its page faults each time; the peak is the same."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, acc: torch.dtype, device: torch.device) -> None:
        self.z = torch.empty(rows, vocab, dtype=acc, device=device)
        self.low = torch.empty(rows, vocab, dtype=dtype, device=device) if dtype != acc else None
        self.aux: torch.Tensor | None = None

    def logits(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``h W^T + b`` in the inputs' dtype (as the model's head computes it), upcast into the buffer."""
        n = h.shape[0]
        z = self.z[:n]
        if _autocast_state(h.device.type)[0]:  # autocast picks the matmul's dtype: no out= under it
            return z.copy_(torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t())
        dst = z if self.low is None else self.low[:n]
        torch.addmm(bias, h, weight.t(), out=dst) if bias is not None else torch.mm(h, weight.t(), out=dst)
        return z if self.low is None else z.copy_(dst)

    def lowered(self, g: torch.Tensor) -> torch.Tensor:
        """``g`` in the inputs' dtype (itself when that is the accumulation dtype)."""
        return g if self.low is None else self.low[:g.shape[0]].copy_(g)

    def second(self, n: int) -> torch.Tensor:
        """A second ``n x V`` buffer in the accumulation dtype (the soft-cap's backward needs two)."""
        if self.aux is None:
            self.aux = torch.empty_like(self.z)
        return self.aux[:n]


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Linear head + cross-entropy, forward and backward chunk by chunk; saves the inputs, the logsumexp
    and the target logits (``N`` numbers each), never the ``(N, V)`` logits.

    ``apply(hidden, weight, targets, bias, ignore_index, chunk_size, softcap, z_loss, divisor)`` with
    ``hidden`` ``(N, H)``, ``targets`` ``(N,)`` int64 and ``divisor`` None (the mean over counted
    tokens) or a number or tensor the sum is divided by (transformers' ``num_items_in_batch``).
    Use :func:`fused_linear_cross_entropy`, which checks the arguments.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None, ignore_index: int, chunk_size: int, softcap: float | None,
                z_loss: float, divisor: Any) -> torch.Tensor:
        acc = accumulation_dtype(hidden.dtype)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        target_logit = torch.zeros(n, dtype=acc, device=hidden.device)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        scratch = ChunkScratch(min(chunk_size, n), weight.shape[0], hidden.dtype, acc, hidden.device)
        with torch.no_grad():
            for s in range(0, n, chunk_size):
                z = scratch.logits(hidden[s:s + chunk_size], weight, bias)
                if softcap is not None:
                    z.div_(softcap).tanh_().mul_(softcap)
                target_logit[s:s + chunk_size] = z.gather(1, safe[s:s + chunk_size, None]).squeeze(1)
                m = z.amax(1, keepdim=True).nan_to_num_(0.0, 0.0, 0.0)  # an all -inf row: lse -inf, as torch
                lse[s:s + chunk_size] = z.sub_(m).exp_().sum(1).log_().add_(m.squeeze(1))
            per_token = lse - target_logit
            if z_loss:
                per_token = per_token + z_loss * lse.square()
            total = torch.where(valid, per_token, 0).sum()
            denom = valid.sum().clamp(min=1) if divisor is None else divisor
            loss = total / denom
        del scratch
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.opts = (ignore_index, chunk_size, softcap, z_loss, denom, _autocast_state(hidden.device.type))
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # None for targets and the options
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        ignore_index, chunk_size, softcap, z_loss, denom, (autocast_on, autocast_dtype) = ctx.opts
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        acc = lse.dtype
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        # |g| / n per token (0 for ignored ones), folded into the exponent: exp(z - lse + log(|g| / n)); the sign of
        # g multiplies the (N, H) and (V, H) results instead of every chunk
        row_scale = torch.where(valid, grad_loss.to(acc).abs() / denom, 0).to(acc)
        shift = lse - row_scale.log()  # +inf for an ignored token: its softmax row comes out 0
        sign = torch.sign(grad_loss.to(acc))
        factor = 1 + 2 * z_loss * lse if z_loss else None  # z-loss: softmax scaled by 1 + 2 z_loss lse
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b and bias is not None else None
        scratch = ChunkScratch(min(chunk_size, hidden.shape[0]), weight.shape[0], hidden.dtype, acc, hidden.device)
        with torch.no_grad():
            for s in range(0, hidden.shape[0], chunk_size):
                h = hidden[s:s + chunk_size]
                sl = slice(s, s + chunk_size)
                with torch.autocast(hidden.device.type, dtype=autocast_dtype, enabled=autocast_on):
                    z = scratch.logits(h, weight, bias)  # the forward's logits again, under its autocast
                g = chunk_grad_logits(z, shift[sl], safe[sl], row_scale[sl], None if factor is None else factor[sl],
                                      softcap, None if softcap is None else scratch.second(h.shape[0]))
                gl = scratch.lowered(g)
                if grad_h is not None:
                    torch.mm(gl, weight, out=grad_h[sl])
                if grad_w is not None:
                    accumulate_weight_grad(grad_w, g, gl, h)
                if grad_b is not None:
                    grad_b += g.sum(0)
                del z, g, gl
        del scratch
        grads = [None if x is None else x.mul_(sign) for x in (grad_h, grad_w, grad_b)]
        return (grads[0], None if grads[1] is None else grads[1].to(weight.dtype), None,
                None if grads[2] is None else grads[2].to(bias.dtype), None, None, None, None, None)


def accumulate_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, gl: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += g^T h`` in ``grad_w``'s (accumulation) dtype, with no ``(V, H)`` temporary: ``g`` is the
    chunk's gradient in that dtype, ``gl`` the same in the inputs' dtype. On CUDA a low-precision matmul
    writes fp32 itself (``addmm(out_dtype=)``, as Liger-Kernel does); elsewhere the matmul runs in fp32
    (a ``(V, H)`` product cast afterwards would cost a parameter-sized temporary per chunk)."""
    if gl.dtype == grad_w.dtype:
        grad_w.addmm_(gl.t(), h)
        return
    if grad_w.is_cuda:
        try:
            torch.addmm(grad_w, gl.t(), h, out_dtype=grad_w.dtype, out=grad_w)
            return
        except (RuntimeError, TypeError):  # a torch or GPU without the fp32-output low-precision matmul
            pass
    grad_w.addmm_(g.t(), h.to(grad_w.dtype))


def chunk_grad_logits(z: torch.Tensor, shift: torch.Tensor, safe: torch.Tensor, row_scale: torch.Tensor,
                      factor: torch.Tensor | None, softcap: float | None,
                      capped: torch.Tensor | None = None) -> torch.Tensor:
    """dL/dz of one chunk (for a positive incoming gradient) from its logits ``z`` (overwritten):
    ``(softmax * factor - onehot(safe)) * row_scale``, times the soft-cap's ``1 - tanh^2``, with the
    softmax times ``row_scale`` computed as ``exp(z - shift)``, ``shift = lse - log(row_scale)``. With a
    soft-cap the result is written into ``capped`` (a second buffer like ``z``, or None for a new one)."""
    y = None
    if softcap is not None:
        y = z.div_(softcap).tanh_()  # tanh(z / c), kept for the derivative
        z = torch.mul(y, softcap, out=capped) if capped is not None else y * softcap
    g = z.sub_(shift[:, None]).exp_()  # softmax * row_scale, from the forward's logsumexp
    if factor is not None:
        g.mul_(factor[:, None])
    g.scatter_add_(1, safe[:, None], row_scale.neg()[:, None])
    if y is not None:
        g.mul_(y.mul_(y).neg_().add_(1.0))  # d(c tanh(z / c))/dz = 1 - tanh^2
    return g


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               bias: torch.Tensor | None = None, ignore_index: int = -100, chunk_size: int = 1024,
                               softcap: float | None = None, z_loss: float = 0.0) -> torch.Tensor:
    """The mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, fused: the ``(N, V)``
    logits never exist and nothing of that size is kept for backward.

    ``hidden`` ``(..., H)``, ``weight`` ``(V, H)`` (the head, or the tied embedding), ``targets``
    ``(...)`` integers; the mean over tokens whose target is not ``ignore_index`` (0 when none is
    counted). The loss is fp32 (fp64 for fp64 inputs). Equal to :func:`materialized_cross_entropy`
    with the same options, values and gradients (up to the order of the sums).

    Args:
        chunk_size: tokens per chunk; one chunk's ``chunk_size x V`` logits is the largest tensor made.
        softcap: Gemma 2's logit soft-cap ``softcap * tanh(z / softcap)`` (> 0), or None.
        z_loss: the weight of PaLM's z-loss ``lse^2`` (>= 0), averaged like the loss and added to it.

    Raises:
        ValueError: a bad tensor (shape, dtype, device, a target outside ``[0, V)``), or option.
    """
    h, t = check_loss_args("fused_linear_cross_entropy", hidden, weight, targets, bias, chunk_size=chunk_size,
                           ignore_index=ignore_index, softcap=softcap, z_loss=z_loss)
    return FusedLinearCrossEntropy.apply(h, weight, t, bias, ignore_index, chunk_size,
                                         None if softcap is None else float(softcap), float(z_loss), None)
