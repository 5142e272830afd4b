"""What the planner returns: a ranked row per stack (:class:`PlanRow`) and the whole plan (:class:`PlanResult`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from memlab.core.units import format_bytes
from memlab.plan.cost import CostModel
from memlab.plan.stack import TIER_TEXT, Stack, stack_label


@dataclass
class PlanRow:
    """One stack: its estimated peak (what is compared with the budget: the reserved estimate on
    a CUDA target, the tensor peak on a CPU), whether it fits, its relative cost and notes.

    ``status``: "traced" (estimated), "exceeds" (not traced: it needs at least the memory of a
    traced stack that does not fit), "dominated" (not traced: a stack of the same family needs no
    more memory and ranks no lower) or "not needed" (not traced: ranked below the stacks found).
    ``stack_id`` is its place in the order of the ranking key (the table's "rank")."""

    stack: Stack
    cost: float
    tier: int
    peak_bytes: int | None = None
    fits: bool | None = None
    status: str = "not needed"
    host_bytes: int = 0
    phase: str = ""
    notes: str = ""
    terms: dict[str, float] = field(default_factory=dict, repr=False)
    stack_id: int = 0  # its place in the ranking order (the table's "rank")
    key: tuple[int, float] = (0, 0.0)  # the ranking key: (fidelity tier, cost), or (0, cost) with prefer="cost"



@dataclass
class PlanResult:
    """What :func:`plan` found. ``rows`` are ranked: the stacks that fit (by fidelity tier, then
    relative cost), then those traced that do not (by peak), then those ruled out without a trace,
    then those not needed. ``pick`` is the first row that fits, or None."""

    model: str
    n_params: int
    batch_size: int
    seq_len: int
    budget: int
    budget_label: str
    device: str
    cost_model: CostModel
    rows: list[PlanRow]
    notes: list[str]
    seconds: float
    traces: int
    prefer: str = "fidelity"

    @property
    def pick(self) -> PlanRow | None:
        """The first row that fits, or None."""
        return self.rows[0] if self.rows and self.rows[0].fits else None

    @property
    def feasible(self) -> list[PlanRow]:
        """The rows that fit."""
        return [r for r in self.rows if r.fits]

    @property
    def verdict(self) -> str:
        """One line: the pick and its cost, or the smallest estimate when nothing fits."""
        if self.pick is not None:
            p = self.pick
            host = f", needs {format_bytes(p.host_bytes)} of host memory for offloaded state"
            return (f"pick: {stack_label(p.stack)}: {format_bytes(p.peak_bytes)} estimated of {format_bytes(self.budget)}"
                    f"{host}, relative cost {p.cost:.2f} ({TIER_TEXT[p.tier]})")
        traced = [r for r in self.rows if r.status == "traced"]
        if not traced:
            return f"nothing fits {format_bytes(self.budget)}: no stack was traced"
        low = min(traced, key=lambda r: r.peak_bytes)
        return (f"nothing fits {format_bytes(self.budget)}: the smallest estimate is {format_bytes(low.peak_bytes)} "
                f"({stack_label(low.stack)}); allow more (adapters, offload, checkpointing), a shorter sequence, or more GPUs (chapter 08)")

    def table(self, limit: int | None = 12) -> str:
        """The ranked rows as a plain-text table, the first ``limit`` of them (None: all)."""
        head = ("rank", "stack", "peak", "fits", "rel. cost", "tier", "host", "notes")
        rows = [head]
        shown = self.rows if limit is None else self.rows[:limit]
        for r in shown:
            rows.append((str(r.stack_id), stack_label(r.stack), format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-",
                         {True: "yes", False: "no", None: "?"}[r.fits], f"{r.cost:.2f}", str(r.tier),
                         format_bytes(r.host_bytes) if r.status == "traced" else "-", r.notes))
        widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
        lines = []
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if i in (1, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        if limit is not None and len(self.rows) > limit:
            lines.append(f"... {len(self.rows) - limit} more rows (table(limit=None) / --all)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


