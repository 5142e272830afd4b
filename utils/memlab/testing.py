"""Memory regression tests that run on a CPU: :func:`assert_peak` and a baseline file (:class:`MemoryBaseline`).

A training step traced on fake tensors (:func:`memlab.estimate.estimate_training_memory`) costs seconds on any
CPU and gives the peak to the byte for what PyTorch and ``transformers`` really allocate, so a CI runner with no
GPU can fail a change that raises the peak (a checkpointing flag dropped, a bigger batch, a loss that keeps its
logits)::

    from memlab.testing import assert_peak, MemoryBaseline

    def test_step_fits():
        assert_peak(config, batch_size=8, seq_len=2048, checkpointing=True, at_most="20GiB", gpu="a100-40gb")

    def test_no_memory_regression():
        MemoryBaseline("tests/memory_baseline.json").compare("llama-step", config, batch_size=8, seq_len=2048)

``MEMLAB_BASELINE=record pytest ...`` (or :meth:`MemoryBaseline.record`) writes the figures instead of comparing.
A failure names the category that grew, the module that ran at the peak (and the one whose peak grew most), the
ATen op that set the peak, and the breakdown before and after.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from memlab.core.units import format_bytes, parse_size
from memlab.core.validation import check_number, invalid
from memlab.core.vocab import CATEGORIES

__all__ = ["PeakRecord", "PeakDiff", "MemoryBaseline", "assert_peak", "peak_record", "record", "compare"]

#: the environment variable that turns :meth:`MemoryBaseline.compare` into :meth:`MemoryBaseline.record`
RECORD_ENV = "MEMLAB_BASELINE"
_TOP_MODULES = 12  # module peaks kept in a record


@dataclass
class PeakRecord:
    """What a baseline keeps of one step: the compared figure and where the peak comes from.

    ``bytes`` is the figure compared: ``reserved_bytes`` (what :meth:`memlab.estimate.MemoryEstimate.fits`
    compares on a CUDA target) when a card was given, else ``peak_bytes`` (the traced tensors, exact to the byte).
    ``op`` is the ATen op after which the traced peak was reached, ``module`` the innermost module running then
    ("<the model>" outside every submodule, "-" outside the model).
    """

    setting: str
    bytes: int
    peak_bytes: int
    breakdown: dict[str, int]
    phase: str
    module: str
    op: str
    module_peaks: dict[str, int] = field(default_factory=dict)
    note: str = ""  # where module and op come from when the estimate was extrapolated by depth

    def table(self) -> str:
        """The breakdown at the peak, one category a line."""
        return "\n".join(f"  {k:<12}{format_bytes(self.breakdown.get(k, 0)):>12}" for k in CATEGORIES)


@dataclass
class PeakDiff:
    """A record against its baseline: ``grew`` is True when ``after.bytes`` passes ``before.bytes`` by more than
    the tolerance; ``category``, ``module`` and ``op`` say what grew most (the category whose bytes at the peak
    rose most, the module whose peak rose most, the op at the new peak)."""

    name: str
    before: PeakRecord
    after: PeakRecord
    tolerance: float
    grew: bool
    category: str
    module: str
    op: str

    @property
    def change(self) -> float:
        """``after.bytes / before.bytes - 1``."""
        return self.after.bytes / max(self.before.bytes, 1) - 1

    def message(self) -> str:
        """The failure message: what grew, and the breakdown before and after."""
        b, a = self.before, self.after
        lines = [f"memory regression in {self.name!r}: {format_bytes(b.bytes)} -> {format_bytes(a.bytes)} "
                 f"({100 * self.change:+.1f}%, tolerance {100 * self.tolerance:.1f}%)",
                 f"grew most: category {self.category!r} "
                 f"({format_bytes(b.breakdown.get(self.category, 0))} -> "
                 f"{format_bytes(a.breakdown.get(self.category, 0))}), module {self.module!r}, "
                 f"op at the peak {self.op!r}",
                 f"peak before: {b.phase} phase, module {b.module!r}, op {b.op!r}",
                 f"peak after:  {a.phase} phase, module {a.module!r}, op {a.op!r}"]
        lines += [f"note: {n}" for n in dict.fromkeys((b.note, a.note)) if n]
        if a.setting != b.setting:
            lines.append(f"settings differ: before {b.setting!r}; after {a.setting!r}")
        lines.append(f"  {'category':<12}{'before':>12}{'after':>12}")
        for k in CATEGORIES:
            x, y = b.breakdown.get(k, 0), a.breakdown.get(k, 0)
            lines.append(f"  {k:<12}{format_bytes(x):>12}{format_bytes(y):>12}{'  <-' if k == self.category else ''}")
        return "\n".join(lines)


@contextlib.contextmanager
def _naming_the_peak_op(made: list[Any]) -> Iterator[None]:
    """While inside, every tracker the estimator makes (appended to ``made``) also notes, as ``peak_op``, the ATen
    op that last raised its peak. The estimator builds its trackers in
    :func:`memlab.estimate.attention.make_tracker`; their class is extended here, not their counts."""
    from memlab.estimate import trace

    original = trace.make_tracker

    def make_tracker(*args: Any, **kwargs: Any) -> Any:
        tracker = original(*args, **kwargs)

        class _Naming(type(tracker)):  # type: ignore[misc]
            peak_op = "-"

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                before = self.peak_bytes
                out = super().__torch_dispatch__(func, types, args, kwargs)
                if self.peak_bytes > before:
                    self.peak_op = str(getattr(func, "overloadpacket", func)).replace("aten.", "")
                return out

        tracker.__class__ = _Naming
        made.append(tracker)
        return tracker

    trace.make_tracker = make_tracker
    try:
        yield
    finally:
        trace.make_tracker = original


def _estimate(model: Any, step: Any, overrides: dict[str, Any]) -> tuple[Any, Any]:
    """The estimate and the tracker of its largest trace (the estimate's own; the deepest one when it was
    extrapolated by depth, whose module names are then those of the traced depth)."""
    from memlab.estimate import estimate_training_memory

    made: list[Any] = []
    with _naming_the_peak_op(made):
        est = estimate_training_memory(model, step, **overrides)
    return est, max(made, key=lambda t: t.peak_bytes, default=None)


def _module_name(module: str | None) -> str:
    return "-" if module is None else (module or "<the model>")


def peak_record(model: Any, step: Any = None, **overrides: Any) -> tuple[PeakRecord, Any]:
    """Trace one step of ``model`` (as :func:`memlab.estimate.estimate_training_memory` takes it: a preset, a
    config, a config.json, a callable) and return its :class:`PeakRecord` and the estimate.

    ``step``: a :class:`memlab.estimate.StepSpec`, or the training step itself (a ``step(model, batch) -> loss``
    function or a loss name, :class:`~memlab.estimate.StepSpec`'s ``step`` field), or None. ``gpu=`` (a card) makes
    the target CUDA (``device="cuda"``) unless ``device`` is given, and the compared figure its reserved memory.
    """
    from memlab.estimate import StepSpec

    if step is not None and not isinstance(step, StepSpec):  # the step function (or loss name), not the settings
        step, overrides = None, {**overrides, "step": step}
    if overrides.get("gpu") is not None:
        overrides.setdefault("device", "cuda")
    card = overrides.get("gpu") is not None
    est, tracker = _estimate(model, step, overrides)
    module = tracker.peak_module if tracker is not None else None
    op = tracker.peak_op if tracker is not None else "-"
    peaks = dict(sorted(tracker.module_peaks.items(), key=lambda kv: -kv[1])[:_TOP_MODULES]) if tracker else {}
    rec = PeakRecord(setting=est.describe(), bytes=int(est.reserved_bytes if card else est.peak_bytes),
                     peak_bytes=int(est.peak_bytes),
                     breakdown={k: int(est.breakdown.get(k, 0)) for k in CATEGORIES}, phase=est.peak_phase,
                     module=_module_name(module), op=op,
                     module_peaks={_module_name(k): int(v) for k, v in peaks.items()})
    if est.extrapolated_from and tracker is not None:
        depth = 2 * est.extrapolated_from[1] - est.extrapolated_from[0]
        rec.note = f"extrapolated by depth; module and op from the deepest trace ({depth} layers)"
        if tracker.peak_phase != est.peak_phase:  # that trace's peak is another phase's: it does not name this one
            rec.note = (f"extrapolated by depth: the deepest trace ({depth} layers) peaks in the {tracker.peak_phase} "
                        f"phase (module {rec.module!r}, op {rec.op!r}), not at this peak; extrapolate=False traces "
                        f"every layer")
            rec.module = rec.op = "-"
    return rec, est


def assert_peak(model: Any, step: Any = None, *, at_most: int | str | None = None, gpu: Any = None,
                **overrides: Any) -> Any:
    """Fail (AssertionError) unless one traced training step of ``model`` stays within ``at_most``.

    Args:
        model: a preset name, a transformers config, a config.json path or a callable building an ``nn.Module``.
        step: a :class:`memlab.estimate.StepSpec`, or None to build one from ``overrides`` (``batch_size``,
            ``seq_len``, ``checkpointing``, ``dtype``, ``optimizer``, ...); or the training step itself, a
            ``step(model, batch) -> loss`` function (the StepSpec's ``step`` field).
        at_most: a size (``"20GiB"``, ``"18GB"``, bytes); with ``gpu`` it may be left out: the card's usable memory.
        gpu: a card (``"a100-40gb"``, :mod:`memlab.core.gpus`): the step is traced for CUDA and the compared figure
            is its reserved memory (what ``max_memory_reserved`` would show), as :meth:`MemoryEstimate.fits` does.

    Returns:
        The :class:`memlab.estimate.MemoryEstimate`, for further asserts.

    Raises:
        AssertionError: the figure passes ``at_most``; the message holds the breakdown, the phase, the module
            and the op at the peak.
        ValueError: neither ``at_most`` nor ``gpu``, or a bad size.
    """
    if at_most is None and gpu is None:
        raise invalid("at_most", at_most, "a size such as '20GiB' or bytes, or a card given as gpu=")
    if gpu is not None:
        overrides["gpu"] = gpu
    rec, est = peak_record(model, step, **overrides)
    if at_most is None:
        from memlab.estimate import resolve_gpu

        limit, what = resolve_gpu(gpu)[1], f"the usable memory of {gpu}"
    else:
        limit, what = parse_size(at_most, name="at_most"), f"at_most={at_most!r}"
    if rec.bytes > limit:
        figure = "reserved" if gpu is not None else "peak"
        raise AssertionError(
            f"{figure} {format_bytes(rec.bytes)} ({rec.bytes:,} bytes) exceeds {what} ({format_bytes(limit)}) by "
            f"{format_bytes(rec.bytes - limit)}\n{rec.setting}\npeak in the {rec.phase} phase, module {rec.module!r}, "
            f"op {rec.op!r}{'; ' + rec.note if rec.note else ''}\n{rec.table()}")
    return est


def _biggest_rise(before: dict[str, int], after: dict[str, int]) -> str:
    """The key whose value rose most (on a tie the deepest module name); "-" when nothing rose."""
    rises = [(after.get(k, 0) - before.get(k, 0), k.count("."), k) for k in set(before) | set(after)]
    best = max(rises, default=(0, 0, "-"))
    return best[2] if best[0] > 0 else "-"


def diff(name: str, before: PeakRecord, after: PeakRecord, tolerance: float) -> PeakDiff:
    """``after`` against ``before``: a :class:`PeakDiff`."""
    grew = after.bytes > before.bytes * (1 + tolerance)
    inner = [{k: v for k, v in r.module_peaks.items() if k != "<the model>"} for r in (before, after)]
    module = _biggest_rise(*inner)  # the model's own peak is the total's: a submodule says more
    if module == "-":
        module = after.module
    return PeakDiff(name=name, before=before, after=after, tolerance=tolerance, grew=grew,
                    category=_biggest_rise(before.breakdown, after.breakdown), module=module, op=after.op)


class MemoryBaseline:
    """A JSON file of :class:`PeakRecord`\\ s by name, for memory regression tests.

    Args:
        path: the file (created by :meth:`record`).
        tolerance: the relative growth :meth:`compare` allows (0.01: one percent).
        mode: "compare" or "record"; None reads the environment variable ``MEMLAB_BASELINE`` (``record`` records,
            anything else compares).
    """

    def __init__(self, path: str | os.PathLike, tolerance: float = 0.01, mode: str | None = None) -> None:
        self.path = Path(path)
        self.tolerance = check_number("tolerance", tolerance, minimum=0.0)
        if mode is None:
            mode = "record" if os.environ.get(RECORD_ENV, "") == "record" else "compare"
        if mode not in ("compare", "record"):
            raise invalid("mode", mode, "'compare', 'record' or None (the MEMLAB_BASELINE variable)")
        self.mode = mode

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.path}: not a memlab baseline (JSON of records by name): {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: not a memlab baseline (a JSON object of records by name)")
        return data

    def records(self) -> dict[str, PeakRecord]:
        """Every record in the file, by name."""
        return {k: PeakRecord(**v) for k, v in self._load().items()}

    def record(self, name: str, model: Any, step: Any = None, **overrides: Any) -> PeakRecord:
        """Trace the step and write its record under ``name`` (other names are kept)."""
        rec, _ = peak_record(model, step, **overrides)
        data = self._load()
        data[name] = asdict(rec)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return rec

    def compare(self, name: str, model: Any, step: Any = None, **overrides: Any) -> PeakDiff:
        """Trace the step and fail (AssertionError) when its figure passes the recorded one by more than the
        tolerance; in record mode, :meth:`record` instead. Returns the :class:`PeakDiff` (``grew`` False).

        Raises:
            AssertionError: a regression (:meth:`PeakDiff.message`), or no record of ``name`` in the file.
        """
        if self.mode == "record":
            rec = self.record(name, model, step, **overrides)
            return diff(name, rec, rec, self.tolerance)
        recorded = self.records()
        if name not in recorded:
            raise AssertionError(f"{self.path}: no baseline named {name!r} (have: {sorted(recorded) or 'none'}); "
                                 f"record it with {RECORD_ENV}=record or MemoryBaseline(...).record({name!r}, ...)")
        rec, _ = peak_record(model, step, **overrides)
        d = diff(name, recorded[name], rec, self.tolerance)
        if d.grew:
            raise AssertionError(d.message())
        return d


def record(path: str | os.PathLike, name: str, model: Any, step: Any = None, **overrides: Any) -> PeakRecord:
    """``MemoryBaseline(path).record(name, model, step, **overrides)``."""
    return MemoryBaseline(path, mode="record").record(name, model, step, **overrides)


def compare(path: str | os.PathLike, name: str, model: Any, step: Any = None, *, tolerance: float = 0.01,
            **overrides: Any) -> PeakDiff:
    """``MemoryBaseline(path, tolerance).compare(name, model, step, **overrides)`` (record mode from the
    environment, as there)."""
    return MemoryBaseline(path, tolerance).compare(name, model, step, **overrides)
