"""Chunked and flash attention from scratch: attention in memory linear in the sequence length.

Attention ``O = softmax(scale * Q K^T + mask) V`` written the obvious way builds an ``Lq x Lk``
score matrix per head, and autograd keeps the probabilities ``P`` for backward. transformers' eager
attention in bf16 keeps 6 bytes per score (softmax's fp32 output and the bf16 copy the product with
``V`` saves; measured in lecture 05): for Llama-2-7B at 4096 tokens, 32 heads x 4096^2 x 6 bytes =
3 GiB per layer per sequence.

The one formula: the *online softmax* (Milakov & Gimelshein 2018, "Online normalizer calculation
for softmax", arXiv:1805.02867). Split the keys into blocks; keep per query row a running max
``m``, a running denominator ``l`` and an unnormalised output ``acc``. After block ``j`` with
scores ``S_j``::

    m' = max(m, rowmax(S_j))
    l' = l * exp(m - m') + rowsum(exp(S_j - m'))
    acc' = acc * exp(m - m') + exp(S_j - m') V_j          and at the end  O = acc / l,
    LSE = m + log(l)                                      (the row's logsumexp)

Rabe & Staats 2021 ("Self-attention does not need O(n^2) memory", arXiv:2112.05682) chunk the
queries and keys this way (59x less memory at 16k for inference, 32x for differentiation, with
checkpointing). Dao 2023 ("FlashAttention-2", arXiv:2307.08691, Algorithm 2) keeps only the
logsumexp for backward and recomputes ``P = exp(scale * Q K^T - LSE)`` block by block, with
``D = rowsum(dO * O)``::

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q

What is here (all take ``(batch, heads, seq, head_dim)`` tensors like
``torch.nn.functional.scaled_dot_product_attention``):

* :func:`naive_attention` -- the ``Lq x Lk`` baseline;
* :func:`chunked_attention` -- online softmax in plain PyTorch, differentiable through autograd
  (which still keeps every block's probabilities: chunking alone saves nothing in training);
* :func:`flash_attention` -- a ``torch.autograd.Function`` that saves only q, k, v, the output and
  the logsumexp; its backward recomputes the probabilities block by block, skipping fully masked
  causal blocks;
* :func:`triton_flash_attention` -- the same as Triton kernels (forward and backward, module-level
  in :mod:`memlab.attention_triton`, imported on first use); on CPU tensors they run in Triton's
  interpreter (``TRITON_INTERPRET``), on CUDA compiled;
* :func:`register_transformers` -- memlab's attention as a ``transformers`` attention implementation
  (``attn_implementation="memlab"``; transformers treats any name with "flash" in it as a flash-attn kernel);
* helpers: :func:`causal_mask`, :func:`merge_partials`, :func:`attention_saved_bytes`.

Options: ``causal=False``; ``True`` or ``"top_left"`` (SDPA's ``is_causal``: query ``i`` sees keys
``j <= i``); ``"bottom_right"`` (flash-attn >= 2.1: ``j <= i + Lk - Lq``, the last query sees every
key). Fewer key/value heads than query heads (GQA; query head ``h`` uses kv head
``h // (Hq // Hkv)``, like SDPA's ``enable_gqa``). fp16 / bf16 / fp32 inputs accumulate in fp32,
fp64 in fp64. A row whose keys are all masked gives output 0, logsumexp ``-inf`` and gradient 0,
as SDPA does.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

__all__ = [
    "CAUSAL_MODES",
    "naive_attention",
    "chunked_attention",
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "triton_flash_attention",
    "triton_available",
    "triton_interpreted",
    "causal_mask",
    "merge_partials",
    "attention_saved_bytes",
    "sdpa_reference",
    "register_transformers",
]

#: the accepted values of ``causal``
CAUSAL_MODES = (False, True, "top_left", "bottom_right")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------- arguments
def _mode(where: str, causal: Any) -> str | None:
    if causal is False or causal is None:
        return None
    if causal is True or causal == "top_left":
        return "top_left"
    if causal == "bottom_right":
        return "bottom_right"
    raise ValueError(f"{where}: causal={causal!r} is not understood; allowed: {', '.join(map(repr, CAUSAL_MODES))}")


def _positive(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name}={value!r} must be an int >= 1")
    return value


def _check(where: str, q: Any, k: Any, v: Any, causal: Any, scale: Any) -> tuple[str | None, float, int]:
    """Validate; return (causal mode, scale, group size G = Hq // Hkv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{where}: {name}.shape={tuple(t.shape)} must be 4-d (batch, heads, seq, head_dim)")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{where}: {name}.dtype={t.dtype} is not supported; allowed: "
                             f"{', '.join(str(d) for d in _DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{where}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); they must be equal")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k, v devices differ ({q.device}, {k.device}, {v.device})")
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"{where}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"{where}: k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must agree on heads and seq")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{where}: head_dim of q ({q.shape[-1]}) and k ({k.shape[-1]}) differ")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{where}: q has {q.shape[1]} heads, k/v {k.shape[1]}: the query heads must be a multiple "
                         f"of the key/value heads (GQA)")
    mode = _mode(where, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{where}: scale={scale!r} must be a finite number or None (1/sqrt(head_dim))")
    return mode, float(scale), q.shape[1] // k.shape[1]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _offset(mode: str | None, lq: int, lk: int) -> int:
    return lk - lq if mode == "bottom_right" else 0


def causal_mask(lq: int, lk: int, causal: Any = True, *, device: Any = None) -> torch.Tensor | None:
    """Boolean ``(lq, lk)`` mask, True where query ``i`` may see key ``j``; None when ``causal`` is False.

    ``True`` / ``"top_left"``: ``j <= i`` (SDPA's ``is_causal``); ``"bottom_right"``:
    ``j <= i + lk - lq`` (flash-attn >= 2.1). Blocks use the same rule with absolute indices.
    """
    mode = _mode("causal_mask", causal)
    _positive("causal_mask", "lq", lq)
    _positive("causal_mask", "lk", lk)
    return _block_mask(mode, 0, lq, 0, lk, lq, lk, device)


def _block_mask(mode: str | None, qs: int, qe: int, ks: int, ke: int, lq: int, lk: int,
                device: Any) -> torch.Tensor | None:
    if mode is None:
        return None
    i = torch.arange(qs, qe, device=device).unsqueeze(1)
    j = torch.arange(ks, ke, device=device).unsqueeze(0)
    return j <= i + _offset(mode, lq, lk)


def _loop_mask(mode: str | None, qs: int, qe: int, ks: int, ke: int, lq: int, lk: int,
               device: Any) -> torch.Tensor | None:
    """The block's mask inside the loops: None also when the block lies wholly below the diagonal
    (every query sees every key of it), so most blocks of a causal matrix pay nothing for masking."""
    if mode is None or ke - 1 <= qs + _offset(mode, lq, lk):
        return None
    return _block_mask(mode, qs, qe, ks, ke, lq, lk, device)


def _kv_end(mode: str | None, qe: int, lq: int, lk: int) -> int:
    """Keys [0, end) can be seen by query rows < qe; later key blocks are fully masked (skipped)."""
    if mode is None:
        return lk
    return max(0, min(lk, qe + _offset(mode, lq, lk)))


def _q_start(mode: str | None, ks: int, lq: int, lk: int) -> int:
    """Query rows >= start can see key ks; earlier query rows are fully masked for this key block."""
    if mode is None:
        return 0
    return max(0, min(lq, ks - _offset(mode, lq, lk)))


def _grouped(q: torch.Tensor, g: int) -> torch.Tensor:
    """(B, Hq, L, D) -> (B, Hkv, G, L, D): query head h = hk * G + g shares kv head hk."""
    b, h, l, d = q.shape
    return q.view(b, h // g, g, l, d)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                   scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with memlab's options (bottom-right as a boolean mask)."""
    import torch.nn.functional as F

    mode, scale, g = _check("sdpa_reference", q, k, v, causal, scale)
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if mode == "bottom_right":
        mask = _block_mask(mode, 0, q.shape[2], 0, k.shape[2], q.shape[2], k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=mode == "top_left", scale=scale)


# ----------------------------------------------------------------------------- naive
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                    scale: float | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` with the whole ``Lq x Lk`` matrix (the baseline)."""
    mode, scale, g = _check("naive_attention", q, k, v, causal, scale)
    acc = _acc(q.dtype)
    lq, lk = q.shape[2], k.shape[2]
    s = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(q, g).to(acc), k.to(acc)) * scale
    mask = _block_mask(mode, 0, lq, 0, lk, lq, lk, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
        empty = ~mask.any(-1, keepdim=True)  # rows that see no key: output 0, like SDPA
        s = s.masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        p = p.masked_fill(empty, 0.0)
    o = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(acc))
    return o.reshape(q.shape[0], q.shape[1], lq, v.shape[-1]).to(q.dtype)


# ----------------------------------------------------------------------------- online softmax
def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial results over disjoint key sets into one.

    ``o_i`` (..., L, D) is the softmax-weighted output over key set ``i``, ``lse_i`` (..., L) its
    logsumexp. The merged ``lse = log(exp(lse1) + exp(lse2))`` and
    ``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``. Rows with ``lse = -inf`` (no key) weigh 0.
    """
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return w1 * o1 + w2 * o2, lse


def _online_forward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str | None, scale: float,
                    q_chunk: int, kv_chunk: int, lq: int, lk: int) -> tuple[list, list]:
    """Blockwise forward on grouped queries; returns per-q-chunk outputs and logsumexps (acc dtype)."""
    acc = _acc(q5.dtype)
    outs, lses = [], []
    for qs in range(0, lq, q_chunk):
        qe = min(lq, qs + q_chunk)
        qi = q5[..., qs:qe, :].to(acc)
        shape = qi.shape[:-1]
        m = torch.full(shape, float("-inf"), dtype=acc, device=q5.device)
        l = torch.zeros(shape, dtype=acc, device=q5.device)
        o = torch.zeros(*shape, v.shape[-1], dtype=acc, device=q5.device)
        for ks in range(0, _kv_end(mode, qe, lq, lk), kv_chunk):
            ke = min(lk, ks + kv_chunk)
            s = torch.einsum("bhgqd,bhkd->bhgqk", qi, k[:, :, ks:ke].to(acc)) * scale
            mask = _loop_mask(mode, qs, qe, ks, ke, lq, lk, q5.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            # the running max only stabilises exp(); the result does not depend on it: no gradient
            m_new = torch.maximum(m, s.detach().amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            l = l * alpha + p.sum(-1)
            o = o * alpha.unsqueeze(-1) + torch.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, ks:ke].to(acc))
            m = m_new
        empty = l == 0
        l_safe = torch.where(empty, torch.ones_like(l), l)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        outs.append(o / l_safe.unsqueeze(-1))
        lses.append(torch.where(empty, torch.full_like(l, float("-inf")), m_safe + torch.log(l_safe)))
    return outs, lses


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                      scale: float | None = None, q_chunk: int = 128, kv_chunk: int = 128,
                      return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention by query chunks and key chunks with the online softmax, in plain PyTorch.

    Differentiable through autograd, which keeps every block's probabilities for backward, so in
    training it keeps as much as :func:`naive_attention` (see :func:`attention_saved_bytes`).
    With ``return_lse`` also returns the logsumexp ``(B, Hq, Lq)`` in the accumulation dtype.
    """
    mode, scale, g = _check("chunked_attention", q, k, v, causal, scale)
    _positive("chunked_attention", "q_chunk", q_chunk)
    _positive("chunked_attention", "kv_chunk", kv_chunk)
    b, h, lq, _ = q.shape
    outs, lses = _online_forward(_grouped(q, g), k, v, mode, scale, q_chunk, kv_chunk, lq, k.shape[2])
    o = torch.cat(outs, dim=-2).reshape(b, h, lq, v.shape[-1]).to(q.dtype)
    if return_lse:
        return o, torch.cat(lses, dim=-1).reshape(b, h, lq)
    return o


# ----------------------------------------------------------------------------- flash (PyTorch)
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                            scale: float | None = None, block_q: int = 128, block_k: int = 128
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad blockwise forward: (output in q's dtype, logsumexp (B, Hq, Lq) in the accumulation dtype)."""
    mode, scale, g = _check("flash_attention_forward", q, k, v, causal, scale)
    _positive("flash_attention_forward", "block_q", block_q)
    _positive("flash_attention_forward", "block_k", block_k)
    b, h, lq, _ = q.shape
    with torch.no_grad():
        outs, lses = _online_forward(_grouped(q, g), k, v, mode, scale, block_q, block_k, lq, k.shape[2])
        o = torch.cat(outs, dim=-2).reshape(b, h, lq, v.shape[-1]).to(q.dtype)
        return o, torch.cat(lses, dim=-1).reshape(b, h, lq)


def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             o: torch.Tensor, lse: torch.Tensor, *, causal: Any = False,
                             scale: float | None = None, block_q: int = 128, block_k: int = 128
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA2 Algorithm 2: dq, dk, dv from q, k, v, o and the logsumexp, recomputing P block by block."""
    mode, scale, g = _check("flash_attention_backward", q, k, v, causal, scale)
    acc = _acc(q.dtype)
    b, h, lq, d = q.shape
    lk = k.shape[2]
    q5, do5 = _grouped(q, g), _grouped(do, g)
    lse5 = _grouped(lse.unsqueeze(-1), g).squeeze(-1).to(acc)
    lse5 = torch.where(torch.isinf(lse5) & (lse5 < 0), torch.full_like(lse5, float("inf")), lse5)  # empty rows: P = 0
    delta = (do5.to(acc) * _grouped(o, g).to(acc)).sum(-1)  # D = rowsum(dO * O)
    dq = torch.zeros(q5.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for ks in range(0, lk, block_k):
        ke = min(lk, ks + block_k)
        kj, vj = k[:, :, ks:ke].to(acc), v[:, :, ks:ke].to(acc)
        first = _q_start(mode, ks, lq, lk) // block_q * block_q
        for qs in range(first, lq, block_q):
            qe = min(lq, qs + block_q)
            qi, doi = q5[..., qs:qe, :].to(acc), do5[..., qs:qe, :].to(acc)
            s = torch.einsum("bhgqd,bhkd->bhgqk", qi, kj) * scale
            p = torch.exp(s - lse5[..., qs:qe].unsqueeze(-1))
            mask = _loop_mask(mode, qs, qe, ks, ke, lq, lk, q.device)
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv[:, :, ks:ke] += torch.einsum("bhgqk,bhgqd->bhkd", p, doi)
            dp = torch.einsum("bhgqd,bhkd->bhgqk", doi, vj)
            ds = p * (dp - delta[..., qs:qe].unsqueeze(-1))
            dq[..., qs:qe, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kj) * scale
            dk[:, :, ks:ke] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qi) * scale
    return dq.reshape(b, h, lq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, the output and the logsumexp; backward recomputes P blockwise (FA2)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k):  # type: ignore[override]
        o, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.opts = dict(causal=causal, scale=scale, block_q=block_q, block_k=block_k)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, **ctx.opts)
        return dq, dk, dv, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                    scale: float | None = None, block_q: int = 128, block_k: int = 128,
                    return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 in PyTorch: saves O(seq) for backward (q, k, v, output, logsumexp)."""
    _check("flash_attention", q, k, v, causal, scale)
    _positive("flash_attention", "block_q", block_q)
    _positive("flash_attention", "block_k", block_k)
    o, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, block_q, block_k)
    return (o, lse) if return_lse else o


def attention_saved_bytes(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> int:
    """Bytes ``fn(q, k, v, **kwargs)`` saves for backward beyond q, k and v themselves (each storage once)."""
    from memlab.accounting import saved_activation_bytes

    return saved_activation_bytes(fn, q, k, v, exclude=[q, k, v], **kwargs)


# ----------------------------------------------------------------------------- Triton
def triton_available() -> bool:
    """Whether ``import triton`` works here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


_KERNELS: dict[str, Any] = {}


def _kernels() -> Any:
    """The Triton kernels (module :mod:`memlab.attention_triton`, imported on first use: it imports triton,
    interpreted when TRITON_INTERPRET=1 was set before triton's import)."""
    if "k" not in _KERNELS:
        from memlab import attention_triton

        _KERNELS["k"] = attention_triton
    return _KERNELS["k"]


def _precision(q: torch.Tensor) -> str:
    """fp32 inputs: exact fp32 products ("ieee", not TF32); fp16/bf16: tensor-core dots, fp32 accumulation."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


def triton_interpreted() -> bool:
    """Whether Triton kernels run in the interpreter here (TRITON_INTERPRET=1 when triton was imported)."""
    import triton.language as tl_
    from triton.runtime.interpreter import InterpretedFunction

    # the mode is fixed when triton.language is imported (its own @jit helpers, such as tl.zeros,
    # are made then); setting the environment variable later changes nothing
    return isinstance(tl_.zeros, InterpretedFunction)


def _triton_setup(q: torch.Tensor) -> Any:
    import sys

    if q.device.type == "cpu" and "triton" not in sys.modules:
        # CPU tensors need Triton's interpreter, chosen when triton is imported: choose it now
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not triton_available():
        raise RuntimeError("triton_flash_attention needs triton (pip install triton; Linux x86_64); "
                           "everything else in memlab.attention runs without it")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"triton_flash_attention: q.device={q.device} is not supported; allowed: cpu (Triton's "
                         f"interpreter), cuda (compiled)")
    if q.device.type == "cpu" and not triton_interpreted():
        raise RuntimeError("triton_flash_attention on cpu tensors runs in Triton's interpreter, which is chosen when "
                           "triton is first imported: set TRITON_INTERPRET=1 before importing triton (or torch "
                           "modules that import it), e.g. os.environ['TRITON_INTERPRET'] = '1' at the top")
    return _kernels()


class TritonFlashAttentionFunction(torch.autograd.Function):
    """FA2 forward and backward as Triton kernels (interpreted on CPU, compiled on CUDA)."""

    @staticmethod
    def forward(ctx, q, k, v, mode, scale, g, block_m, block_n):  # type: ignore[override]
        kern = _triton_setup(q)
        out_dtype = q.dtype
        if q.dtype == torch.bfloat16 and triton_interpreted():
            # the interpreter computes with NumPy, which has no bfloat16: run its kernels in fp32
            q, k, v = q.float(), k.float(), v.float()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, h, lq, d = q.shape
        hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
        o = torch.empty(b, h, lq, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
        grid = (-(-lq // block_m), b * h)
        kern.fwd[grid](q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                       h, g, lq, lk, d, dv, scale, _offset(mode, lq, lk),
                       CAUSAL=mode is not None, PREC=_precision(q), BM=block_m, BN=block_n, BD=_pow2(d),
                       BDV=_pow2(dv))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.opts = (mode, scale, g, block_m, block_n, hk, out_dtype)
        ctx.mark_non_differentiable(lse)
        return o.to(out_dtype), lse

    @staticmethod
    def backward(ctx, do, _dlse):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        mode, scale, g, block_m, block_n, hk, out_dtype = ctx.opts
        kern = _triton_setup(q)
        do = do.to(q.dtype).contiguous()
        b, h, lq, d = q.shape
        lk, dvd = k.shape[2], v.shape[-1]
        delta = (do.float() * o.float()).sum(-1).contiguous()  # D = rowsum(dO * O), (B, H, Lq)
        dq = torch.empty(b, h, lq, d, dtype=torch.float32, device=q.device)
        dk = torch.empty(b, hk, lk, d, dtype=torch.float32, device=q.device)
        dv = torch.empty(b, hk, lk, dvd, dtype=torch.float32, device=q.device)
        common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), v.stride(1), v.stride(2))
        off = _offset(mode, lq, lk)
        meta = dict(CAUSAL=mode is not None, PREC=_precision(q), BM=block_m, BN=block_n, BD=_pow2(d), BDV=_pow2(dvd))
        kern.bwd_dq[(-(-lq // block_m), b * h)](q, k, v, do, lse, delta, dq, *common,
                                                h, g, lq, lk, d, dvd, scale, off, **meta)
        kern.bwd_dkdv[(-(-lk // block_n), b * hk)](q, k, v, do, lse, delta, dk, dv, *common,
                                                   h, hk, g, lq, lk, d, dvd, scale, off, **meta)
        return dq.to(out_dtype), dk.to(out_dtype), dv.to(out_dtype), None, None, None, None, None


def triton_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
                           scale: float | None = None, block_q: int = 64, block_k: int = 64,
                           return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward and backward as Triton kernels, same options as :func:`flash_attention`.

    CUDA tensors run compiled; CPU tensors run in Triton's interpreter (slow: small sizes only).
    The interpreter is chosen when triton is first imported: with CPU tensors, set
    ``TRITON_INTERPRET=1`` before anything imports triton (memlab sets it itself when triton is not
    imported yet; importing ``torch.nn.attention.bias`` or ``torch._dynamo`` first imports triton).
    Operands keep their dtype in ``tl.dot`` (tensor cores for fp16 / bf16; exact "ieee" products
    for fp32, not TF32), accumulating in fp32; fp64 is not supported here (use
    :func:`flash_attention`). Under the interpreter bf16 runs in fp32 (NumPy has no bfloat16). ``block_q`` and ``block_k`` must be
    powers of two >= 16 (``tl.dot``'s smallest tile).
    """
    mode, scale, g = _check("triton_flash_attention", q, k, v, causal, scale)
    if q.dtype == torch.float64:
        raise ValueError("triton_flash_attention: q.dtype=torch.float64 is not supported; allowed: float16, "
                         "bfloat16, float32 (use flash_attention for fp64)")
    for name, val in (("block_q", block_q), ("block_k", block_k)):
        _positive("triton_flash_attention", name, val)
        if val < 16 or val & (val - 1):
            raise ValueError(f"triton_flash_attention: {name}={val} must be a power of two >= 16")
    o, lse = TritonFlashAttentionFunction.apply(q, k, v, mode, scale, g, block_q, block_k)
    return (o, lse) if return_lse else o



# ----------------------------------------------------------------------------- transformers
_IMPLS = {"flash": "flash_attention", "chunked": "chunked_attention", "naive": "naive_attention",
          "triton": "triton_flash_attention"}


def register_transformers(name: str = "memlab", impl: str = "flash") -> str:
    """Register memlab's attention with transformers' ``AttentionInterface``; returns ``name``.

    Then ``LlamaForCausalLM(config)`` with ``config._attn_implementation = name`` (or
    ``model.set_attn_implementation(name)``) runs it. transformers passes no mask to an
    implementation it has no mask function for, so this handles causal (bottom-right: right for
    both training and decoding with a cache) and non-causal attention, not padding masks: use it on
    batches without padding. GQA goes to memlab's own grouped heads (no repeat of k and v).
    """
    if impl not in _IMPLS:
        raise ValueError(f"register_transformers: impl={impl!r} is not understood; allowed: {', '.join(map(repr, _IMPLS))}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_transformers: name={name!r} must be a non-empty string")
    from transformers import AttentionInterface

    fn = globals()[_IMPLS[impl]]

    def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
        if dropout:
            raise ValueError(f"{name}: dropout={dropout} is not supported; allowed: 0.0 (set attention_dropout=0)")
        if attention_mask is not None:
            raise ValueError(f"{name}: got an attention_mask; only causal / full attention without padding is supported")
        causal = "bottom_right" if kwargs.get("is_causal", getattr(module, "is_causal", True)) else False
        out = fn(query, key, value, causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention_forward)
    return name
