"""The estimate: :class:`MemoryEstimate` (peak, breakdown, phases, extras, notes) and its table,
and :func:`resolve_gpu` (a card or a size -> usable bytes)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from memlab.core.units import GiB, format_bytes, parse_size
from memlab.core.vocab import CATEGORIES
from memlab.estimate.recipes import DTYPES, FRAGMENTATION_MARGIN


@dataclass
class MemoryEstimate:
    """Peak bytes of a training step and where they go.

    ``peak_bytes`` is the traced peak of live tensor storages (what ``MemoryTracker`` counts);
    ``breakdown`` its split over :data:`CATEGORIES`, ``breakdown_end`` the same at the end of the
    step. ``peak_phase`` is the phase that holds the peak ("forward", "backward", "optimizer") and
    ``phase_peaks`` the peak of each phase, so the effect of checkpointing stays visible when the
    optimizer step holds the peak. ``extras`` are bytes outside any tensor that the allocator
    still counts on the target (cuBLAS workspaces on CUDA): ``allocated_bytes = peak_bytes +
    sum(extras)`` is the estimate of ``torch.cuda.max_memory_allocated``; ``reserved_bytes`` replays
    the traced allocations through a model of the caching allocator (the stated fragmentation margin
    where there is no replay). ``fake`` says whether the step ran on fake tensors (an
    estimate) or real ones (a measurement); ``notes`` lists anything modelled rather than traced.
    ``host_bytes`` (with ``optimizer="offload-adamw"``, or ``offload_checkpoints`` on a CUDA target) is host
    memory the optimizer or the offloaded layer inputs keep, split in ``host_breakdown``; it is counted, not
    traced as device memory, and is not part of ``peak_bytes`` (the device's).
    """

    model: str
    n_params: int
    batch_size: int
    seq_len: int
    dtype: str
    optimizer: str
    checkpointing: bool
    peak_bytes: int
    breakdown: dict[str, int]
    breakdown_end: dict[str, int] = field(default_factory=dict)
    max_activation_bytes: int = 0
    largest_layer_params: int = 0
    device: str = "cpu"
    traced_on: str = "cpu"
    fake: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    tracker: Any = field(default=None, repr=False, compare=False)
    peak_phase: str = ""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    extras: dict[str, int] = field(default_factory=dict)
    attention: str = ""
    step: str = ""
    optimizer_impl: str = ""
    extrapolated_from: tuple[int, ...] = ()
    phase_breakdowns: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    host_bytes: int = 0
    host_breakdown: dict[str, int] = field(default_factory=dict)
    world_size: int = 1
    zero_stage: int = 0
    adapter: str = ""  # memlab.estimate.adapters.AdapterSpec.describe() of a LoRA/QLoRA estimate, "" for a full fine-tune
    loss: str = ""  # the loss traced: "hf", "memlab", "chunked", "fused" ("step": your step function)
    offload_checkpoints: bool = False  # the inputs of the checkpointed layers kept on the host
    optimizer_in_backward: bool = False  # each parameter stepped in backward, its gradient freed at once
    # a CUDA target's max_memory_reserved from the traced allocations replayed through the caching allocator's model
    # (memlab.estimate.allocator_replay), and reserved minus allocated at the allocated peak there; 0: no replay
    reserved_replay_bytes: int = 0
    fragmentation_bytes: int = 0
    # a paged bitsandbytes AdamW's moments in CUDA unified memory: outside PyTorch's allocator, so in neither
    # allocated_bytes nor reserved_bytes (memlab.estimate.optim.paged_state_bytes)
    paged_bytes: int = 0

    @property
    def allocated_bytes(self) -> int:
        """``peak_bytes`` plus the stated extras: the estimate of ``max_memory_allocated``."""
        return self.peak_bytes + sum(self.extras.values())

    @property
    def reserved_bytes(self) -> int:
        """The estimate of ``max_memory_reserved`` on CUDA targets: the caching allocator's replay of the traced
        allocations (``reserved_replay_bytes``) where there is one, else ``allocated_bytes`` times the stated
        fragmentation margin; ``allocated_bytes`` elsewhere."""
        if _device_type(self.device) != "cuda":
            return self.allocated_bytes
        if self.reserved_replay_bytes:
            return max(self.reserved_replay_bytes, self.allocated_bytes)
        return int(math.ceil(self.allocated_bytes * FRAGMENTATION_MARGIN))

    @property
    def nvidia_smi_bytes(self) -> int:
        """What nvidia-smi would show on a CUDA target: ``reserved_bytes`` plus the CUDA context
        (:data:`memlab.core.gpus.CONTEXT_RESERVE_BYTES`, :data:`memlab.core.gpus.CONTEXT_RESERVE_SOURCE`)."""
        from memlab.core.gpus import CONTEXT_RESERVE_BYTES

        return self.reserved_bytes + (CONTEXT_RESERVE_BYTES if _device_type(self.device) == "cuda" else 0)

    def _budget(self, gpu: Any) -> int:
        return resolve_gpu(gpu)[1] if _device_type(self.device) == "cuda" else parse_size(gpu)

    def fits(self, gpu: int | str) -> bool:
        """Whether the step fits ``gpu``.

        On a CUDA target the comparison is honest: ``reserved_bytes`` (tensors + cuBLAS
        workspaces, replayed through the caching-allocator model) against the card's memory minus the stated CUDA
        context reserve. On a CPU target, ``peak_bytes`` against ``gpu`` bytes as given.

        Args:
            gpu: a card name (``"h100-80gb"``, :mod:`memlab.core.gpus`) or a memory (``"24GiB"``,
                ``"24GB"``, an int of bytes).
        """
        need = self.reserved_bytes if _device_type(self.device) == "cuda" else self.peak_bytes
        return need <= self._budget(gpu)

    def headroom(self, gpu: int | str) -> int:
        """Budget minus what :meth:`fits` compares: the bytes to spare (negative when it does not fit)."""
        need = self.reserved_bytes if _device_type(self.device) == "cuda" else self.peak_bytes
        return self._budget(gpu) - need

    def describe(self) -> str:
        """One line: the model, the step's settings, and whether it is an estimate or a measurement."""
        kind = "estimate (fake tensors)" if self.fake else "measured"
        ck = ", gradient checkpointing" if self.checkpointing else ""
        ck += " (inputs offloaded)" if self.offload_checkpoints else ""
        ck += ", optimizer in backward" if self.optimizer_in_backward else ""
        ck += f", {self.loss} loss" if self.loss in ("chunked", "fused") else ""
        impl = f" ({self.optimizer_impl})" if self.optimizer_impl and self.optimizer in ("adamw", "sgd", "offload-adamw") else ""
        return (
            f"{self.model} ({_params(self.n_params)} params): batch {self.batch_size} x seq "
            f"{self.seq_len}, {self.dtype}, {self.optimizer}{impl}{ck}{self._ranks()}"
            f"{'; ' + self.adapter if self.adapter else ''} -- {kind} on {self.traced_on} "
            f"for {self.device}"
        )

    def _ranks(self) -> str:
        if self.world_size == 1 and self.zero_stage == 0:
            return ""
        return f", ZeRO stage {self.zero_stage}, per rank of {self.world_size} (batch per rank)"

    def table(self) -> str:
        """The peak and its breakdown (and the end-of-step state) as a plain-text table, with the notes."""
        rows = [("category", "at peak", "share", "end of step")]
        for key in CATEGORIES:
            at = self.breakdown.get(key, 0)
            share = f"{100 * at / self.peak_bytes:.1f}%" if self.peak_bytes else "-"
            rows.append((key, format_bytes(at), share, format_bytes(self.breakdown_end.get(key, 0))))
        rows.append(("total", format_bytes(self.peak_bytes), "100.0%",
                     format_bytes(sum(self.breakdown_end.values()))))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [self.describe(), f"recipe {self.dtype}: {DTYPES.get(self.dtype, '')}"]
        if self.step:
            lines.append(f"step: {self.step}")
        if self.attention:
            lines.append(f"attention: {self.attention}")
        lines.append("")
        for j, r in enumerate(rows):
            if j == len(rows) - 1:
                lines.append("  ".join("-" * w for w in widths))
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append(f"peak: {self.peak_bytes:,} bytes of tensors, in the {self.peak_phase or '?'} phase")
        if self.phase_peaks:
            lines.append("phase peaks: " + ", ".join(
                f"{p} {format_bytes(v)}" for p, v in self.phase_peaks.items() if p in ("forward", "backward", "optimizer")))
        if self.peak_phase == "optimizer":
            fb = max(self.phase_peaks.get("forward", 0), self.phase_peaks.get("backward", 0))
            lines.append(f"the optimizer step holds the peak: the activations are freed by then, so checkpointing "
                         f"or a shorter sequence lowers only the forward/backward peak ({format_bytes(fb)})")
        if self.host_breakdown and self.optimizer == "offload-adamw":
            lines.append("device: traced (params in their dtype, grads, activations; the CPU step writes the params "
                         "in place and allocates nothing on the device)")
        if self.host_breakdown:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host_breakdown.items())
            lines.append(f"host: {format_bytes(self.host_bytes)} counted, not traced ({parts}); "
                         f"not in the device peak")
        for label, b in self.extras.items():
            lines.append(f"+ {label}: {format_bytes(b)}")
        if self.extras:
            lines.append(f"allocated (max_memory_allocated): {format_bytes(self.allocated_bytes)}")
        if _device_type(self.device) == "cuda":
            from memlab.core.gpus import CONTEXT_RESERVE_BYTES

            how = (f"the caching allocator's model, {format_bytes(self.fragmentation_bytes)} cached at the allocated peak"
                   if self.reserved_replay_bytes else
                   f"allocated x {FRAGMENTATION_MARGIN}, allocator fragmentation measured on an H100")
            lines.append(f"reserved (max_memory_reserved; {how}): {format_bytes(self.reserved_bytes)}")
            lines.append(f"nvidia-smi (reserved + {format_bytes(CONTEXT_RESERVE_BYTES)} CUDA context): "
                         f"{format_bytes(self.nvidia_smi_bytes)}")
        if self.paged_bytes:
            lines.append(f"paged optimizer state (CUDA unified memory, outside allocated and reserved): "
                         f"{format_bytes(self.paged_bytes)}")
        if self.extrapolated_from:
            a, b = self.extrapolated_from
            lines.append(f"traced at {a}, {b} and {2 * b - a} decoder layers, extrapolated exactly by layer count "
                         f"(extrapolate=False traces all of them)")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def plot(self, **kwargs: Any):
        """The tracker's timeline plot (:meth:`memlab.profiler.MemoryTracker.plot`, given ``kwargs``).

        Raises:
            ValueError: for an extrapolated or modelled estimate (no timeline).
        """
        if self.tracker is None or not hasattr(self.tracker, "plot"):
            raise ValueError("this MemoryEstimate has no timeline (extrapolated or modelled): "
                             "estimate with extrapolate=False to plot it")
        return self.tracker.plot(**kwargs)


class PhaseSummary:
    """``MemoryEstimate.tracker`` of an extrapolated or sharded estimate, which has no timeline: the peak,
    its phase and the per-phase peaks (the attributes of MemoryTracker that a reader of an estimate uses)."""

    def __init__(self, peak_bytes: int, peak_phase: str, phase_peaks: dict[str, int]) -> None:
        self.peak_bytes = peak_bytes
        self.peak_phase = peak_phase
        self._phase_peaks = dict(phase_peaks)

    def phase_peaks(self) -> dict[str, int]:
        return dict(self._phase_peaks)

    def __repr__(self) -> str:
        return f"PhaseSummary(peak={format_bytes(self.peak_bytes)}, phase={self.peak_phase})"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**8 else f"{n / 1e6:.2f}M"


def resolve_gpu(gpu: Any) -> tuple[str, int]:
    """(label, usable bytes) of ``--gpu``: a card name of :mod:`memlab.core.gpus` or a size.

    A card: its total as the driver reports it, minus the stated CUDA context reserve. A size
    (``24GiB`` = 24 x 2**30; ``24GB`` = 24 x 10**9, shown in GiB): that memory minus the same
    reserve.

    Raises:
        ValueError: a bare number under 1 GiB such as ``0.4`` or an unknown name, naming what is allowed.
    """
    from memlab.core import gpus

    card = gpus.find_gpu(gpu) if isinstance(gpu, str) else None
    if card is not None:
        total = card.total_bytes
        label = f"{card.name}: {format_bytes(total)} as the driver reports it"
    else:
        try:
            total = parse_size(gpu)
        except ValueError:
            raise ValueError(
                f"gpu={gpu!r} is invalid{gpus.suggest(gpu) if isinstance(gpu, str) else ''}; allowed: a card "
                f"({', '.join(gpus.gpu_names())}) or a size such as 24GiB or 24GB"
            ) from None
        if total < GiB:
            raise ValueError(f"gpu={gpu!r} is {total:,} bytes, less than 1 GiB; allowed: a card "
                             f"({', '.join(gpus.gpu_names())}) or a size with a unit, such as 24GiB or 80GB")
        label = f"{format_bytes(total)}"
        if isinstance(gpu, str) and re.search(r"[0-9.]\s*[kmgt]b\s*$", gpu.strip().lower()):
            label += f" ({gpu.strip()}, decimal units)"
    usable = total - gpus.CONTEXT_RESERVE_BYTES
    return f"{label} - CUDA context {format_bytes(gpus.CONTEXT_RESERVE_BYTES)} = {format_bytes(usable)} usable", usable


def _device_type(device: str) -> str:
    """``torch.device(device).type`` of a device string ("cuda:1" -> "cuda"), without importing torch."""
    return str(device).split(":", 1)[0]
