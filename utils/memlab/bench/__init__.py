"""``memlab bench NAME``: each chapter's from-scratch code against the production reference.

A benchmark is a module ``memlab.bench.<name>`` with a ``main(argv) -> int``. The helpers here
keep every table alike: warm-up runs, CUDA synchronisation before reading the clock, the variants
of one comparison timed in turns, round by round, with medians (:func:`interleaved_medians`: a busy
moment of a shared machine slows every variant alike), ratios against the reference measured in
the same run, the device named in the header, and one verdict line per target
(:func:`report_targets`: ``TARGET MET: ...`` / ``TARGET MISSED: ...``; with ``--strict``, added by
:func:`add_strict`, a missed target makes the exit code 1).
"""
from __future__ import annotations

import importlib
import pkgutil
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from memlab.core.validation import check_int, check_positive_int


def available() -> list[str]:
    """The names of the ``memlab.bench`` submodules (the benchmarks there are), sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def device_name(device: torch.device | str | None = None) -> str:
    """The device in words, for a table's header (timings mean nothing without it): the GPU's name, or
    the CPU's architecture, core count and torch thread count. ``device`` None is ``memlab.config.DEVICE``.
    """
    from memlab.config import DEVICE

    device = torch.device(device) if device is not None else DEVICE
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    import os
    import platform

    return f"CPU {platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU's queued work, so a clock read after it measures the work (CUDA is asynchronous);
    nothing is done for a CPU ``device`` or without CUDA.
    """
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_median(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1, device: Any = None) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls.

    Args:
        repeat: timed calls (>= 1); the median is robust to one slow call on a shared machine.
        warmup: untimed calls first (caches, lazy initialisation, kernel selection).
        device: the device to synchronise before reading the clock.

    Raises:
        ValueError: for a ``repeat`` below 1.
    """
    check_positive_int("repeat", repeat)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeat: int, device: Any = None, *,
                        warmup: int = 0) -> dict[str, float]:
    """The median seconds of each function, timed in turns: round ``r`` calls every function once, in
    order, so a busy moment of a shared machine slows every variant alike (timing one variant after
    another lands a load drift on one of them).

    Args:
        fns: name -> the call to time.
        repeat: rounds (>= 1).
        device: the device to synchronise before reading the clock.
        warmup: untimed rounds first (>= 0).

    Raises:
        ValueError: for a ``repeat`` below 1 or a negative ``warmup``.
    """
    check_positive_int("repeat", repeat)
    check_int("warmup", warmup, minimum=0)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], device: Any = None) -> str:
    """A plain-text table, ``title`` on the first line and the device named on the second; floats and
    large ints in ``rows`` are formatted, anything else is ``str()``-ed.
    """
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = [title, f"device: {device_name(device)}; torch {torch.__version__}", ""]
    for j, r in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def verdict(text: str, holds: bool, ratio: float | None = None) -> str:
    """One target's line, the same in every bench: ``TARGET MET: text (ratio 0.812)`` or
    ``TARGET MISSED: ...`` (the ratio left out when None)."""
    shown = "" if ratio is None else f" (ratio {ratio:.3f})"
    return f"{'TARGET MET' if holds else 'TARGET MISSED'}: {text}{shown}"


def report_targets(checks: Sequence[tuple[str, float | None, bool]], device: Any = None, *,
                   strict: bool = False) -> int:
    """Print ``(text, ratio, holds)`` targets as :func:`verdict` lines under the device's name; return the
    exit code: 1 when a target is missed and ``strict``, else 0 (timings on a shared machine are noisy:
    without ``--strict`` a miss is reported, not failed).
    """
    if checks:
        print()
        print(f"targets ({device_name(device)}):")
        for text, ratio, ok in checks:
            print(verdict(text, ok, ratio))
    missed = sum(not ok for _, _, ok in checks)
    if missed:
        print(f"{missed} target(s) missed; timings on a shared machine are noisy: rerun with more --repeat"
              f"{'' if strict else ' (exit code 0 without --strict)'}")
    return 1 if (missed and strict) else 0


def load_average() -> str:
    """The 1, 5 and 15-minute load averages (``"0.8 1.2 2.7"``), or ``"unknown"`` where the platform has none: a
    timing taken on a busy machine says so beside it."""
    import os

    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - no load average on this platform
        return "unknown"


def progress(line: str) -> None:
    """One measured row as soon as it is measured, on stderr (the tables on stdout stay as they are): a bench
    stopped at a time limit, as on a short GPU lease, still leaves what it measured. (On an H200, 2026-11-28,
    ``bench loss`` and ``bench offload`` ran into their 75 and 90 s limits and left nothing of their GPU runs.)"""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def add_strict(parser: Any) -> None:
    """Give an ``argparse`` parser the common ``--strict`` flag (exit 1 when a target is missed)."""
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    if isinstance(x, int) and abs(x) >= 10_000:
        return f"{x:,}"
    return str(x)


def main(argv: list[str] | None = None) -> int:
    """``memlab bench NAME [options]``: run one benchmark, or list them; the benchmark's exit code, 0 for the
    list, 2 for an unknown name.
    """
    argv = list(argv or [])
    names = available()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: memlab bench NAME [options]   (memlab bench NAME --help)")
        print("benchmarks: " + (", ".join(names) or "none yet"))
        return 0
    name = argv[0]
    if name not in names:
        print(f"memlab bench: NAME={name!r} is invalid; allowed: {', '.join(names) or 'none yet'}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"memlab.bench.{name}")
    return int(mod.main(argv[1:]) or 0)
