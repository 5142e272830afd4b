"""Process helpers shared by the grader (memlab.course.grading) and launch() (memlab.distributed.launcher).

Linux-first: the process tree is read from /proc, and ``prctl`` makes this process adopt orphans.
Elsewhere they degrade to doing nothing (an empty set, False).
"""
from __future__ import annotations

import os
import signal
import threading

__all__ = ["child_subreaper", "descendants", "own_children", "parent_death_signal", "die_with_parent"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_subreaper(on: bool) -> bool:
    """Make this process the Linux "child subreaper" (``prctl(PR_SET_CHILD_SUBREAPER)``) or not.

    While it is on, a process orphaned below one of our children (a double fork into a session of
    its own, a grandchild whose parent has exited) is reparented to this process instead of init,
    so that it can still be found and killed.

    Returns:
        The previous setting; False where prctl is not available (not Linux), where this is a no-op.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prev = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(prev), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        libc.prctl(36, 1 if on else 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        return bool(prev.value)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


def _parents() -> dict[int, int]:
    # {pid: parent pid} of every live (not zombie) process, from /proc; empty where there is none
    parent: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return parent
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                raw = f.read()
        except OSError:  # it exited meanwhile
            continue
        # the command name, in parentheses, may hold spaces: the fields start after the last ")"
        fields = raw[raw.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[0] != "Z":
            parent[int(e)] = int(fields[1])
    return parent


def descendants(roots: set[int]) -> set[int]:
    """The pids of every live process below ``roots`` (children, grandchildren ...; ``roots``
    themselves excluded), by parent pid; empty where there is no /proc."""
    parent = _parents()
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, pp in parent.items() if pp in frontier and pid not in found}
        found |= frontier
    return found


def own_children() -> set[int]:
    """The pids of the live direct children of this process; empty where there is no /proc."""
    me = os.getpid()
    return {pid for pid, pp in _parents().items() if pp == me}


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``).

    Strictly, when the *thread* that forked this process exits (prctl(2)): the caller forks from the thread
    that then waits for the child. Returns whether it was set (False where prctl is not available)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


def _end_own_group() -> None:
    # SIGKILL this process's group when it leads one (what it started goes too), else this process alone
    try:
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    except (OSError, AttributeError):  # pragma: no cover - not POSIX
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent_pid: int, watch_fd: int | None = None, *, use_prctl: bool = True) -> None:
    """Make this (child) process die when the process ``parent_pid`` that started it dies, however it dies
    (SIGKILL included, where no cleanup code of the parent runs).

    Two mechanisms, so that one holds where the other does not:

    - ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux, :func:`parent_death_signal`);
    - a watchdog thread on ``watch_fd``, the read end of a pipe whose write end only the parent holds (the
      child must have closed its inherited copy): the read returns end-of-file when the parent's end is closed,
      which the kernel does when the parent dies; the thread then SIGKILLs this process's group (or this
      process). Without a pipe the thread polls ``os.getppid()`` every 0.2 s instead (the parent's death
      reparents this process).

    A parent already dead before this ran (the race between fork and prctl) is seen at once by ``getppid``."""
    if use_prctl:
        parent_death_signal(signal.SIGKILL)

    def watch() -> None:
        if watch_fd is not None:
            try:
                while os.read(watch_fd, 1):
                    pass
            except OSError:
                pass
        else:
            while os.getppid() == parent_pid:
                threading.Event().wait(0.2)
        _end_own_group()

    if os.getppid() != parent_pid:
        _end_own_group()
    threading.Thread(target=watch, daemon=True, name="memlab-parent-watchdog").start()
