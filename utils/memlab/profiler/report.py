"""The tracker's results for people: a text table and a stacked-area plot of the timeline."""
from __future__ import annotations

from typing import Any, Sequence

from memlab.core.units import GiB, KiB, MiB, format_bytes
from memlab.core.validation import check_choice
from memlab.profiler.storage import CATEGORIES, PHASES

__all__ = ["format_report", "plot_timeline"]

#: one colour per category, in CATEGORIES order
CATEGORY_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")
_UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}


def format_report(tracker: Any, top: int = 5) -> str:
    """A text table of a :class:`~memlab.profiler.MemoryTracker`'s results (after or inside its
    block): categories at the peak and at the end, the peak's op, phase and module, the phase peaks
    and the ``top`` modules, the highest peaks first."""
    peak, end = tracker.breakdown("peak"), tracker.breakdown("end")
    w = max(len(c) for c in CATEGORIES) + 2
    lines = [f"{'category':<{w}}{'at peak':>14}{'at end':>14}"]
    for c in CATEGORIES:
        lines.append(f"{c:<{w}}{format_bytes(peak[c]):>14}{format_bytes(end[c]):>14}")
    lines.append(f"{'total':<{w}}{format_bytes(sum(peak.values())):>14}{format_bytes(sum(end.values())):>14}")
    mod = tracker.peak_module
    lines.append(
        f"peak {format_bytes(tracker.peak_bytes)} ({tracker.peak_bytes} B) at op {tracker.peak_event}, "
        f"phase {tracker.peak_phase}, module {'(root)' if mod == '' else mod or '(none)'}"
    )
    lines.append("phase peaks: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in tracker.phase_peaks().items()))
    mp = list(tracker.module_peaks.items())[:top]
    if mp:
        lines.append("top modules by peak while running:")
        for name, b in mp:
            lines.append(f"  {('(root)' if name == '' else name):<40}{format_bytes(b):>14}")
    return "\n".join(lines)


def _shade_phases(ax: Any, events: Sequence[tuple]) -> None:
    # shade each run of forward, backward and optimizer events, with the phase's name on top
    shades = {"forward": "#e8f0ff", "backward": "#fff0e0", "optimizer": "#e8ffe8"}
    start = events[0]
    for i in range(1, len(events) + 1):
        if i == len(events) or events[i][1] != start[1]:
            end_x = events[i][0] if i < len(events) else events[-1][0] + 1
            phase = PHASES[start[1]]
            if phase in shades:
                ax.axvspan(start[0], end_x, color=shades[phase], zorder=0)
                ax.text((start[0] + end_x) / 2, 1.0, phase, transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=8)
            if i < len(events):
                start = events[i]


def plot_timeline(events: Sequence[tuple], peak_event: int, peak_bytes: int, ax: Any = None,
                  title: str | None = None, unit: str = "MiB"):
    """Stacked-area timeline by category, phases shaded, the peak (``peak_bytes`` after op
    ``peak_event``) marked; returns the Axes.

    Args:
        events: the tracker's raw events ``(op index, phase index, bytes per category...)``.
        ax: a matplotlib Axes to draw on, or None for a new figure.
        unit: ``"B"``, ``"KiB"``, ``"MiB"`` or ``"GiB"``.

    Raises:
        ValueError: an unknown ``unit``.
        RuntimeError: no events (the tracker ran with ``timeline=False``).
    """
    import matplotlib.pyplot as plt

    div = _UNITS[check_choice("unit", unit, _UNITS)]
    if not events:
        raise RuntimeError("plot: the timeline is empty (was the tracker used with timeline=True?)")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    # a step plot: each event's state holds until the next event
    xs, ys = [], [[] for _ in CATEGORIES]
    for i, e in enumerate(events):
        nxt = events[i + 1][0] if i + 1 < len(events) else e[0] + 1
        for x in (e[0], nxt):
            xs.append(x)
            for k in range(len(CATEGORIES)):
                ys[k].append(e[2 + k] / div)
    ax.stackplot(xs, ys, labels=CATEGORIES, colors=CATEGORY_COLORS, alpha=0.85, linewidth=0)
    _shade_phases(ax, events)
    ax.axvline(peak_event, color="black", ls="--", lw=1)
    ax.annotate(f"peak {format_bytes(peak_bytes)}", (peak_event, peak_bytes / div), xytext=(5, -12),
                textcoords="offset points", fontsize=8)
    ax.set_xlabel("op index")
    ax.set_ylabel(f"live bytes ({unit})")
    ax.set_xlim(xs[0], xs[-1])
    ax.legend(loc="upper left", fontsize=8)
    if title:
        ax.set_title(title, pad=14)
    return ax
