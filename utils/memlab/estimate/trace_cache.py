"""The trace cache of the ``memlab estimate`` command: an extrapolated estimate (its numbers and notes; no
timeline) kept on disk, keyed by the model's config, the step, and everything outside them that changes a trace:
the source of the memlab modules a trace runs and the versions of torch, transformers, peft and bitsandbytes.

Off by default (a test that patches memlab's code must trace); the command line turns it on
(:func:`enable_disk_cache`), ``MEMLAB_CACHE_DIR=none`` turns it off. Nothing here imports torch: a preset's answer
read from the cache imports neither torch's tracing machinery nor transformers.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from memlab.core.cachefile import write_cache_file

if TYPE_CHECKING:  # pragma: no cover
    from memlab.estimate.model import ModelSpec
    from memlab.estimate.result import MemoryEstimate
    from memlab.estimate.step import StepSpec

_DISK_CACHE = [False]
_VERSIONS: list[str] = []
# memlab's modules a trace runs (the planner's list, and FSDP2's): edited code re-traces
_TRACED_SOURCES = ("estimate/*.py", "profiler/*.py", "core/*.py", "quant/*.py", "models/*.py", "checkpoint/*.py",
                   "attention/*.py", "offload/*.py", "loss/*.py", "distributed/*.py", "accounting.py", "config.py")
CACHE_NOTE = "read from the trace cache"


def enable_disk_cache(on: bool = True) -> None:
    """Let :func:`memlab.estimate.extrapolate.estimate_one_rank` keep extrapolated estimates on disk, in
    :func:`estimate_cache_dir` (the ``memlab estimate`` command turns it on: a repeated estimate, and the
    suggestions a run shares with the last, answer without tracing and without importing transformers)."""
    _DISK_CACHE[0] = bool(on)


@contextlib.contextmanager
def disk_cache(on: bool = True) -> Iterator[None]:
    """:func:`enable_disk_cache` for a ``with`` block only, the previous setting restored after it (the command
    turns the cache on for its own run, not for the rest of a process that called it, such as a test)."""
    before = _DISK_CACHE[0]
    enable_disk_cache(on)
    try:
        yield
    finally:
        _DISK_CACHE[0] = before


def estimate_cache_dir() -> Path | None:
    """``$MEMLAB_CACHE_DIR/estimates`` (None when ``MEMLAB_CACHE_DIR`` is ``none``: no disk cache), else
    ``$XDG_CACHE_HOME/memlab/traces/estimates``, else ``~/.cache/memlab/traces/estimates`` (beside the planner's)."""
    env = os.environ.get("MEMLAB_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "none", "off") else Path(env).expanduser() / "estimates"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memlab" / "traces" / "estimates"


def _versions() -> str:
    if not _VERSIONS:
        import importlib.metadata as md

        here = Path(__file__).resolve().parents[1]  # the memlab package
        h = hashlib.sha256()
        for f in sorted(f for pattern in _TRACED_SOURCES for f in here.glob(pattern)):
            h.update(str(f.relative_to(here)).encode() + b"\0" + f.read_bytes())
        vers = []
        for dist in ("torch", "transformers", "peft", "bitsandbytes"):
            try:
                vers.append(f"{dist} {md.version(dist)}")
            except md.PackageNotFoundError:
                vers.append(f"{dist} -")
        _VERSIONS.append(f"memlab src {h.hexdigest()[:20]} {' '.join(vers)}")
    return _VERSIONS[0]


def cache_path(spec: ModelSpec, step: StepSpec, extrapolate: bool | str) -> Path | None:
    if not _DISK_CACHE[0] or not extrapolate or step.step is not None:  # a step function of yours: not keyed
        return None
    d, key = estimate_cache_dir(), spec.cache_key()
    if d is None or key is None:
        return None
    return d / (hashlib.sha256(repr((key, repr(step), extrapolate, _versions())).encode()).hexdigest()[:32] + ".pkl")


def read(path: Path) -> MemoryEstimate | None:
    t0 = time.perf_counter()
    try:
        with open(path, "rb") as f:
            est = pickle.load(f)
    except Exception:  # noqa: BLE001  (missing, torn or stale: trace again)
        return None
    from memlab.estimate.result import MemoryEstimate

    if not isinstance(est, MemoryEstimate):
        return None
    traced_in = est.seconds
    est.seconds = time.perf_counter() - t0
    est.notes.append(f"{CACHE_NOTE} ({path.parent}; MEMLAB_CACHE_DIR=none turns it off): traced in {traced_in:.1f} s "
                     f"by this memlab source, torch and transformers")
    return est


def write(path: Path, est: MemoryEstimate) -> None:
    """Keep ``est`` in the cache at ``path`` (:func:`memlab.core.cachefile.write_cache_file`: atomic, silent on
    failure)."""
    write_cache_file(path, est)
