"""What a forked child of memlab does first, and the one way memlab splits traces between two processes.

The estimate's suggestions, the estimate's depth traces and the planner's look-ahead trace in a child made by
``fork`` (it starts with the parent's imports and warm state). A thread pool does not survive ``fork``: when the
parent has run an op on torch's intra-op pool (OpenMP, libgomp on Linux builds), the child's next parallel region
waits for threads that no longer exist and never returns (measured on this course's CPU machine: a 2000 x 2000
matmul and an ``exp`` over 10**7 values after fork hung; with one thread set first, 0.24 s). PyTorch's DataLoader
workers set one thread for the same reason. The child here traces on fake tensors, where one thread costs nothing.

:func:`in_two` runs items (the suggestion rows, the depths of one estimate) in this process and one forked child at
once, each its own list first, then what is left of the other's (the two end close together whatever each costs); :func:`spare_cpu` says whether a second process may be started here now (two
CPUs or more, ``fork``, and no memlab child already tracing beside this one: a child forks no grandchild).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterable

_IN_CHILD = False  # this process is a forked child of memlab (single_threaded_child ran)
_HELPERS = 0  # forked children of this process tracing now (in_two)
_BEFORE_TRACING: list[Callable[[], None]] = []  # see before_first_trace


@contextlib.contextmanager
def before_first_trace(callback: Callable[[], None]):
    """Within the block, ``callback()`` runs once, when the estimator first finds that it has to trace (no trace
    cache entry: :func:`tracing_starts`, called by :func:`memlab.estimate.extrapolate.estimate_one_rank`), before
    it traces: the suggestions start their second process there, so that rows the trace cache holds are read in one
    process, and a first row that traces shares its time with the others."""
    _BEFORE_TRACING.append(callback)
    try:
        yield
    finally:
        if callback in _BEFORE_TRACING:
            _BEFORE_TRACING.remove(callback)


def tracing_starts() -> None:
    """The estimator is about to trace: the callbacks of :func:`before_first_trace`, each once."""
    while _BEFORE_TRACING:  # taken off first: a process forked by a callback does not run it again
        _BEFORE_TRACING.pop()()


class TracedTimeline:
    """A trace's tracker as it comes back from a forked child: what the extrapolation by depth reads of a tracker
    (the timeline, the peak, its phase, the phase peaks), picklable (a tracker holds the model and its optimizer)."""

    def __init__(self, tracker: Any) -> None:
        self.timeline = list(tracker.timeline)
        self.peak_bytes = tracker.peak_bytes
        self.peak_phase = tracker.peak_phase
        self._phase_peaks = dict(tracker.phase_peaks())

    def phase_peaks(self) -> dict[str, int]:
        return dict(self._phase_peaks)


def portable_estimate(est: Any) -> Any:
    """An estimate (a dataclass with a ``tracker``) ready to be pickled: a tracker with a timeline replaced by its
    :class:`TracedTimeline`."""
    import dataclasses

    return dataclasses.replace(est, tracker=TracedTimeline(est.tracker)) if hasattr(est.tracker, "timeline") else est


def single_threaded_child() -> None:
    """Call first in a forked child: torch's intra-op pool down to one thread (no parallel region waits for
    threads the fork left behind). Without torch imported, nothing to do. The process is marked as a child: it
    forks no helper of its own (:func:`spare_cpu` answers False)."""
    global _IN_CHILD
    _IN_CHILD = True
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _has_children() -> bool:
    # a child process of this one alive (or not yet reaped): the planner's look-ahead, a caller's own workers
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # pragma: no cover - no /proc: nothing known
        return False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                if f.read().strip():
                    return True
        except OSError:
            continue
    return False


def spare_cpu() -> bool:
    """Whether this process may fork a helper now: two CPUs or more to run on, ``fork`` available, only the main
    thread running (a fork copies no other thread), not a forked child of memlab, no helper of its own tracing,
    no other child process alive, and CUDA not initialised here: a child forked after it cannot use CUDA ("CUDA
    error: initialization error" at its first CUDA call, fake tensors' device queries included; seen on an H200,
    2026-11-28, when the CUDA estimate tests forked after the real step had run)."""
    import threading

    return (not _IN_CHILD and _HELPERS == 0 and hasattr(os, "fork") and cpus() >= 2
            and threading.active_count() == 1 and not _has_children() and not _cuda_initialised())


def _cuda_initialised() -> bool:
    # torch not imported yet: nothing initialised it
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _run(fn: Callable[[Any], Any], item: Any) -> Any:
    try:
        return fn(item)
    except Exception as exc:  # noqa: BLE001  (handed to the caller, who raises it in its own order)
        return exc


def _claims(n: int) -> list[int]:
    # one pipe per item holding one byte, its write end closed: the first read takes the byte (the item is
    # claimed), any later one finds the end of the pipe; atomic across the two processes, and no lock to hold
    fds = []
    for _ in range(n):
        r, w = os.pipe()
        os.write(w, b"x")
        os.close(w)
        fds.append(r)
    return fds


def _take(claims: list[int], order: list[int]) -> Iterable[int]:
    # the positions of ``order`` this process claims, in turn (an item the other took is skipped)
    for k in order:
        if os.read(claims[k], 1):
            yield k


def _child(fn: Callable[[Any], Any], items: list[Any], claims: list[int], order: list[int], write_fd: int,
           portable: Callable[[Any], Any]) -> None:
    # the forked child: its items, sent back pickled; exits without the parent's exit handlers
    import pickle

    code = 1
    try:
        single_threaded_child()  # the parent's thread pool did not survive the fork
        got = {}
        for k in _take(claims, order):
            r = _run(fn, items[k])
            got[items[k]] = r if isinstance(r, BaseException) else portable(r)
        try:
            data = pickle.dumps(got)
        except Exception:  # noqa: BLE001  (a result that does not pickle: the parent runs these items)
            data = pickle.dumps({})
        with os.fdopen(write_fd, "wb") as f:
            f.write(data)
        code = 0
    finally:
        os._exit(code)


class TwoProcesses:
    """Items of two lists run by this process and a forked child at once (:func:`in_two`), in two steps: made, it
    forks the child, which starts on ``theirs`` at once; :meth:`finish` runs ``mine`` here (then what is left of
    ``theirs``, from its end, or from its front with ``steal_from_front``) and collects the child's results. Between the two this process may finish other work
    (the first suggestion row, whose trace is what showed that tracing starts)."""

    def __init__(self, fn: Callable[[Any], Any], mine: list[Any], theirs: list[Any],
                 portable: Callable[[Any], Any] = lambda r: r, steal_from_front: bool = False) -> None:
        import warnings

        global _HELPERS
        self.fn, self.items = fn, list(mine) + list(theirs)
        if len(set(self.items)) != len(self.items) or len(self.items) > 128 or not (mine and theirs):
            raise ValueError(f"mine={mine!r}, theirs={theirs!r} is invalid; allowed: two lists of items, neither "
                             f"empty, at most 128 in all, all different")
        a, b = list(range(len(mine))), list(range(len(mine), len(self.items)))
        # the child's items taken by this process from the end of its list, or (steal_from_front) in its own order:
        # for a list in falling cost that this process joins late, the two then end on its cheapest items
        self.order = a + (b if steal_from_front else b[::-1])
        self.claims = _claims(len(self.items))
        read_fd, write_fd = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # the child must not write this process's buffered output again
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        with warnings.catch_warnings():  # (Python 3.12+ warns about fork with threads: the child runs only this one)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(fn, self.items, self.claims, b + a[::-1], write_fd, portable)
        os.close(write_fd)
        self.pid, self.read_fd = pid, read_fd
        _HELPERS += 1

    def finish(self) -> dict[Any, Any]:
        """``{item: fn(item), or the exception it raised}``: this process's items run now, the child's collected
        (those of a child that failed are left out: the caller runs them)."""
        import pickle

        global _HELPERS
        done: dict[Any, Any] = {}
        try:
            for k in _take(self.claims, self.order):
                done[self.items[k]] = _run(self.fn, self.items[k])
            f, self.read_fd = os.fdopen(self.read_fd, "rb"), -1  # (closed by the file from here)
            with f:
                data = f.read()
            _, status = os.waitpid(self.pid, 0)
            self.pid = 0
            if status == 0 and data:
                try:
                    done.update(pickle.loads(data))
                except Exception:  # noqa: BLE001  (torn: the caller runs these items)
                    pass
        finally:
            self.close()
        return done

    def close(self) -> None:
        """Stop the child if it still runs (not wanted any more) and let go of the pipes; done once."""
        global _HELPERS
        if self.claims is None:
            return
        _HELPERS -= 1
        for fd in self.claims:
            os.close(fd)
        self.claims = None
        if self.read_fd >= 0:
            os.close(self.read_fd)
        if self.pid:
            import signal

            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except OSError:  # pragma: no cover - already gone
                pass


def in_two(fn: Callable[[Any], Any], mine: list[Any], theirs: list[Any],
           portable: Callable[[Any], Any] = lambda r: r) -> dict[Any, Any]:
    """``{item: fn(item), or the exception it raised}`` for the items of ``mine`` and ``theirs`` (hashable, all
    different), run by this process and a forked child at once: this process runs ``mine`` in order, the child
    ``theirs``; the one that is done first takes the other's items not yet started, from the end of its list (put
    the slowest of each list first: the two then end close together whatever each item costs). The child's results
    come back through a pipe, pickled (``portable`` makes one picklable: a tracker dropped); if the child fails
    (killed, a result that cannot be pickled), the items it took are left out of the answer and the caller runs
    them, so the results are those of one process in every case. Nothing is forked without items for both, nor
    once CUDA is initialised here (they run here, in order)."""
    items = list(mine) + list(theirs)
    if len(set(items)) != len(items) or len(items) > 128:
        raise ValueError(f"mine={mine!r}, theirs={theirs!r} is invalid; allowed: at most 128 items, all different")
    if not (mine and theirs) or _cuda_initialised():
        return {item: _run(fn, item) for item in items}
    return TwoProcesses(fn, mine, theirs, portable).finish()
