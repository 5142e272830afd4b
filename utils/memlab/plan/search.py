"""The planner's search: the candidates (every stack ``allow`` admits) and the search that traces as few stacks
as it can, cheapest first, until ``top`` fit: rule out by the bounds and the memory order of
:mod:`memlab.plan.bounds`, trace a family's floor when the search reaches it, then walk each line of
micro-batches where a prediction from its traced peaks points."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from memlab.core.units import format_bytes
from memlab.plan.bounds import (accumulation_lower_bound, ckpt_set, family, fits_by_neighbour, host_lower_bound,
                                lower_bound, needs_at_least, needs_at_least_less_kept)
from memlab.plan.result import PlanRow
from memlab.plan.stack import (ALLOWED_VALUES, DEFAULT_ALLOW, Stack, canonical_in_backward,
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


# ----------------------------------------------------------------------------- the search
class Search:
    """The traces of one plan: which rows fit (``fitted``), which do not (``failed``), how many stacks were
    estimated (``traces``: ``fresh`` traced now, ``cached`` read from the trace cache), how many were decided by a
    bound (``below``: the lower bound, :func:`memlab.plan.bounds.lower_bound`, exceeds the budget; ``above``: a traced
    neighbour that fits needs at least their memory, :func:`memlab.plan.bounds.fits_by_neighbour`); ``budget`` and
    ``host_budget`` in bytes, ``host_budget`` None for no bound. ``counts`` (:class:`memlab.plan.bounds.ParamCounts`)
    None or ``prune`` False: no lower bound."""

    def __init__(self, name: str, cfg: Any, n_layers: int, *, seq_len: int, device: str, lora_r: int, loss: str,
                 budget: int, host_budget: int | None, counts: Any = None, prune: bool = True) -> None:
        self.name, self.cfg, self.L = name, cfg, n_layers
        self.kw = dict(seq_len=seq_len, device=device, lora_r=lora_r, loss=loss)
        self.device, self.budget, self.host_budget = device, budget, host_budget
        self.counts, self.prune, self.lora_r = counts, prune, lora_r
        self.failed: list[PlanRow] = []
        self.fitted: list[PlanRow] = []
        self.traces = self.fresh = self.cached = self.below = self.above = 0
        self.host_compared: list[int] = []  # every host size compared with host_budget (memlab.plan.memo)
        # tracing ahead (memlab.plan.ahead; run_search sets it up): the child process, the estimates the search has
        # (by stack), those traced ahead and not asked for yet, the rows as the search started (for next_after)
        self.ahead: Any = None
        self.estimates: dict[Stack, Any] = {}
        self.spare: dict[Stack, tuple[Any, str]] = {}
        self.ahead_used = self.ahead_unused = 0
        self._start: list[PlanRow] = []
        self._top = 0

    def lower(self, r: PlanRow) -> int | None:
        """``r``'s lower bound in bytes (None without ``counts``), kept in ``r.lower_bytes``."""
        if self.counts is None:
            return None
        if r.lower_bytes is None:
            r.lower_bytes = lower_bound(r.stack, self.counts, self.lora_r)
        return r.lower_bytes

    def _below(self, r: PlanRow) -> bool:
        # decided by the lower bound: its weights, gradients and optimizer state alone exceed the budget (a stack
        # that needs at least its memory exceeds it too), or an offloaded optimizer's host buffers the host budget
        # (which says nothing of the device memory of others)
        if not self.prune or self.counts is None:
            return False
        lb = self.lower(r)
        host = host_lower_bound(r.stack, self.counts)
        if lb > self.budget:
            r.notes = f"weights + gradients + optimizer state alone: {format_bytes(lb)} > budget: not traced"
            self.failed.append(r)
        elif self.host_budget is not None and host and (self.host_compared.append(host) or host > self.host_budget):
            r.notes = (f"host: the offloaded optimizer's fp32 weights, gradients and moments alone: {format_bytes(host)} "
                       f"> host budget {format_bytes(self.host_budget)}: not traced")
        else:
            return False
        r.fits, r.status = False, "exceeds"
        self.below += 1
        return True

    def trace(self, r: PlanRow) -> None:
        """Trace ``r``'s stack (:func:`memlab.plan.stacks.cached_estimate`) and record its peak and fit in ``r``;
        with ``prune``, a stack whose lower bound exceeds the budget is recorded as not fitting, untraced."""
        if self._below(r):
            return
        est, origin = self._estimate(r.stack)
        self.traces += 1
        if origin == "traced":
            self.fresh += 1
        else:
            self.cached += 1
        self._record(r, est)

    def _record(self, r: PlanRow, est: Any) -> None:
        # a traced estimate's peak and fit in r
        self.estimates[r.stack] = est
        need = est.reserved_bytes if self.device == "cuda" else est.peak_bytes
        r.peak_bytes, r.fits, r.status = int(need), need <= self.budget, "traced"
        r.tensor_peak_bytes = int(est.peak_bytes)
        r.host_bytes, r.phase = est.host_bytes, est.peak_phase
        r.notes = f"peak in {est.peak_phase}" + (", extrapolated" if est.extrapolated_from else "")
        (self.fitted if r.fits else self.failed).append(r)
        if r.fits and self.host_budget is not None:
            self.host_compared.append(r.host_bytes)
        if r.fits and self.host_budget is not None and r.host_bytes > self.host_budget:
            # fits the device, not the host: the device-memory order says nothing about it
            self.fitted.remove(r)
            r.fits = False
            r.notes += f"; host {format_bytes(r.host_bytes)} > host budget {format_bytes(self.host_budget)}"

    def _here(self, stack: Stack) -> tuple[Any, str]:
        # the estimate of stack made (or read from the trace cache) in this process, and where it came from
        origin: list[str] = []
        est = cached_estimate(self.name, self.cfg, stack, **self.kw, origin=origin)
        return est, origin[0]

    def _estimate(self, stack: Stack) -> tuple[Any, str]:
        # stack's estimate and its origin ("traced": traced now, here or ahead in the child; else a cache's): taken
        # from what was traced ahead, else traced here -- the child meanwhile tracing the stack likely asked next
        self.collect()
        if stack in self.spare:
            self.ahead_used += 1
            return self.spare.pop(stack)
        ahead = self.ahead
        if ahead is not None and ahead.busy and ahead.stack == stack:
            if not ahead.done():  # while the child finishes it, trace here what comes after it if it does not fit
                guess = self.next_after(stack, surest=True)
                if guess is not None:
                    try:
                        self.spare[guess] = self._here(guess)
                    except Exception:  # noqa: BLE001 (a guess the search may never ask for: its error waits till then)
                        pass
            got = ahead.take()
            if got is not None:
                self._from_child(stack, got)
                self.ahead_used += 1
                return self.spare.pop(stack)
        elif ahead is not None and not ahead.busy:
            guess = self.next_after(stack)
            if guess is not None:
                try:
                    ahead.start(guess)
                except OSError:  # no process to be had (memory, limits): one process from here on
                    self.ahead = None
        return self._here(stack)

    def _from_child(self, stack: Stack, got: tuple[Any, str]) -> None:
        # a child's estimate: kept in the memory cache (the child wrote the disk cache) and with the spare ones
        from memlab.plan.stacks import remember_estimate

        remember_estimate(self.cfg, stack, got[0], **self.kw)
        self.spare[stack] = got

    def collect(self) -> None:
        """Take a finished child's result (a stack traced ahead) into the spare ones; call between traces."""
        if self.ahead is not None and self.ahead.busy and self.ahead.done():
            stack = self.ahead.stack
            got = self.ahead.take()
            if got is not None:
                self._from_child(stack, got)

    def close_ahead(self) -> None:
        """Stop tracing ahead: a child still running is stopped; what was traced ahead and never asked for is
        counted in ``ahead_unused``."""
        if self.ahead is not None:
            self.ahead_unused += int(self.ahead.busy)
            self.ahead.close()
        self.ahead_unused += len(self.spare)
        self.spare.clear()
        self.ahead = None

    def next_after(self, stack: Stack, surest: bool = False) -> Stack | None:
        """The stack the search would trace next after ``stack``, or None: the search run again from its start on
        copies of its rows (:func:`run_search`), the estimates it has answering its traces and ``stack`` assumed far
        over the budget (most traced stacks are: the search goes cheapest first); where the search would then ask for
        nothing more (and not ``surest``), assumed just within the budget, then just over it. None: nothing more
        under these, or the next stack is in the trace cache, traced ahead already or in the child."""
        for peak in (1 << 62,) if surest else (1 << 62, self.budget, self.budget + 1):
            shadow = _Shadow(self, stack, _Assumed(peak_bytes=peak, reserved_bytes=peak))
            try:
                run_search(shadow, [dataclasses.replace(r) for r in self._start], self._top)
            except _Next as nxt:
                busy = self.ahead is not None and self.ahead.busy and self.ahead.stack == nxt.stack
                return None if (busy or nxt.stack in self.spare) else nxt.stack
            except Exception:  # noqa: BLE001 (a guess only orders the tracing: without one the search traces as asked)
                return None
        return None

    def neighbour(self, r: PlanRow) -> PlanRow | None:
        """A traced row that fits and needs at least ``r``'s memory, device and host (so ``r`` fits), or None."""
        return next((d for d in self.fitted if fits_by_neighbour(r.stack, d.stack, self.L)), None)

    def known(self, r: PlanRow) -> bool | None:
        """Whether r fits, as far as the bounds and the traces so far decide it (None: not decided)."""
        if r.status in ("traced", "exceeds", "fits"):
            return r.fits
        if self._below(r):
            return False
        for f in self.failed:
            if needs_at_least(r.stack, f.stack, self.L):
                r.fits, r.status, r.notes = False, "exceeds", f"needs at least the memory of #{f.stack_id} (> budget): not traced"
                return False
        if self._below_accumulating(r):
            return False
        return True if self.neighbour(r) is not None else None

    def _below_accumulating(self, r: PlanRow) -> bool:
        # decided by a traced accumulating stack that does not fit and that r, one micro-batch per step, needs at
        # least the memory of less the gradients it keeps (memlab.plan.bounds.accumulation_lower_bound)
        if not self.prune or self.counts is None or r.stack.grad_accum != 1:
            return False
        for f in self.failed:
            if f.tensor_peak_bytes is None or not needs_at_least_less_kept(r.stack, f.stack, self.L):
                continue
            lb = accumulation_lower_bound(f.stack, f.tensor_peak_bytes, self.counts, self.lora_r)
            if lb > self.budget:
                r.lower_bytes = max(lb, self.lower(r))
                r.fits, r.status = False, "exceeds"
                r.notes = (f"needs at least #{f.stack_id}'s traced tensor peak less the gradients it keeps between "
                           f"micro-batches: {format_bytes(lb)} > budget: not traced")
                return True
        return False

    def bound_fit(self, r: PlanRow) -> bool:
        """Record ``r`` as fitting by a traced neighbour (:meth:`neighbour`), untraced; False where none decides it."""
        d = self.neighbour(r)
        if d is None:
            return False
        r.fits, r.status, r.upper_bytes, r.host_bytes = True, "fits", d.peak_bytes, d.host_bytes
        r.notes = f"needs no more than #{d.stack_id} ({format_bytes(d.peak_bytes)}, fits): not traced"
        self.above += 1
        return True


class _Next(Exception):
    # the first stack a shadow search (Search.next_after) would trace that no estimate answers
    def __init__(self, stack: Stack) -> None:
        super().__init__(stack)
        self.stack = stack


@dataclasses.dataclass
class _Assumed:
    # the estimate a shadow search assumes for the stack being traced (Search.next_after)
    peak_bytes: int
    reserved_bytes: int
    host_bytes: int = 0
    peak_phase: str = "assumed"
    extrapolated_from: Any = None


class _Shadow(Search):
    # a copy of a search that traces nothing: its traces are answered by the estimates the search has, the trace
    # cache, or (the stack being traced) an assumed estimate; the first one none answers stops it (_Next)
    def __init__(self, real: Search, stack: Stack, assumed: _Assumed) -> None:  # noqa: D107  (a copy: no __init__)
        self.__dict__.update(real.__dict__)
        self.failed, self.fitted, self.host_compared = [], [], []
        self.ahead, self.spare = None, {}
        self.estimates = dict(real.estimates)
        self.estimates.setdefault(stack, assumed)
        self.real = real

    def trace(self, r: PlanRow) -> None:
        if self._below(r):
            return
        est = self.estimates.get(r.stack)
        if est is None and r.stack in self.real.spare:
            est = self.real.spare[r.stack][0]
        if est is None:
            from memlab.plan.stacks import lookup_estimate

            est = lookup_estimate(self.cfg, r.stack, **self.kw)
        if est is None:
            raise _Next(r.stack)
        self._record(r, est)


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


def _family_floors(live: list[PlanRow], L: int) -> dict[tuple, PlanRow | None]:
    # The floor of each family (the smallest micro-batch, the most checkpointing, the leanest optimizer):
    # every member needs at least its memory, so if it does not fit, none does (only where offload-adamw is
    # allowed: the one optimizer below all others); None where no member is below all the others.
    families: dict[tuple, list[PlanRow]] = {}
    for r in live:
        families.setdefault(family(r.stack), []).append(r)
    out: dict[tuple, PlanRow | None] = {}
    for fam, members in families.items():
        floor = min(members, key=lambda r: (r.stack.micro_batch, -len(ckpt_set(r.stack, L)),
                                             r.stack.optimizer != "offload-adamw"))
        out[fam] = floor if all(needs_at_least(o.stack, floor.stack, L) for o in members) else None
    return out


def _next_on_line(search: Search, line: list[PlanRow], target: PlanRow) -> PlanRow:
    # The member of a line (one family, optimizer and checkpointing; micro-batches ascending) to trace next:
    # the largest open micro-batch whose predicted peak fits -- if it does, every smaller one fits with it (the
    # memory order) -- else the smallest open one -- if it does not fit, no larger one does. The prediction only
    # chooses what to trace, it decides nothing: a line's traced peaks, linear in the micro-batch through the two
    # nearest (or through one and the lower bound, the micro-batch-free part). With no trace on the line yet:
    # ``target`` (the stack being decided) where its lower bound is under a quarter of the budget (a small model
    # on a large card), else the smallest micro-batch.
    open_ = [m for m in line if search.known(m) is None]
    points = sorted((m.stack.micro_batch, m.peak_bytes) for m in line if m.status == "traced")
    if not points:
        lb = search.lower(target)
        return target if lb is not None and 4 * lb <= search.budget and target in open_ else open_[0]

    def predict(m: PlanRow) -> float:
        x = m.stack.micro_batch
        if len(points) == 1:
            (x1, y1), base = points[0], search.lower(m) or 0
            return base + (y1 - base) * x / x1
        (x1, y1), (x2, y2) = sorted(points, key=lambda p: (abs(p[0] - x), p[0]))[:2]
        return y1 + (y2 - y1) * (x - x1) / (x2 - x1)

    fit = [m for m in open_ if predict(m) <= search.budget]
    return fit[-1] if fit else open_[0]


def run_search(search: Search, live: list[PlanRow], top: int, bar: Any = None) -> None:
    """Decide the ``live`` rows (not dominated, in ranking order) cheapest first until ``top`` fit; the rows
    decided along the way are updated in place and ``search`` holds the traces taken.

    A stack not yet decided is decided by its lower bound (:func:`memlab.plan.bounds.lower_bound`) or by
    tracing, in this order, the floor of its family, the floor of its family and optimizer
    (the smallest micro-batch, the most checkpointing), then its line (the same family, optimizer and
    checkpointing; micro-batches ascending, monotone in memory): the smallest micro-batch first, then the one a
    prediction from the line's traced peaks points at (:func:`_next_on_line`). Of the stacks that fit, the first
    (the pick) is traced; the others are traced only where no traced neighbour decides them. ``bar``: a tqdm
    progress bar or None.

    Where :func:`memlab.plan.ahead.ahead_possible`, a forked process traces ahead the stack the search will likely
    ask for next (:meth:`Search.next_after`) while this one traces the stack asked for; the rows are those of the
    search without it (every estimate is that stack's trace; only the order of the tracing changes).
    """
    if isinstance(search, _Shadow) or not search.prune:
        _search(search, live, top, bar)
        return
    from memlab.plan.ahead import TraceAhead, ahead_possible

    search._start, search._top = [dataclasses.replace(r) for r in live], top
    if ahead_possible():
        search.ahead = TraceAhead(search._here)
    try:
        _search(search, live, top, bar)
    finally:
        search.close_ahead()


def _search(search: Search, live: list[PlanRow], top: int, bar: Any) -> None:
    # run_search's loop
    L = search.L
    lines: dict[tuple, list[PlanRow]] = {}
    for r in live:
        lines.setdefault((family(r.stack), r.stack.optimizer, r.stack.checkpointing, r.stack.ckpt_every), []).append(r)
    for members in lines.values():
        members.sort(key=lambda r: r.stack.micro_batch)
    floors = _family_floors(live, L)
    groups: dict[tuple, list[PlanRow]] = {}
    for r in live:
        groups.setdefault((family(r.stack), r.stack.optimizer), []).append(r)
    found = 0
    for r in live:
        if found >= top:
            break
        while search.known(r) is None:
            floor = floors[family(r.stack)]  # traced when the search first reaches its family
            if floor is not None and search.known(floor) is None:
                search.trace(floor)
                continue
            group = groups[(family(r.stack), r.stack.optimizer)]
            floor = min(group, key=lambda m: (m.stack.micro_batch, -len(ckpt_set(m.stack, L))))
            if all(needs_at_least(m.stack, floor.stack, L) for m in group) and search.known(floor) is None:
                search.trace(floor)
                continue
            line = lines[(family(r.stack), r.stack.optimizer, r.stack.checkpointing, r.stack.ckpt_every)]
            search.trace(_next_on_line(search, line, r))
        if r.status != "traced" and search.known(r):
            # the pick is traced (its peak is the plan's answer); the others that fit by a traced neighbour are not
            if not found or not search.prune or not search.bound_fit(r):
                search.trace(r)
        found += bool(r.fits)
        if bar is not None:
            bar.update(1)
