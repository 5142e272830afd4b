"""launch(): run one function on N processes joined in a torch.distributed group, from a notebook cell.

The ranks are forked (Linux) so that a function defined in a notebook runs in them; gloo carries
the collectives on CPU. The same function runs unchanged under ``torchrun``. A rank that raises,
dies or hangs ends the launch with its own traceback, and no process outlives the call.
"""
from __future__ import annotations

import os
import pickle
import queue as _queue
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from memlab.core.validation import check_choice, check_int, check_number, check_positive_int, invalid
from memlab.core.procs import child_subreaper, descendants, die_with_parent, own_children

__all__ = ["launch", "RankError", "in_torchrun", "free_port", "MAX_LAUNCH_TIMEOUT", "MAX_LOCAL_RANKS", "BACKENDS"]

#: the longest ``timeout`` launch() accepts, in seconds (a week)
MAX_LAUNCH_TIMEOUT = 7 * 86400.0
#: the most processes launch() starts on this machine (torchrun's world may be larger)
MAX_LOCAL_RANKS = 256
#: the most torch threads per rank launch() accepts
MAX_THREADS = 1024
#: the torch.distributed backends launch() accepts
BACKENDS = ("gloo", "nccl", "mpi", "ucc")


class RankError(RuntimeError):
    """A rank raised (or died, or timed out) inside :func:`launch`; the message holds its traceback,
    ``rank`` the rank at fault when known, ``remote_traceback`` that rank's traceback alone."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def in_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (``TORCHELASTIC_RUN_ID``, ``RANK`` and
    ``WORLD_SIZE`` all set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (another process may take it before rank 0 binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a rank reports when a *peer* failed: the error to show is that peer's own
_PEER_FAILURE = ("DistBackendError", "Connection closed by peer", "Connection reset by peer", "GLHF",
                 "Broken pipe", "ProcessGroupGloo")


def launch(fn: Callable[..., Any], world_size: int = 2, *args: Any, backend: str = "gloo", timeout: float = 120.0,
           start_method: str | None = None, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes joined in a process group.

    Each process initialises ``torch.distributed`` (``backend``, gloo by default: collectives on
    CPU tensors) with a free local port, runs ``fn`` and destroys the group; results come back
    pickled (keep them small: numbers, lists, small CPU tensors).

    Start method: ``"fork"`` by default on Linux. A function defined in a notebook lives in
    ``__main__``, which a *spawned* child cannot import; a forked child inherits it (and the
    imported torch, so a launch costs well under a second instead of a fresh interpreter each).
    Elsewhere (macOS, Windows) the default is ``"spawn"`` and ``fn`` must live in an importable
    module. Fork before any CUDA call in the parent; on GPUs use torchrun.

    Errors: when a rank raises, the others are terminated (a rank blocked in a collective would
    wait for its peer until the group's timeout) and :class:`RankError` is raised with that rank's
    traceback; a rank that dies without a word (``os._exit``, a signal) or a launch that exceeds
    ``timeout`` seconds is a :class:`RankError` too. No process outlives the call, and the ranks die with
    the process that launched them even when it is killed outright (SIGKILL: no cleanup of its own runs):
    each rank sets ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux) and a watchdog thread that ends it when the
    launcher's end of a pipe closes, or, without one (spawn), when its parent changes
    (:func:`memlab.core.procs.die_with_parent`).

    Under ``torchrun`` (``torchrun --nproc-per-node 2 train.py``, whose ``__main__`` calls
    ``launch(fn, 2)``), nothing is started: this process joins the group torchrun set up
    (pass ``backend="nccl"`` on GPUs), runs ``fn(RANK, WORLD_SIZE, *args)`` and
    returns every rank's result gathered with ``all_gather_object``: the same list as here.

    The rendezvous port is a free local port picked here; if another process takes it before rank 0
    binds it ("address already in use"), the launch is retried with a new port (up to 3 tries).

    Args:
        fn: ``fn(rank, world_size, *args)``; what it returns must pickle.
        world_size: processes (1 to :data:`MAX_LOCAL_RANKS` here; under torchrun, torchrun's WORLD_SIZE).
        backend: the ``torch.distributed`` backend, one of :data:`BACKENDS` ("gloo" on CPU, "nccl" on GPUs
            under torchrun).
        timeout: seconds for the whole launch and for each collective (at most a week).
        start_method: "fork", "spawn" or "forkserver" (None: fork on Linux, spawn elsewhere).
        threads: torch threads per rank, 1 to 1024 (None: the cores shared out between the ranks).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        ValueError: a bad argument, named with its value; ``fn`` or ``args`` that a spawned child
            cannot receive.
        TypeError: ``fn`` is not callable.
        RankError: a rank raised, died or timed out.
    """
    _check_launch_args(fn, world_size, args, backend, timeout, start_method, threads)
    if in_torchrun():
        return _run_under_torchrun(fn, world_size, args, backend, timeout)
    for attempt in range(3):
        try:
            return _launch(fn, world_size, args, backend, timeout, start_method, threads)
        except RankError as exc:  # the free port was taken by another process in between: once more
            if attempt == 2 or "ddress already in use" not in exc.remote_traceback:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _check_launch_args(fn: Any, world_size: Any, args: Any, backend: Any, timeout: Any, start_method: Any,
                       threads: Any) -> None:
    # every argument, before any work (memlab.core.validation's one error format: name, value, what is allowed)
    if not callable(fn):
        raise TypeError(str(invalid("fn", fn, "a function fn(rank, world_size, *args)")))
    check_positive_int("world_size", world_size, maximum=None if in_torchrun() else MAX_LOCAL_RANKS)
    check_choice("backend", backend, BACKENDS)
    try:
        check_number("timeout", timeout, minimum=0.0, strict_minimum=True, maximum=MAX_LAUNCH_TIMEOUT)
    except (ValueError, OverflowError):  # say it in seconds (an int beyond a float's range overflows in isfinite)
        raise invalid("timeout", timeout, f"a finite number of seconds > 0 and <= {MAX_LAUNCH_TIMEOUT:g} "
                                          f"(a week)") from None
    if start_method is not None:
        import multiprocessing as mp

        check_choice("start_method", start_method, mp.get_all_start_methods())
    if threads is not None:
        check_int("threads", threads, minimum=1, maximum=MAX_THREADS)


def _child(fn: Callable, rank: int, world_size: int, args: tuple, backend: str, port: int, timeout: float,
           threads: int, queue: Any, parent: int | None = None, watch: tuple[int, int] | None = None) -> None:
    # one rank's process: die with the launching process (however it dies), join the group, run ``fn``, report
    # its result or traceback through ``queue``. ``parent``: the launching process's pid (fork; else this
    # process's parent at start), ``watch``: the (read, write) ends of the launcher's watchdog pipe (fork only)
    read_end = None
    if watch is not None:
        read_end, write_end = watch
        os.close(write_end)  # only the launcher holds the write end: its death closes the pipe
    die_with_parent(parent if parent is not None else os.getppid(), read_end)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:  # a process group of its own: the parent kills it, and whatever fn started in it, on every exit path
        os.setpgid(0, 0)
    except (AttributeError, OSError):  # pragma: no cover - not POSIX
        pass
    _hide_cuda_after_bad_fork()
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        # pickled here, by value: torch's multiprocessing reductions would send tensors as shared-memory
        # handles that die with this process
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent (before the group goes), which raises it
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        queue.put((rank, "error", tb))
    finally:
        queue.close()
        queue.join_thread()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer is gone; nothing left to do
                pass


def _hide_cuda_after_bad_fork() -> None:
    # A rank forked after the launching process initialised CUDA cannot use CUDA: its first CUDA call fails
    # ("CUDA error: initialization error"), and torch.optim's step asks the current CUDA stream whether it is
    # capturing a graph whenever CUDA is available (chapter 08's lecture on an H200, 2026-11-28: every Adam step of
    # a gloo rank failed). The ranks run on the CPU, so CUDA is shown as absent in them: torch.accelerator asks
    # torch.cuda.is_available, as does memlab.
    if torch.cuda._is_in_bad_fork():
        torch.cuda.is_available = lambda: False


def _kill_ranks(procs: list[Any], adopted: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    # SIGKILL every rank, its process group and every descendant (a grandchild in a session of its own too);
    # ``adopted``: orphans reparented to this process (see :func:`memlab.core.procs.child_subreaper`), killed and
    # reaped too
    pids = {p.pid for p in procs if p.pid is not None} | set(adopted)
    groups = set(pids)
    for _ in range(3):
        victims = descendants(pids) | {p.pid for p in procs if p.pid is not None and p.exitcode is None}
        for pgid in groups:  # each rank leads a process group (os.setpgid in _child)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (OSError, AttributeError):
                pass
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pids |= victims
        time.sleep(0.02)
    for pid in adopted:  # orphans reparented to this process: reap them (no zombies left behind)
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def _exit_description(code: int | None) -> str:
    # a process's exit code in words (negative: the signal that killed it)
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _launch(fn: Callable, world_size: int, args: tuple, backend: str, timeout: float, start_method: str | None,
            threads: int | None) -> list[Any]:
    import multiprocessing as mp

    if start_method is None:
        start_method = "fork" if sys.platform.startswith("linux") else "spawn"
    check_choice("start_method", start_method, mp.get_all_start_methods())
    if threads is None:
        threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world_size))
    ctx = mp.get_context(start_method)
    before = own_children()
    was_subreaper = child_subreaper(True)
    try:
        return _launch_ranks(ctx, fn, world_size, args, backend, timeout, start_method, threads, before)
    finally:
        if not was_subreaper:
            child_subreaper(False)


def _launch_ranks(ctx: Any, fn: Callable, world_size: int, args: tuple, backend: str, timeout: float,
                  start_method: str, threads: int, before: set[int]) -> list[Any]:
    def adopted() -> set[int]:
        return own_children() - before - {p.pid for p in procs}

    queue = ctx.Queue()
    port = free_port()
    # the watchdog pipe: a forked rank inherits both ends and closes the write end; the launcher keeps it until
    # the ranks are gone, and its death (however it dies) closes it: each rank's watchdog thread then ends it
    watch = os.pipe() if start_method == "fork" else None
    parent = os.getpid() if start_method == "fork" else None
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, args, backend, port, timeout, threads, queue,
                                              parent, watch),
                         name=f"memlab-rank{r}", daemon=True) for r in range(world_size)]
    try:
        try:
            for p in procs:
                p.start()
        finally:
            if watch is not None:
                os.close(watch[0])  # the launcher never reads; its write end stays open until the ranks are gone
        return _collect(procs, queue, world_size, timeout, start_method, adopted)
    except BaseException as exc:
        if any(p.pid is None for p in procs):  # a rank could not start: those started must not outlive the call
            started = [p for p in procs if p.pid is not None]
            _kill_ranks(started, adopted())
            for p in started:
                p.join(timeout=2)
            queue.close()
            if isinstance(exc, (AttributeError, TypeError, pickle.PicklingError)):  # spawn pickles fn and args
                raise ValueError(f"fn={getattr(fn, '__qualname__', fn)!r} or its args cannot be sent to a "
                                 f"{start_method!r} child ({exc}); allowed: a module-level function and picklable "
                                 f"args, or start_method='fork'") from None
        raise
    finally:
        if watch is not None:
            os.close(watch[1])


def _collect(procs: list[Any], queue: Any, world_size: int, timeout: float, start_method: str,
             adopted: Callable[[], set[int]]) -> list[Any]:
    # wait for every rank's report (or a failure, or the deadline); on every exit path no rank is left alive
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    error: RankError | None = None
    try:
        while len(results) < world_size and error is None:
            try:
                rank, status, payload = queue.get(timeout=0.1)
            except _queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in results]
                if dead:
                    # it may have reported just before exiting: one last look at the queue
                    try:
                        rank, status, payload = queue.get(timeout=0.5)
                    except _queue.Empty:
                        r, code = dead[0]
                        hint = (f"it {_exit_description(code)}: killed, os._exit, or a crash in native code"
                                if start_method == "fork" else
                                f"with start_method={start_method!r} the child imports fn by name: a function defined "
                                f"in a notebook or a script's __main__ is not importable there (its stderr says so); "
                                f"use the default fork on Linux or move fn into a module")
                        error = RankError(f"rank {r} of {world_size} died with exit code {code} without a result "
                                          f"({hint})", r)
                        break
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in results]
                    error = RankError(f"launch timed out after {timeout:g} s: rank(s) {missing} of {world_size} did not "
                                      f"finish (a collective that a peer never joined?); raise timeout= if the work is long")
                    break
                else:
                    continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                error = _root_cause(rank, payload, queue, world_size, procs, results)
    finally:  # also on an interrupt (KeyboardInterrupt, a grader's time limit): no process outlives the call
        done = error is None and len(results) == world_size
        for p in procs:
            if p.is_alive() and not done:
                p.terminate()
        if not done:
            _kill_ranks(procs, adopted())
        for p in procs:
            p.join(timeout=5 if done else 2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        _kill_ranks(procs, adopted())  # what fn started in the ranks' groups, or below them, goes too
        queue.close()
    if error is not None:
        raise error
    return [results[r] for r in range(world_size)]


def _root_cause(rank: int, payload: str, queue: Any, world_size: int, procs: list[Any] | None = None,
                results: dict[int, Any] | None = None) -> RankError:
    # the error to show: a rank's own exception rather than a peer's "connection closed" that it caused; when every
    # report is a peer's failure, the rank that died without a report (``os._exit``, a signal)
    errors = {rank: payload}
    end = time.monotonic() + 1.0  # the other ranks' reports, if they come at once
    while time.monotonic() < end and len(errors) < world_size:
        try:
            r, status, p = queue.get(timeout=0.1)
        except _queue.Empty:
            continue
        if status == "error":
            errors[r] = p
    own = [r for r, tb in errors.items() if not any(k in tb for k in _PEER_FAILURE)]
    if not own and procs is not None:
        end = time.monotonic() + 2.0
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(procs)
                    if r not in errors and r not in (results or {}) and p.exitcode is not None]
            if dead or time.monotonic() > end:
                break
            time.sleep(0.05)
        if dead:
            r, code = dead[0]
            return RankError(f"rank {r} of {world_size} died without a result: it {_exit_description(code)} "
                             f"(os._exit, a signal, or a crash in native code); rank(s) {sorted(errors)} then failed in "
                             f"a collective with it:\n\n{errors[rank]}", r)
    first = own[0] if own else rank
    others = sorted(set(errors) - {first})
    note = (f"\n(rank(s) {others} failed too, in a collective with the rank that raised)" if others else "")
    return RankError(f"rank {first} of {world_size} raised:\n\n{errors[first]}{note}", first, errors[first])


def _run_under_torchrun(fn: Callable, world_size: int, args: tuple, backend: str, timeout: float) -> list[Any]:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if ws != world_size:
        raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={ws} processes; "
                         f"allowed: launch(fn, {ws}) or torchrun --nproc-per-node {world_size}")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        result = fn(rank, ws, *args)
        gathered: list[Any] = [None] * ws
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if own:
            dist.destroy_process_group()

