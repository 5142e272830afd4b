"""Process helpers shared by the grader (memlab.course.grading) and launch() (memlab.distributed.launcher).

Linux-first: the process tree is read from /proc, and ``prctl`` makes this process adopt orphans.
Elsewhere they degrade to doing nothing (an empty set, False).
"""
from __future__ import annotations

import os

__all__ = ["child_subreaper", "descendants", "own_children"]


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
