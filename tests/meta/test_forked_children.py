"""memlab's forked children (the planner's look-ahead, the estimate's suggestions) run torch ops after the parent ran
ops on two intra-op threads: without ``memlab.core.forking.single_threaded_child`` the child's first parallel region
waits forever for threads the fork left behind (libgomp). Each case runs in its own interpreter under a timeout, so a
regression fails here instead of hanging the suite."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs fork (Linux)")

_PARENT = """
import os, sys, torch
torch.set_num_threads(2)
a = torch.randn(1500, 1500)
(a @ a).sum(); torch.randn(4_000_000).exp().sum()   # the parent's pool is now started
def work(_):
    b = torch.randn(1500, 1500)
    return float((b @ b).sum() + torch.randn(4_000_000).exp().sum()), "traced"
"""


def _run(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "utils"), "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_PARENT) + textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=180)


def test_the_plans_look_ahead_child_runs_ops_after_the_parents_pool_ran():
    proc = _run("""
        from memlab.plan.ahead import TraceAhead
        ahead = TraceAhead(work)
        ahead.start(None)
        got = ahead.take()
        print("child:", got is not None and got[1])
    """)
    assert proc.returncode == 0 and "child: traced" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


def test_single_threaded_child_is_what_a_bare_fork_needs():
    proc = _run("""
        from memlab.core.forking import single_threaded_child
        pid = os.fork()
        if pid == 0:
            single_threaded_child()
            work(None)
            os._exit(0 if torch.get_num_threads() == 1 else 3)
        _, status = os.waitpid(pid, 0)
        print("status", status)
    """)
    assert proc.returncode == 0 and "status 0" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


def test_the_estimates_suggestion_child_runs_ops_after_the_parents_pool_ran():
    proc = _run("""
        from memlab.estimate import suggest
        done = suggest._traced_in_two(lambda i: (i, work(None)[1]), [0, 1, 2, 3], [1.0, 1.0, 1.0, 1.0])
        print("rows:", sorted(done.items()))
    """)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    assert "rows: [(0, (0, 'traced')), (1, (1, 'traced')), (2, (2, 'traced')), (3, (3, 'traced'))]" in proc.stdout, proc.stdout
