"""Process helpers shared by the grader (memlab.course.grading) and launch() (memlab.distributed)."""
from __future__ import annotations


def child_subreaper(on: bool) -> bool:
    """Make this process the Linux "child subreaper" (``prctl(PR_SET_CHILD_SUBREAPER)``) or not;
    returns the previous setting. While it is on, a process orphaned below one of our children
    (a double fork into a session of its own, a grandchild whose parent has exited) is reparented
    to this process instead of init, so that it can still be found and killed. A no-op returning
    False where prctl is not available (not Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prev = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(prev), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        libc.prctl(36, 1 if on else 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        return bool(prev.value)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False
