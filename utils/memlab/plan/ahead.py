"""Tracing ahead: while the planner traces the stack its search asked for, a second process traces the stack the
search will most likely ask for next (issue 42.2: a first ``memlab plan`` on two cores).

What the search asks for next depends on what the current trace finds, so the guess is the search itself, run
again on copies of its rows (:meth:`memlab.plan.search.Search.next_after`) with the current stack assumed far over
the budget (most stacks a search traces do not fit: it goes cheapest first). A guess only decides what is traced
early, never a row: every estimate the plan uses is a trace of that stack, made in this process or in the forked
one (the same code on the same arguments: :func:`memlab.plan.stacks.cached_estimate`, which also writes the trace
cache), and a guess the search never asks for is counted apart (``PlanResult.ahead_unused``).

One process at a time is forked (``fork``: it starts with this process's imports and set-up, no second import of
torch); only on Linux, with two or more CPUs to run on, and not with ``MEMLAB_PLAN_AHEAD=0``. A child that fails or
dies is ignored: the stack is then traced here, as without it.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from memlab.core.forking import single_threaded_child
from memlab.plan.stack import Stack


def ahead_possible() -> bool:
    """Whether :class:`TraceAhead` can run here: Linux with the ``fork`` start method, two or more CPUs this
    process may run on, and ``MEMLAB_PLAN_AHEAD`` not ``0`` / ``off`` / ``no`` / ``false``."""
    if os.environ.get("MEMLAB_PLAN_AHEAD", "1").strip().lower() in ("0", "off", "no", "false"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return cpus >= 2


def _child(fn: Callable[[Stack], tuple[Any, str]], stack: Stack, conn: Any) -> None:
    # the forked process: one estimate, sent back without its tracker (as the disk cache keeps it)
    try:
        single_threaded_child()  # the parent's thread pool did not survive the fork
        est, origin = fn(stack)
        if dataclasses.is_dataclass(est):
            est = dataclasses.replace(est, tracker=None)
        conn.send(("ok", (est, origin)))
    except BaseException as exc:  # noqa: BLE001 (any failure: the parent traces the stack itself)
        try:
            conn.send(("error", repr(exc)[:500]))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


class TraceAhead:
    """At most one stack traced in a forked process at a time. ``fn(stack) -> (estimate, origin)`` is what the child
    runs. ``started``: stacks sent to a child; ``taken``: results the search used."""

    def __init__(self, fn: Callable[[Stack], tuple[Any, str]]) -> None:
        self.fn = fn
        self.proc: Any = None
        self.conn: Any = None
        self.stack: Stack | None = None
        self.started = 0

    @property
    def busy(self) -> bool:
        """A child is running (or has a result not yet taken)."""
        return self.proc is not None

    def start(self, stack: Stack) -> None:
        """Fork a child that traces ``stack``."""
        import multiprocessing

        for stream in (sys.stdout, sys.stderr):  # a child must not write this process's buffered output again
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(self.fn, stack, send), daemon=True, name="memlab-plan-ahead")
        proc.start()
        send.close()
        self.proc, self.conn, self.stack = proc, recv, stack
        self.started += 1

    def done(self) -> bool:
        """The child has finished (its result waits to be taken)."""
        return self.proc is not None and self.conn.poll()

    def take(self) -> tuple[Any, str] | None:
        """Wait for the child's ``(estimate, origin)``; None when it failed or died."""
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            kind, payload = "error", None
        self._reap()
        return payload if kind == "ok" else None

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join()
            self.conn.close()
        self.proc = self.conn = self.stack = None

    def close(self) -> None:
        """Stop a child still running (its stack was not needed)."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
        self._reap()
