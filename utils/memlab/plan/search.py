"""The planner's candidates: every stack ``allow`` admits, and the memory order between stacks that lets
the search rule one out without tracing it."""
from __future__ import annotations

from typing import Any, Mapping

from memlab.plan.stack import (ALLOWED_VALUES, OPTIMIZER_GE, DEFAULT_ALLOW, Stack, canonical_precision,
                               canonical_stack_optimizer)


def _opt_ge(a: str, b: str) -> bool:
    return a == b or (a, b) in OPTIMIZER_GE


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, by trial division up to sqrt(n)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _check_allow(allow: Mapping[str, Any] | None, batch_size: int) -> dict[str, tuple]:
    out = dict(DEFAULT_ALLOW)
    out["micro_batch"] = tuple(_divisors(batch_size))
    if allow is None:
        return out
    if not isinstance(allow, Mapping):
        raise TypeError(f"allow={allow!r} is invalid; allowed: a dict such as {{'adapter': ['full', 'lora']}} "
                        f"with keys {', '.join(DEFAULT_ALLOW)}")
    for key, values in allow.items():
        if key not in DEFAULT_ALLOW:
            raise ValueError(f"allow key {key!r} is invalid; allowed: {', '.join(map(repr, DEFAULT_ALLOW))}")
        values = (values,) if isinstance(values, (str, int)) else tuple(values)
        if key == "precision":  # one vocabulary: "bf16" is bf16-mixed, "adam8bit" adamw8bit
            values = tuple(canonical_precision(v) for v in values)
        elif key == "optimizer":
            values = tuple(canonical_stack_optimizer(v) for v in values)
        if not values:
            raise ValueError(f"allow[{key!r}] is empty; allowed: at least one value")
        if key in ALLOWED_VALUES:
            for v in values:
                if v not in ALLOWED_VALUES[key]:
                    extra = (" ('selective' is not enumerated: the estimator cannot express it, and with flash "
                             "attention there is no T x T tensor for it to drop)" if v == "selective" else "")
                    raise ValueError(f"allow[{key!r}] value {v!r} is invalid; allowed: "
                                     f"{', '.join(map(repr, ALLOWED_VALUES[key]))}{extra}")
        elif key == "micro_batch":
            for v in values:
                if type(v) is not int or v < 1 or batch_size % v:
                    raise ValueError(f"allow['micro_batch'] value {v!r} is invalid; allowed: divisors of "
                                     f"batch_size={batch_size}: {_divisors(batch_size)}")
        elif key == "ckpt_every":
            for v in values:
                if type(v) is not int or v < 2:
                    raise ValueError(f"allow['ckpt_every'] value {v!r} is invalid; allowed: ints >= 2")
        out[key] = values
    return out


def enumerate_stacks(batch_size: int, n_layers: int, allow: Mapping[str, Any] | None = None,
                     device: str = "cuda") -> tuple[list[Stack], list[str]]:
    """Every stack the planner considers, and notes on what it leaves out and why.

    LoRA and QLoRA run bf16 mixed precision (a bf16 base, fp32 adapters under autocast, as the
    QLoRA paper trains) with AdamW, fused or not: their optimizer state is AdamW's 8 bytes per adapter
    parameter (0.3 GiB for Llama-3-8B at r=16, 41.9M adapter parameters counted by peft; 1.5 GiB for
    Llama-2-70B), small next to the base, so 8-bit or offloaded states are not searched. "every-k" takes each k
    of ``allow['ckpt_every']`` that divides the layer count (nested sets: every-4 checkpoints a subset of
    every-2's layers).

    Args:
        batch_size: the effective batch (micro-batches are its divisors).
        n_layers: the model's decoder layers.
        allow: knob -> the values to consider (:data:`DEFAULT_ALLOW` for the others).
        device: "cuda" or "cpu" (no offload and no flash on a CPU).

    Returns:
        ``(stacks, notes on what is left out and why)``.

    Raises:
        ValueError, TypeError: an unknown key or value of ``allow``, named.
    """
    a = _check_allow(allow, batch_size)
    notes: list[str] = []
    ks = [k for k in a["ckpt_every"] if n_layers % k == 0 and k < n_layers]
    ks = [k for k in ks if all(max(k, j) % min(k, j) == 0 for j in ks)]
    if "every-k" in a["checkpointing"] and len(ks) < len(a["ckpt_every"]):
        notes.append(f"every-k with k in {list(a['ckpt_every'])}: only {ks} divide {n_layers} layers and nest")
    ckpts: list[tuple[str, int]] = []
    for c in a["checkpointing"]:
        if c == "every-k":
            ckpts += [("every-k", k) for k in sorted(ks, reverse=True)]
        else:
            ckpts.append((c, 1))
    optimizers = list(a["optimizer"])
    if device != "cuda" and "offload-adamw" in optimizers:
        optimizers.remove("offload-adamw")
        notes.append("offload-adamw left out: on a CPU the host is the device")
    out: list[Stack] = []
    for adapter in a["adapter"]:
        for precision in a["precision"]:
            if adapter != "full" and precision not in ("bf16-mixed", "fp16-mixed"):
                continue
            for attention in a["attention"]:
                if attention == "flash" and (device != "cuda" or precision == "fp32"):
                    continue
                for ck, k in ckpts:
                    for opt in optimizers:
                        if adapter != "full" and opt not in ("adamw", "adamw-fused"):
                            continue
                        for mb in a["micro_batch"]:
                            out.append(Stack(precision=precision, checkpointing=ck, ckpt_every=k, optimizer=opt,
                                             adapter=adapter, attention=attention, micro_batch=mb,
                                             grad_accum=batch_size // mb))
    if any(ad != "full" for ad in a["adapter"]):
        notes.append("LoRA/QLoRA: bf16 base under bf16 autocast, fp32 adapters on every linear layer but lm_head, "
                     "AdamW / fused AdamW only (their AdamW state is 8 B per adapter parameter: 0.3 GiB for an 8B model at "
                     "r=16, small next to the base)")
    if "flash" in a["attention"] and device != "cuda":
        notes.append("flash attention left out: a CUDA kernel")
    return out, notes


def _ckpt_set(s: Stack, n_layers: int) -> frozenset:
    if s.checkpointing == "full":
        return frozenset(range(n_layers))
    if s.checkpointing == "every-k":
        return frozenset(range(0, n_layers, s.ckpt_every))
    return frozenset()


def _family(s: Stack) -> tuple:
    return (s.adapter, s.precision, s.attention)


def _needs_at_least(c: Stack, d: Stack, n_layers: int) -> bool:
    """True when ``c`` holds at least ``d``'s device memory by construction: the same family, a
    micro-batch at least as large, accumulation if d accumulates (its gradients stay through the
    next micro-batch), a subset of d's checkpointed layers, an optimizer that keeps at least as much."""
    return (_family(c) == _family(d) and c.micro_batch >= d.micro_batch
            and (c.grad_accum > 1 or d.grad_accum == 1)
            and _ckpt_set(c, n_layers) <= _ckpt_set(d, n_layers)
            and _opt_ge(c.optimizer, d.optimizer))



