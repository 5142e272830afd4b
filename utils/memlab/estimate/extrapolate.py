"""The one extrapolation by depth (estimate and plan): a homogeneous decoder stack traced at three evenly
spaced depths, every moment's bytes affine in the layer count, each phase's candidate peaks (its start and
its end, :func:`aligned_peaks`) extended exactly to the full depth; and its FSDP2 variant (each run of one
phase extrapolated, checked against a third depth)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from memlab.core.forking import in_two, portable_estimate, spare_cpu, tracing_starts
from memlab.estimate import trace_cache
from memlab.estimate.model import ModelSpec
from memlab.core.vocab import CATEGORIES
from memlab.estimate.result import MemoryEstimate, PhaseSummary
from memlab.estimate.recipes import EXTRAPOLATE_MIN_LAYERS, EXTRAPOLATION_DEPTHS
from memlab.estimate.routes import callable_route, factory_layers_differ, route_note
from memlab.estimate.step import StepSpec


def __getattr__(name: str) -> Any:
    # trace_step imported on first use: an estimate read from the trace cache never imports torch (PEP 562; tests
    # replace the module's trace_step, which the functions below then call)
    if name == "trace_step":
        from memlab.estimate.trace import trace_step

        globals()["trace_step"] = trace_step
        return trace_step
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _trace_step() -> Callable[..., MemoryEstimate]:
    return globals().get("trace_step") or __getattr__("trace_step")


REPLAY_NOTE = "reserved: the traced allocations replayed through a model of PyTorch's CUDA caching allocator"


def _affine(a: int, b: int, d1: int, d2: int, n: int) -> int:
    slope, rem = divmod(b - a, d2 - d1)
    if rem:
        raise ArithmeticError("not affine in the layer count")
    return a + slope * (n - d1)


def _step_segments(est: MemoryEstimate) -> list[tuple[str, list[tuple[str, dict[str, int]]]]] | None:
    # the traced timeline cut where the step moves between forward, backward, the optimizer step and the rest
    # (each micro-batch's forward and backward a segment of its own); an optimizer step or an "other" moment inside
    # backward (the optimizer in backward) stays in the backward's segment. Each event: (its phase, its breakdown).
    timeline = getattr(est.tracker, "timeline", None)
    if not isinstance(timeline, list):
        return None
    segs: list[tuple[str, list]] = []
    held: list[tuple[str, dict[str, int]]] = []  # optimizer/other moments after a backward one, not placed yet

    def place(ph: str, bd: dict[str, int]) -> None:
        if segs and segs[-1][0] == ph:
            segs[-1][1].append((ph, bd))
        else:
            segs.append((ph, [(ph, bd)]))

    for ev in timeline:
        bd = {k: int(ev.bytes.get(k, 0)) for k in CATEGORIES}
        if segs and segs[-1][0] == "backward" and ev.phase in ("optimizer", "other"):
            held.append((ev.phase, bd))
            continue
        if held and ev.phase == "backward":
            segs[-1][1].extend(held)
        else:
            for h in held:
                place(*h)
        held = []
        place(ev.phase, bd)
    for h in held:
        place(*h)
    return segs


def _collinear(x: dict[str, int], y: dict[str, int], z: dict[str, int]) -> bool:
    return all(y[k] - x[k] == z[k] - y[k] for k in CATEGORIES)


def _phase_candidates(x1: list, x2: list, x3: list) -> list[tuple[int, int, int]] | None:
    # the positions (in each of the three traces) of the moments lined up from the segment's start and from its end
    # whose bytes are collinear over the three depths, in time order; None where the three traces do not show the
    # shape of a head, blocks and a tail
    k = len(x2) - len(x1)
    if k < 0 or len(x3) - len(x2) != k:
        return None
    n = len(x1)
    if k == 0:  # nothing repeats per block: every moment lines up, or the shape is another
        return [(i, i, i) for i in range(n)] if all(_collinear(x1[i], x2[i], x3[i]) for i in range(n)) else None
    start = [(i, i, i) for i in range(n) if _collinear(x1[i], x2[i], x3[i])]
    end = [(n - 1 - j, len(x2) - 1 - j, len(x3) - 1 - j) for j in reversed(range(n))
           if _collinear(x1[n - 1 - j], x2[len(x2) - 1 - j], x3[len(x3) - 1 - j])]
    return start + end


def aligned_peaks(a: MemoryEstimate, b: MemoryEstimate, c: MemoryEstimate, d1: int, d2: int,
                  n: int) -> tuple[dict[str, dict[str, int]], int] | None:
    """Each phase's peak breakdown at depth ``n`` and the most activation bytes, from traces at depths
    ``d1 < d2 < d3`` evenly spaced (``c`` at ``d3 = 2 d2 - d1``).

    A phase's peak is the largest of its moments, each affine in the layer count, and the moment that holds it
    at a few layers can be overtaken at many by one that grows faster (with the fused loss, the end of backward,
    where every gradient is alive, overtakes the loss's backward after a few layers): the peak at the traced
    depths, extrapolated, is then too low. The step is cut into segments (each micro-batch's forward, its
    backward with any optimizer step run inside it, the optimizer step, the moments between), and the moments
    of a segment of a homogeneous stack repeat block by block (a block: ``d2 - d1`` layers): a head, as many
    blocks as the depth holds, a tail. A moment of the head or of the first two blocks keeps its position from
    the segment's start at every traced depth (each holds three blocks at least), one of the last two blocks or
    the tail its position from the end; a moment of block ``m`` between the first and the last (which can
    differ: a frozen embedding, HF's ``inputs_embeds`` kept through the forward, the head after the last) is
    affine in ``m``, so the largest of that run is in its first or its last block. The candidates are the
    moments lined up from the start and from the end whose bytes are collinear over the three depths: they
    include those parts, and any other is a moment of one block at ``d2`` and ``d3`` (true when the head and the
    tail are each at most a block long), whose line is that block's moment at ``n``. Each is extrapolated to
    ``n`` and, per phase, the first largest taken, as the tracker takes its peak. None where the traces do not
    show that shape.
    """
    if d2 <= d1:
        return None
    segs = [_step_segments(e) for e in (a, b, c)]
    if any(sg is None for sg in segs) or not ([m for m, _ in segs[0]] == [m for m, _ in segs[1]] == [m for m, _ in segs[2]]):
        return None
    best: dict[str, tuple[int, dict[str, int]]] = {}
    max_act = 0
    for (_, e1), (_, e2), (_, e3) in zip(*segs):
        cands = _phase_candidates(*([bd for _, bd in e] for e in (e1, e2, e3)))
        if cands is None:
            return None
        for i, j, l in cands:
            if not e1[i][0] == e2[j][0] == e3[l][0]:  # lined up by chance across phases: not one moment
                continue
            try:
                bd = {k: _affine(e1[i][1][k], e2[j][1][k], d1, d2, n) for k in CATEGORIES}
            except ArithmeticError:
                return None
            max_act = max(max_act, bd["activations"])
            ph, total = e1[i][0], sum(bd.values())
            if ph not in best or total > best[ph][0]:  # the first largest in time, as the tracker's peak
                best[ph] = (total, bd)
    if set(best) != set(a.phase_breakdowns):
        return None
    return {ph: best[ph][1] for ph in a.phase_breakdowns}, max_act


def affine_estimate(a: MemoryEstimate, b: MemoryEstimate, d1: int, d2: int, n: int,
                    c: MemoryEstimate | None = None) -> MemoryEstimate | None:
    """The estimate at depth ``n`` from estimates ``a`` and ``b`` of the same step at depths ``d1 < d2``.

    With ``c``, the same step traced at ``2 d2 - d1``, each phase's peak is the largest of its candidate moments
    (:func:`aligned_peaks`) and the numbers are checked against ``c``; without it, each phase's peak is its
    first maximum at the traced depths, extrapolated.

    Returns:
        The extrapolated estimate (its timeline reduced to the phase peaks), or None where the two do
        not show the same shape: other phases or host buffers, a number not affine in the layer count,
        a negative phase.
    """
    if list(a.phase_breakdowns) != list(b.phase_breakdowns) or set(a.host_breakdown) != set(b.host_breakdown):
        return None
    try:
        lin = lambda x, y: _affine(x, y, d1, d2, n)  # noqa: E731
        phase_bd = {ph: {k: lin(a.phase_breakdowns[ph][k], b.phase_breakdowns[ph][k]) for k in CATEGORIES}
                    for ph in b.phase_breakdowns}
        end = {k: lin(a.breakdown_end[k], b.breakdown_end[k]) for k in CATEGORIES}
        n_params = lin(a.n_params, b.n_params)
        max_act = lin(a.max_activation_bytes, b.max_activation_bytes)
        host_bd = {k: lin(a.host_breakdown[k], b.host_breakdown[k]) for k in b.host_breakdown}
        paged = lin(a.paged_bytes, b.paged_bytes)
    except ArithmeticError:
        return None
    if c is not None:
        d3 = 2 * d2 - d1
        check = affine_estimate(a, b, d1, d2, d3)
        peaks = aligned_peaks(a, b, c, d1, d2, n)
        if check is None or peaks is None or (check.breakdown_end, check.n_params, check.host_breakdown) != (
                c.breakdown_end, c.n_params, c.host_breakdown):
            return None
        phase_bd, max_act = peaks
    phases = {ph: sum(bd.values()) for ph, bd in phase_bd.items()}
    if not phases or any(v < 0 for v in phases.values()):
        return None
    peak = max(phases.values())
    peak_phase = next(ph for ph, v in phases.items() if v == peak)  # the first in time, as the tracker
    est = MemoryEstimate(
        model=b.model, n_params=n_params, batch_size=b.batch_size, seq_len=b.seq_len, dtype=b.dtype,
        optimizer=b.optimizer, checkpointing=b.checkpointing, peak_bytes=peak, breakdown=phase_bd[peak_phase],
        breakdown_end=end, max_activation_bytes=max_act, largest_layer_params=b.largest_layer_params,
        device=b.device, traced_on=b.traced_on, fake=True, seconds=0.0, notes=list(b.notes),
        tracker=PhaseSummary(peak, peak_phase, phases), peak_phase=peak_phase, phase_peaks=phases,
        extras=dict(b.extras), attention=b.attention, step=b.step, optimizer_impl=b.optimizer_impl,
        extrapolated_from=(d1, d2), phase_breakdowns=phase_bd,
        host_bytes=sum(host_bd.values()), host_breakdown=host_bd, adapter=b.adapter, loss=b.loss,
        offload_checkpoints=b.offload_checkpoints, optimizer_in_backward=b.optimizer_in_backward, paged_bytes=paged,
    )
    _extrapolate_reserved(est, [(d1, a), (d2, b)] + ([(2 * d2 - d1, c)] if c is not None else []), n)
    return est


def _extrapolate_reserved(est: MemoryEstimate, traced: list[tuple[int, MemoryEstimate]], n: int) -> None:
    # the caching allocator's replay at each traced depth (memlab.estimate.allocator_replay): what it caches beyond the
    # allocated peak, added to the extrapolated allocated peak and rounded up to the allocator's 2 MiB; none where a
    # trace has no replay. Where it grows layer by layer at every traced depth (LoRA on Llama-2-7B shapes, 1 x 256: 90,
    # 103, 119 MiB at 3, 4, 5 layers; 211 MiB traced at 12) it grows by the smaller step per layer; where it does not
    # (the cached bytes come from a few large blocks: Llama-3.2-3B full fine-tune, 4 x 768: 520, 1683, 1356, 1347,
    # 1290 MiB at 3, 4, 5, 6, 8 layers) the deepest traced figure is kept
    est.notes = [x for x in est.notes if not x.startswith(REPLAY_NOTE)]
    if not all(e.reserved_replay_bytes for _, e in traced):
        return
    cached = [(d, e.reserved_replay_bytes - e.allocated_bytes) for d, e in traced]
    steps = [(f2 - f1) / (d2 - d1) for (d1, f1), (d2, f2) in zip(cached, cached[1:])]
    per_layer = min(steps) if steps and min(steps) > 0 else 0
    frag = max(int(cached[-1][1] + per_layer * (n - cached[-1][0])), 0)
    step = 2 * 2**20
    est.reserved_replay_bytes = -(-(est.allocated_bytes + frag) // step) * step
    est.fragmentation_bytes = est.reserved_replay_bytes - est.allocated_bytes
    shown = ", ".join(f"{d} layers {f / 2**20:,.0f} MiB" for d, f in cached)
    how = f"grown by {per_layer / 2**20:,.1f} MiB a layer" if per_layer else "the deepest's kept"
    est.notes.append(f"{REPLAY_NOTE} (memlab.estimate.caching_allocator) at each traced depth; the bytes it caches "
                     f"beyond the allocated peak ({shown}; {how}) added to the extrapolated peak: "
                     f"max_memory_reserved {est.reserved_replay_bytes / 2**30:,.2f} GiB")


def extrapolate_by_depth(trace_at: Callable[[int], MemoryEstimate], n_layers: int,
                         depth_pairs: Iterable[tuple[int, int]],
                         traced: dict[int, MemoryEstimate] | None = None, jobs: int | None = None) -> MemoryEstimate | None:
    """Trace at two depths and extrapolate to ``n_layers``, trying each pair of depths in turn.

    Args:
        trace_at: depth -> the traced estimate of the same step at that many layers.
        n_layers: the full depth.
        depth_pairs: ``(d1, d2)`` pairs to try in order (a first layer that differs from the others
            makes the first pair fail: the next one starts deeper); each is traced with a third depth
            ``2 d2 - d1`` (:func:`aligned_peaks`); a pair whose third depth is not below ``n_layers`` stops.
        traced: traces already made, by depth (filled in).
        jobs: None (the default): 2 where this process may fork now (:func:`memlab.core.forking.spare_cpu`), else
            1. With 2, the first depth is traced here (its one-time work is inherited by a child forked after it),
            then the deepest in a child while this process traces the middle one (:func:`traced_in_two`); with 1,
            one after another. The estimate is the same either way.

    Returns:
        The extrapolated estimate, or None when no pair gives an affine fit (trace the whole stack).
    """
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs={jobs!r} is invalid; allowed: None (2 where this process may fork), or an int >= 1")
    t0 = time.perf_counter()
    traced = {} if traced is None else traced
    for d1, d2 in depth_pairs:
        d3 = 2 * d2 - d1
        if d3 >= n_layers:
            break
        todo = [d for d in (d1, d2, d3) if d not in traced]
        if len(todo) == 3 and (jobs if jobs is not None else 2 if spare_cpu() else 1) >= 2:
            traced[d1] = trace_at(d1)
            traced.update(traced_in_two(trace_at, [d2], [d3]))
        for d in (d1, d2, d3):
            if d not in traced:
                traced[d] = trace_at(d)
        est = affine_estimate(traced[d1], traced[d2], d1, d2, n_layers, traced[d3])
        if est is not None:
            est.seconds = time.perf_counter() - t0
            return est
    return None


def traced_in_two(trace_at: Callable[[int], MemoryEstimate], mine: list[int],
                  theirs: list[int]) -> dict[int, MemoryEstimate]:
    """``{depth: trace_at(depth)}`` for the depths ``mine`` (traced here) and ``theirs`` (in a forked child with
    this process's imports and warm state: :func:`memlab.core.forking.in_two`; its traces come back with a
    :class:`memlab.core.forking.TracedTimeline` for a tracker). A trace the child did not send back is traced here;
    the first error, in depth order, is raised."""
    done = in_two(trace_at, mine, theirs, portable=portable_estimate)
    out = {d: done[d] if d in done else trace_at(d) for d in sorted([*mine, *theirs])}
    for r in (r for r in out.values() if isinstance(r, BaseException)):
        raise r
    return out


def _by_depth(spec: ModelSpec) -> bool:
    # a homogeneous transformers stack, or a model factory (its layers checked in factory_layers_differ)
    return spec.factory is not None or (spec.is_hf and spec.homogeneous())


def _extrapolated(spec: ModelSpec, step: StepSpec, extrapolate: bool | str) -> tuple[MemoryEstimate | None, str]:
    # (the extrapolated estimate, "") or (None, why every layer is traced)
    if not extrapolate:
        return None, "extrapolate=False"
    if not _by_depth(spec):
        return None, "layers that differ" if spec.is_hf else "no depth to extrapolate over"
    n = spec.layers()[1]
    if n < EXTRAPOLATE_MIN_LAYERS:
        return None, f"{n} layers, fewer than the {EXTRAPOLATE_MIN_LAYERS} extrapolation starts at (a full trace is cheap)"
    if spec.factory is not None:
        why = factory_layers_differ(spec)
        if why:
            return None, why
    d1, d2 = EXTRAPOLATION_DEPTHS
    # the first layer can differ in shape: then one deeper
    est = extrapolate_by_depth(lambda d: _trace_step()(spec.at_depth(d), step), n, ((d1, d2), (d2, d2 + 1)))
    if est is None:
        return None, (f"the traces at {d1}, {d2}, {2 * d2 - d1} (and {d2}, {d2 + 1}, {d2 + 2}) layers are not affine in "
                      f"the layer count")
    return est, ""


def extrapolated(spec: ModelSpec, step: StepSpec, extrapolate: bool | str) -> MemoryEstimate | None:
    """The estimator's extrapolation of a single-rank step where it applies (a homogeneous transformers
    stack, or a model factory whose modules grow by one layer's per unit of depth: :func:`factory_layers_differ`),
    else None (trace every layer).

    ``extrapolate``: "auto" and True (stacks of at least :data:`EXTRAPOLATE_MIN_LAYERS` layers: deeper than the
    traced depths, 3, 4 and 5) or False (never).
    """
    return _extrapolated(spec, step, extrapolate)[0]


# FSDP2's per-rank timeline is affine in the layer count only from 3 layers on (with 1 or 2 layers the
# units gathered at the backward peak differ: measured on Llama shapes), so a sharded stack is traced at
# 3 and 4 layers, checked against a trace at 5, and extrapolated; a mismatch traces the whole stack. A
# peak that moved to another moment of the same run of a phase only beyond 5 layers would go unseen:
# Llama-2-70B (batch 1 x 256, 8 ranks) extrapolated equals its 80-layer trace (tests/ch08/test_estimate_distributed.py).
FSDP_EXTRAPOLATION_DEPTHS = (3, 4, 5)


def _segments(est: MemoryEstimate) -> list[tuple[str, dict[str, int]]]:
    """Each run of consecutive events of one phase in the traced timeline: (phase, breakdown at its first
    maximum). The "other" phase occurs more than once in a step (before the forward pass; between backward
    and the optimizer step), and which of its runs holds its peak can change with the layer count, so the
    runs are extrapolated one by one."""
    out: list[list[Any]] = []
    best = -1
    for ev in est.tracker.timeline:
        if not out or out[-1][0] != ev.phase:
            out.append([ev.phase, None])
            best = -1
        if ev.total > best:
            best, out[-1][1] = ev.total, {k: int(ev.bytes.get(k, 0)) for k in CATEGORIES}
    return [(ph, bd) for ph, bd in out]


def extrapolated_fsdp(spec: ModelSpec, step: StepSpec, world_size: int) -> MemoryEstimate | None:
    """The FSDP2-sharded estimate of the whole stack from traces at 3 and 4 layers.

    Each run of one phase (:func:`_segments`) is extrapolated by layer count, when the same
    extrapolation to 5 layers equals the trace at 5 (every run's breakdown and the end state); else
    None (the caller traces every layer). ``spec`` is a homogeneous transformers stack deeper than 5
    layers, ``step`` one rank's; the caller creates the fake process group of ``world_size`` ranks.
    """
    if step.optimizer in ("adamw8bit", "paged-adamw32bit", "paged-adamw8bit"):  # state modelled beside the timeline
        return None
    t0 = time.perf_counter()
    d1, d2, d3 = FSDP_EXTRAPOLATION_DEPTHS
    traced = {d: _trace_step()(spec.at_depth(d), step, fsdp_world_size=world_size) for d in (d1, d2, d3)}
    segs = {d: _segments(est) for d, est in traced.items()}
    if len({tuple(ph for ph, _ in sg) for sg in segs.values()}) != 1:
        return None

    def runs_at(n: int) -> list[tuple[str, dict[str, int]]] | None:
        try:
            return [(ph, {k: a[k] + (b[k] - a[k]) * (n - d1) for k in CATEGORIES})
                    for (ph, a), (_, b) in zip(segs[d1], segs[d2])]
        except ArithmeticError:  # pragma: no cover - integer arithmetic
            return None

    check = affine_estimate(traced[d1], traced[d2], d1, d2, d3)
    if check is None or runs_at(d3) != segs[d3] or check.breakdown_end != traced[d3].breakdown_end:
        return None
    est = affine_estimate(traced[d1], traced[d2], d1, d2, spec.layers()[1])
    runs = runs_at(spec.layers()[1])
    if est is None or runs is None or any(sum(bd.values()) < 0 for _, bd in runs):
        return None
    phase_bd: dict[str, dict[str, int]] = {}
    peak, at_peak, peak_phase = -1, {}, ""
    for ph, bd in runs:  # in time order: each phase's first maximum, and the step's, as the tracker picks them
        total = sum(bd.values())
        if ph not in phase_bd or total > sum(phase_bd[ph].values()):
            phase_bd[ph] = bd
        if total > peak:
            peak, at_peak, peak_phase = total, bd, ph
    phases = {ph: sum(bd.values()) for ph, bd in phase_bd.items()}
    est.phase_breakdowns, est.phase_peaks = phase_bd, phases
    est.peak_bytes, est.breakdown, est.peak_phase = peak, dict(at_peak), peak_phase
    est.tracker = PhaseSummary(peak, peak_phase, phases)
    est.seconds = time.perf_counter() - t0
    est.notes.append(f"FSDP2 per-rank trace: the extrapolation from {d1} and {d2} layers equals the trace at {d3} "
                     f"layers (checked in this run)")
    return est


def estimate_one_rank(spec: ModelSpec, step: StepSpec, extrapolate: bool | str = "auto",
                      fsdp_world_size: int = 0) -> MemoryEstimate:
    """One rank's traced step, extrapolated by depth where that is exact (``extrapolate``: see
    :func:`extrapolated`); ``fsdp_world_size`` > 0 traces FSDP2 under the fake process group of that many ranks.
    A model given as a callable is extrapolated as a model factory or through its transformers config
    (:func:`callable_route`), else traced at full depth; its notes say which. With
    :func:`memlab.estimate.trace_cache.enable_disk_cache`, an extrapolated estimate is read from (or written
    to) the trace cache."""
    route, why = spec, "" if extrapolate else "extrapolate=False"
    if spec.fn is not None and extrapolate and step.attn_implementation in (None, "auto"):  # (another: refused)
        route, why = callable_route(spec, step)

    def noted(est: MemoryEstimate, why: str) -> MemoryEstimate:
        if spec.fn is not None:
            est.notes.append(route_note(spec, route, est, why))
        return est

    if fsdp_world_size:
        tracing_starts()
        if extrapolate and _by_depth(route) and route.layers()[1] > max(FSDP_EXTRAPOLATION_DEPTHS):
            why = factory_layers_differ(route) if route.factory is not None else ""
            est = extrapolated_fsdp(route, step, fsdp_world_size) if not why else None
            if est is not None:
                return noted(est, "")
            why = why or "the FSDP2 traces at 3, 4 and 5 layers are not affine in the layer count"
        return noted(_trace_step()(spec, step, fsdp_world_size=fsdp_world_size), why)
    path = trace_cache.cache_path(route, step, extrapolate)
    cached = trace_cache.read(path) if path is not None else None
    if cached is not None:
        return cached
    tracing_starts()
    if route is not spec or route.factory is not None or spec.fn is None:
        est, why = _extrapolated(route, step, extrapolate)
    else:
        est = None
    if est is None:
        return noted(_trace_step()(spec, step), why)
    noted(est, "")
    if path is not None and isinstance(est.tracker, PhaseSummary):  # a whole trace keeps its timeline in memory only
        trace_cache.write(path, est)
    return est
