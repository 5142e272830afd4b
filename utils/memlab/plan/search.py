"""The planner's search: the candidates (every stack ``allow`` admits), the memory order between stacks
that rules one out without tracing it, and the search that traces as few stacks as it can (rule out by the
memory order, trace each family's floor first, bisect micro-batches), cheapest first, until ``top`` fit."""
from __future__ import annotations

from typing import Any, Mapping

from memlab.core.units import format_bytes
from memlab.plan.result import PlanRow
from memlab.plan.stack import (ALLOWED_VALUES, OPTIMIZER_GE, DEFAULT_ALLOW, Stack, canonical_in_backward,
                               canonical_precision, canonical_stack_optimizer)
from memlab.plan.stacks import cached_estimate


# ----------------------------------------------------------------------------- the candidates
def _divisors(n: int) -> list[int]:
    # the divisors of n in increasing order, by trial division up to sqrt(n)
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _canonical(key: str, value: Any) -> Any:
    # an unknown spelling stays as it is: the check of _check_allow names it with the values allowed here
    if key == "optimizer_in_backward":
        return canonical_in_backward(value)
    if key == "loss":
        return "default" if value == "auto" else value
    try:
        return canonical_precision(value) if key == "precision" else canonical_stack_optimizer(value)
    except ValueError:
        return value


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
        if key in ("precision", "optimizer", "loss", "optimizer_in_backward"):
            # one vocabulary: "bf16" is bf16-mixed, "adam8bit" adamw8bit, "auto" the default loss, "true" True
            values = tuple(_canonical(key, v) for v in values)
        if not values:
            raise ValueError(f"allow[{key!r}] is empty; allowed: at least one value")
        if key in ALLOWED_VALUES:
            for v in values:
                if v not in ALLOWED_VALUES[key] or (key == "optimizer_in_backward" and not isinstance(v, bool)):
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
    """Every stack the planner considers, and notes on what it leaves out and why: ``(stacks, notes)``.

    LoRA and QLoRA run bf16 mixed precision (a bf16 base, fp32 adapters under autocast, as the
    QLoRA paper trains) with AdamW, fused or not: their optimizer state is AdamW's 8 bytes per adapter
    parameter (0.3 GiB for Llama-3-8B at r=16, 41.9M adapter parameters counted by peft; 1.5 GiB for
    Llama-2-70B), small next to the base, so 8-bit or offloaded states are not searched. "every-k" takes each k
    of ``allow['ckpt_every']`` that divides the layer count (nested sets: every-4 checkpoints a subset of
    every-2's layers). The optimizer step in backward is searched without accumulation (micro-batch = the
    batch) and without offload-adamw, the two it rules out.

    Args:
        batch_size: the effective batch (micro-batches are its divisors).
        allow: knob -> the values to consider (:data:`DEFAULT_ALLOW` for the others).
        device: "cuda" or "cpu" (no offload and no flash on a CPU).

    Raises:
        ValueError, TypeError: an unknown key or value of ``allow``, named.
    """
    a = _check_allow(allow, batch_size)
    notes: list[str] = []
    # LoRA/QLoRA's gradients are the adapters' (4 B per adapter parameter: 160 MiB for an 8B model at r=16): the
    # step in backward is searched for them only when allow names it
    inb_adapters = allow is not None and "optimizer_in_backward" in allow
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
                            for loss in a["loss"]:
                                for inb in a["optimizer_in_backward"]:
                                    if inb and (mb != batch_size or opt == "offload-adamw"
                                                or (adapter != "full" and not inb_adapters)):
                                        continue  # the gradient is consumed in backward: no accumulation
                                    out.append(Stack(precision=precision, checkpointing=ck, ckpt_every=k,
                                                     optimizer=opt, adapter=adapter, attention=attention,
                                                     micro_batch=mb, grad_accum=batch_size // mb, loss=loss,
                                                     optimizer_in_backward=inb))
    if any(ad != "full" for ad in a["adapter"]):
        notes.append("LoRA/QLoRA: bf16 base under bf16 autocast, fp32 adapters on every linear layer but lm_head, "
                     "AdamW / fused AdamW only (their AdamW state is 8 B per adapter parameter: 0.3 GiB for an 8B model at "
                     "r=16, small next to the base)" + ("" if inb_adapters or True not in a["optimizer_in_backward"] else
                                                        "; no optimizer step in backward (their gradients are as small: "
                                                        "allow={'optimizer_in_backward': [True]} searches it)"))
    if "flash" in a["attention"] and device != "cuda":
        notes.append("flash attention left out: a CUDA kernel")
    return out, notes


# ----------------------------------------------------------------------------- the memory order
def _opt_ge(a: str, b: str) -> bool:
    return a == b or (a, b) in OPTIMIZER_GE


def _ckpt_set(s: Stack, n_layers: int) -> frozenset:
    if s.checkpointing == "full":
        return frozenset(range(n_layers))
    if s.checkpointing == "every-k":
        return frozenset(range(0, n_layers, s.ckpt_every))
    return frozenset()


def _family(s: Stack) -> tuple:
    # the loss and the optimizer step in backward hold no memory order against their alternatives (the fused
    # loss keeps an fp32 head gradient and chunk tiles; a step in backward its temporaries while activations live)
    return (s.adapter, s.precision, s.attention, s.loss, s.optimizer_in_backward)


def needs_at_least(c: Stack, d: Stack, n_layers: int) -> bool:
    """True when ``c`` holds at least ``d``'s device memory by construction: the same family, a
    micro-batch at least as large, accumulation if d accumulates (its gradients stay through the
    next micro-batch), a subset of d's checkpointed layers, an optimizer that keeps at least as much."""
    return (_family(c) == _family(d) and c.micro_batch >= d.micro_batch
            and (c.grad_accum > 1 or d.grad_accum == 1)
            and _ckpt_set(c, n_layers) <= _ckpt_set(d, n_layers)
            and _opt_ge(c.optimizer, d.optimizer))


# ----------------------------------------------------------------------------- the search
class Search:
    """The traces of one plan: which rows fit (``fitted``), which do not (``failed``), how many were
    traced (``traces``); ``budget`` and ``host_budget`` in bytes, ``host_budget`` None for no bound."""

    def __init__(self, name: str, cfg: Any, n_layers: int, *, seq_len: int, device: str, lora_r: int, loss: str,
                 budget: int, host_budget: int | None) -> None:
        self.name, self.cfg, self.L = name, cfg, n_layers
        self.kw = dict(seq_len=seq_len, device=device, lora_r=lora_r, loss=loss)
        self.device, self.budget, self.host_budget = device, budget, host_budget
        self.failed: list[PlanRow] = []
        self.fitted: list[PlanRow] = []
        self.traces = 0

    def trace(self, r: PlanRow) -> None:
        """Trace ``r``'s stack (:func:`memlab.plan.stacks.cached_estimate`) and record its peak and fit in ``r``."""
        est = cached_estimate(self.name, self.cfg, r.stack, **self.kw)
        self.traces += 1
        need = est.reserved_bytes if self.device == "cuda" else est.peak_bytes
        r.peak_bytes, r.fits, r.status = int(need), need <= self.budget, "traced"
        r.host_bytes, r.phase = est.host_bytes, est.peak_phase
        r.notes = f"peak in {est.peak_phase}" + (", extrapolated" if est.extrapolated_from else "")
        (self.fitted if r.fits else self.failed).append(r)
        if r.fits and self.host_budget is not None and r.host_bytes > self.host_budget:
            # fits the device, not the host: the device-memory order says nothing about it
            self.fitted.remove(r)
            r.fits = False
            r.notes += f"; host {format_bytes(r.host_bytes)} > host budget {format_bytes(self.host_budget)}"

    def known(self, r: PlanRow) -> bool | None:
        """Whether r fits, as far as the traces so far decide it (None: not decided)."""
        if r.status == "traced":
            return r.fits
        for f in self.failed:
            if needs_at_least(r.stack, f.stack, self.L):
                r.fits, r.status, r.notes = False, "exceeds", f"needs at least the peak of #{f.stack_id} (> budget): not traced"
                return False
        if any(needs_at_least(d.stack, r.stack, self.L) for d in self.fitted):
            return True
        return None


def live_rows(rows: list[PlanRow], L: int) -> list[PlanRow]:
    """Number the rows; mark those dominated (another of the same family needs no more memory and ranks
    no lower); return the others."""
    live = []
    for i, r in enumerate(rows):
        r.stack_id = i + 1
        dom = next((d for d in rows[:i] if d.stack != r.stack and needs_at_least(r.stack, d.stack, L)), None)
        if dom is not None:
            r.status, r.notes = "dominated", f"never better than #{dom.stack_id} (no less memory, no lower rank): not traced"
        else:
            live.append(r)
    return live


def _trace_family_floors(search: Search, live: list[PlanRow]) -> None:
    # The floor of each family (the smallest micro-batch, the most checkpointing, the leanest optimizer):
    # every member needs at least its memory, so if it does not fit, none does (only where offload-adamw is
    # allowed: the one optimizer below all others).
    L = search.L
    families: dict[tuple, list[PlanRow]] = {}
    for r in live:
        families.setdefault(_family(r.stack), []).append(r)
    for members in sorted(families.values(), key=lambda m: min(r.key for r in m)):
        floor = min(members, key=lambda r: (r.stack.micro_batch, -len(_ckpt_set(r.stack, L)),
                                             r.stack.optimizer != "offload-adamw"))
        if all(needs_at_least(o.stack, floor.stack, L) for o in members):
            search.trace(floor)


def run_search(search: Search, live: list[PlanRow], top: int, bar: Any = None) -> None:
    """Decide the ``live`` rows (not dominated, in ranking order) cheapest first until ``top`` fit; the rows
    decided along the way are updated in place and ``search`` holds the traces taken.

    A stack not yet decided is decided by tracing, in this order, the floor of its family and optimizer
    (the smallest micro-batch, the most checkpointing), then its line (the same family, optimizer and
    checkpointing; micro-batches ascending, monotone in memory): the smallest micro-batch first, then by
    bisection. ``bar``: a tqdm progress bar or None.
    """
    L = search.L
    lines: dict[tuple, list[PlanRow]] = {}
    for r in live:
        lines.setdefault((_family(r.stack), r.stack.optimizer, r.stack.checkpointing, r.stack.ckpt_every), []).append(r)
    for members in lines.values():
        members.sort(key=lambda r: r.stack.micro_batch)
    _trace_family_floors(search, live)
    groups: dict[tuple, list[PlanRow]] = {}
    for r in live:
        groups.setdefault((_family(r.stack), r.stack.optimizer), []).append(r)
    found = 0
    for r in live:
        if found >= top:
            break
        while search.known(r) is None:
            group = groups[(_family(r.stack), r.stack.optimizer)]
            floor = min(group, key=lambda m: (m.stack.micro_batch, -len(_ckpt_set(m.stack, L))))
            if all(needs_at_least(m.stack, floor.stack, L) for m in group) and search.known(floor) is None:
                search.trace(floor)
                continue
            line = lines[(_family(r.stack), r.stack.optimizer, r.stack.checkpointing, r.stack.ckpt_every)]
            open_ = [m for m in line if search.known(m) is None]
            search.trace(open_[0] if open_[0] is line[0] else open_[len(open_) // 2])
        if r.status != "traced" and search.known(r):
            search.trace(r)
        found += bool(r.fits)
        if bar is not None:
            bar.update(1)
