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

    ``status``: "traced" (estimated), "fits" (not traced: a traced stack that fits needs at least its
    memory, :func:`memlab.plan.bounds.fits_by_neighbour`; ``upper_bytes`` is that stack's peak), "exceeds" (not traced: its
    weights, gradients and optimizer state alone, ``lower_bytes``, exceed the budget, or it needs at least the memory of a
    stack that does not fit, or a traced one's tensor peak less the gradients that one keeps between micro-batches,
    :func:`memlab.plan.bounds.accumulation_lower_bound`, then ``lower_bytes``), "dominated" (not traced: a stack of the
    same family needs no more memory and ranks no lower) or "not needed" (not traced: ranked below the stacks found).
    ``stack_id`` is its place in the order of the ranking key (the table's "id", which notes name as #id)."""

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
    stack_id: int = 0  # its place in the order of the ranking key (the table's "id")
    key: tuple[int, float] = (0, 0.0)  # the ranking key: (fidelity tier, cost), or (0, cost) with prefer="cost"
    # weights + gradients + optimizer state (memlab.plan.bounds.lower_bound), if computed; or the larger accumulation
    # bound that decided the row (memlab.plan.bounds.accumulation_lower_bound)
    lower_bytes: int | None = None
    upper_bytes: int | None = None  # status "fits": the peak of the traced stack that needs at least its memory
    # status "traced": the traced tensor peak (on a CUDA target below ``peak_bytes``, the reserved estimate), which
    # memlab.plan.bounds.accumulation_lower_bound starts from
    tensor_peak_bytes: int | None = None



def format_count(n: int) -> str:
    """A count in human units: ``871_552`` -> ``"871.55k"``, ``8_030_261_248`` -> ``"8.03B"`` (k, M, B, T = 10**3,
    10**6, 10**9, 10**12); below 1,000 the number itself."""
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


#: the table's columns, each explained (:meth:`PlanResult.legend` fills in the device's words)
COLUMNS = ("rank", "id", "stack", "peak", "fits", "rel. cost", "tier", "host", "notes")


@dataclass
class PlanResult:
    """What :func:`plan` found. ``rows`` are ranked: the stacks that fit (by fidelity tier, then
    relative cost), then those traced that do not (by peak), then those ruled out without a trace,
    then those not needed. ``pick`` is the first row that fits, or None (it is always traced).

    ``traces``: stacks estimated, ``fresh`` of them traced now and ``cached`` read from the trace cache;
    ``below`` / ``above``: stacks decided untraced by the lower bound / by a traced neighbour that fits;
    ``pruned``: False for the exhaustive planner (``plan(prune=False)``); ``cost_basis``: whose constants the
    relative costs use; ``remembered``: the whole plan was read from the plan cache (:mod:`memlab.plan.memo`);
    ``ahead``: of the ``fresh`` traces, those made ahead, two at a time (:mod:`memlab.plan.ahead`), ``ahead_unused``:
    traces made ahead that the search never asked for (not in ``traces``)."""

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
    fresh: int = 0
    cached: int = 0
    below: int = 0
    above: int = 0
    pruned: bool = True
    cost_basis: str = ""
    remembered: bool = False
    ahead: int = 0
    ahead_unused: int = 0

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
        bounded = [r for r in self.rows if r.status == "exceeds" and (r.lower_bytes or 0) > self.budget]
        if not traced and bounded:
            low = min(bounded, key=lambda r: r.lower_bytes)
            return (f"nothing fits {format_bytes(self.budget)}: no stack was traced; the weights, gradients and "
                    f"optimizer state alone of the leanest ({stack_label(low.stack)}) are {format_bytes(low.lower_bytes)}; "
                    f"allow more (adapters, offload), or more GPUs (chapter 08)")
        if not traced:
            return f"nothing fits {format_bytes(self.budget)}: no stack was traced"
        low = min(traced, key=lambda r: r.peak_bytes)
        return (f"nothing fits {format_bytes(self.budget)}: the smallest estimate is {format_bytes(low.peak_bytes)} "
                f"({stack_label(low.stack)}); allow more (adapters, offload, checkpointing), a shorter sequence, or more GPUs (chapter 08)")

    @property
    def summary(self) -> str:
        """One line: how many candidates were traced now, read from the cache, decided by a bound, and the time."""
        decided = (f"{self.below} ruled out untraced by a lower bound (weights + gradients + optimizer state, or an "
                   f"offloaded optimizer's host buffers), {self.above} decided to fit by a traced stack that needs at least "
                   f"their memory" if self.pruned else "exhaustive: no bound, no early stop")
        memo = "; the plan read whole from the plan cache" if self.remembered else ""
        ahead = ""
        if (self.ahead or self.ahead_unused) and not self.remembered:
            ahead = (f"; {self.ahead} of the traces made ahead, two at a time (and {self.ahead_unused} made ahead not "
                     f"needed)")
        return (f"{len(self.rows)} candidates: {self.fresh} stacks traced on fake tensors, {self.cached} read from the "
                f"trace cache; {decided}{memo}{ahead}; {self.seconds:.1f} s")

    def legend(self) -> list[str]:
        """One line per column of :meth:`table`, saying what it shows."""
        peak = ("the reserved estimate (tensors + cuBLAS workspaces, through a model of the caching allocator)"
                if self.device == "cuda" else "the traced tensor peak")
        return [
            "rank       place among the stacks that fit, best first (1 = the pick); '-': does not fit, or not decided",
            "id         the candidate's place in the ranking key's order over all candidates (notes name it #id)",
            "stack      [adapter] precision optimizer checkpointing ('no ckpt'; 'ckpt 1/k': every k-th block; 'ckpt all') "
            "[chapter 09: 'fused loss', 'opt-in-bwd'] 'mb MxA': micro-batches of M sequences, A accumulated per "
            "optimizer step (M x A = the effective batch)",
            f"peak       {peak}, compared with the budget; '<= X': not traced, at most the peak X of a traced stack that "
            "fits; '>= X': not traced, at least X: its weights + gradients + optimizer state alone, or a traced stack's peak "
            "less the gradients that stack keeps between micro-batches",
            "fits       yes / no within the budget; '?': not decided (not needed, or never better than a stack above)",
            f"rel. cost  seconds per optimizer step / the ideal 16-bit forward + backward of the effective batch at the "
            f"cost model's MFU ({self.cost_basis or self.cost_model.name}); compares stacks, not a measurement",
            "tier       how far the update is from the fp32-master AdamW update: " +
            ", ".join(f"{k} {v}" for k, v in TIER_TEXT.items()),
            "host       host memory of an offloaded optimizer (fp32 master weights, gradient slots, moments)",
            "notes      where the traced peak falls (forward / backward / step), or why the stack was not traced",
        ]

    def table(self, limit: int | None = 12) -> str:
        """The ranked rows as a plain-text table, the first ``limit`` of them (None: all); :meth:`legend` explains
        each column."""
        rows = [COLUMNS]
        shown = self.rows if limit is None else self.rows[:limit]
        rank = 0
        for r in shown:
            if r.fits:
                rank += 1
            if r.peak_bytes is not None:
                peak = format_bytes(r.peak_bytes)
            elif r.status == "fits" and r.upper_bytes is not None:
                peak = f"<= {format_bytes(r.upper_bytes)}"
            elif r.status == "exceeds" and r.lower_bytes is not None and r.lower_bytes > self.budget:
                peak = f">= {format_bytes(r.lower_bytes)}"
            else:
                peak = "-"
            rows.append((str(rank) if r.fits else "-", str(r.stack_id), stack_label(r.stack), peak,
                         {True: "yes", False: "no", None: "?"}[r.fits], f"{r.cost:.2f}", str(r.tier),
                         format_bytes(r.host_bytes) if r.status in ("traced", "fits") else "-", r.notes))
        widths = [max(len(x[i]) for x in rows) for i in range(len(COLUMNS))]
        lines = []
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if i in (2, 8) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        if limit is not None and len(self.rows) > limit:
            lines.append(f"... {len(self.rows) - limit} more rows (table(limit=None) / --all)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
