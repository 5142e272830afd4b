"""The planner's search: trace as few stacks as it can (rule out by the memory order, trace each family's
floor first, bisect micro-batches), cheapest first, until ``top`` stacks fit."""
from __future__ import annotations

from typing import Any

from memlab.core.units import format_bytes
from memlab.plan.result import PlanRow
from memlab.plan.search import _ckpt_set, _family, _needs_at_least
from memlab.plan.stacks import _estimate


class _Search:
    """The traces of one plan: which rows fit, which do not, how many were traced."""

    def __init__(self, name: str, cfg: Any, n_layers: int, *, seq_len: int, device: str, lora_r: int, loss: str,
                 budget: int, host_budget: int | None) -> None:
        self.name, self.cfg, self.L = name, cfg, n_layers
        self.kw = dict(seq_len=seq_len, device=device, lora_r=lora_r, loss=loss)
        self.device, self.budget, self.host_budget = device, budget, host_budget
        self.failed: list[PlanRow] = []
        self.fitted: list[PlanRow] = []
        self.traces = 0

    def trace(self, r: PlanRow) -> None:
        est = _estimate(self.name, self.cfg, r.stack, **self.kw)
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
            if _needs_at_least(r.stack, f.stack, self.L):
                r.fits, r.status, r.notes = False, "exceeds", f"needs at least the peak of #{f.stack_id} (> budget): not traced"
                return False
        if any(_needs_at_least(d.stack, r.stack, self.L) for d in self.fitted):
            return True
        return None


def _live_rows(rows: list[PlanRow], L: int) -> list[PlanRow]:
    """Number the rows; mark those dominated (another of the same family needs no more memory and ranks
    no lower); return the others."""
    live = []
    for i, r in enumerate(rows):
        r.stack_id = i + 1
        dom = next((d for d in rows[:i] if d.stack != r.stack and _needs_at_least(r.stack, d.stack, L)), None)
        if dom is not None:
            r.status, r.notes = "dominated", f"never better than #{dom.stack_id} (no less memory, no lower rank): not traced"
        else:
            live.append(r)
    return live


def _trace_family_floors(search: _Search, live: list[PlanRow]) -> None:
    """The floor of each family (the smallest micro-batch, the most checkpointing, the leanest optimizer):
    every member needs at least its memory, so if it does not fit, none does (only where offload-adamw is
    allowed: the one optimizer below all others)."""
    L = search.L
    families: dict[tuple, list[PlanRow]] = {}
    for r in live:
        families.setdefault(_family(r.stack), []).append(r)
    for members in sorted(families.values(), key=lambda m: min(r.key for r in m)):
        floor = min(members, key=lambda r: (r.stack.micro_batch, -len(_ckpt_set(r.stack, L)),
                                             r.stack.optimizer != "offload-adamw"))
        if all(_needs_at_least(o.stack, floor.stack, L) for o in members):
            search.trace(floor)


def run_search(search: _Search, live: list[PlanRow], top: int, bar: Any = None) -> None:
    """Decide the live rows cheapest first until ``top`` fit.

    A stack not yet decided is decided by tracing, in this order, the floor of its family and optimizer
    (the smallest micro-batch, the most checkpointing), then its line (the same family, optimizer and
    checkpointing; micro-batches ascending, monotone in memory): the smallest micro-batch first, then by
    bisection.

    Args:
        search: the traces so far.
        live: the rows not dominated, in ranking order.
        top: stop after this many rows that fit.
        bar: a progress bar (tqdm) or None.

    Returns:
        None; ``search`` holds the traces taken and the rows decided along the way are updated.
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
            if all(_needs_at_least(m.stack, floor.stack, L) for m in group) and search.known(floor) is None:
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
