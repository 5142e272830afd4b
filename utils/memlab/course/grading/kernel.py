"""The notebook's kernel, seen from the grader: start it, run code under hard deadlines, stop every
process of the run (double-forked ones included)."""
from __future__ import annotations

import asyncio
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memlab.course.grading.registry import KILL_GRACE, RUN_MARK_ENV, shorten
from memlab.core.optional import needs, require_installed
from memlab.core.procs import child_subreaper


# ----------------------------------------------------------------------------- the kernel, from outside
def _proc_stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgid, sid, state) of ``pid`` from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0]




def _children_of_this_process() -> set[int]:
    me, out = os.getpid(), set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None and st[0] == me:
                out.add(int(entry))
    return out


def _marked_processes(mark: str, kernel_pid: int | None, adopted: set[int] | None = None) -> set[int]:
    """Processes of this grading run: those whose environment carries ``mark``, those in the
    kernel's session or process group, the kernel's descendants, and ``adopted`` (orphans of the
    run reparented to this process) with their descendants. Never this process."""
    me = os.getpid()
    own_pgid, own_sid = os.getpgid(0), os.getsid(0)
    needle = f"{RUN_MARK_ENV}={mark}".encode()
    stats: dict[int, tuple[int, int, int, str]] = {}
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        st = _proc_stat(pid)
        if st is None or st[3] == "Z":
            continue
        stats[pid] = st
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            env = b""
        if needle in env.split(b"\0"):
            found.add(pid)
    found |= {pid for pid in (adopted or ()) if pid in stats}
    if kernel_pid is not None or adopted:
        roots = {kernel_pid} if kernel_pid is not None else set()
        for pid, (ppid, pgid, sid, _state) in stats.items():
            if (sid == kernel_pid and sid != own_sid) or (pgid == kernel_pid and pgid != own_pgid):
                found.add(pid)
        changed = True
        while changed:  # descendants of the kernel
            changed = False
            for pid, (ppid, *_rest) in stats.items():
                if ppid in roots | found and pid not in found and pid != me:
                    found.add(pid)
                    changed = True
        if kernel_pid in stats:
            found.add(kernel_pid)
    found.discard(me)
    return found


def stop_processes(mark: str, kernel_pid: int | None = None, before: set[int] | None = None) -> int:
    """SIGKILL every process of a grading run (see ``_marked_processes``); returns how many were stopped.

    ``mark``: the run's random mark (in its processes' environment); ``kernel_pid``: the kernel's pid,
    when known; ``before``: this process's children before the run started: any other child now (but
    the kernel) is an orphan of the run that the grader, as child subreaper, adopted: killed and reaped.
    """
    if not Path("/proc/self/stat").exists():  # not Linux: the kernel's process group is the best we can do
        if kernel_pid is not None:
            try:
                os.killpg(kernel_pid, signal.SIGKILL)
            except OSError:
                pass
        return 0
    stopped: set[int] = set()
    adopted: set[int] = set()
    for _ in range(50):
        if before is not None:
            adopted |= _children_of_this_process() - before - {kernel_pid}
        victims = _marked_processes(mark, kernel_pid, adopted)
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                stopped.add(pid)
            except OSError:
                pass
        time.sleep(0.05)
    for pid in adopted:  # our children now: reap them, no zombies left
        try:
            os.waitpid(pid, os.WNOHANG)
        except OSError:
            pass
    return len(stopped)


@dataclass
class Outcome:
    """What one execution request did."""

    state: str  # "ok" | "error" | "interrupted" | "killed" | "died"
    ename: str = ""
    evalue: str = ""
    seconds: float = 0.0
    outputs: list[Any] = field(default_factory=list)  # with keep_outputs: nbformat output nodes, as the kernel sent them
    execution_count: int | None = None  # with keep_outputs: the kernel's number for this execution


class _CellOutputs:
    """A cell's outputs as nbclient stores them: a node per stream, display, result or error message,
    ``clear_output`` honoured (with ``wait``: at the next output), and the execution count.
    (``update_display_data`` is not applied: no notebook of the course updates a display.)"""

    def __init__(self) -> None:
        with needs("memlab grade"):
            from nbformat.v4 import output_from_msg
        self._from_msg = output_from_msg
        self.outputs: list[Any] = []
        self.count: int | None = None
        self._clear_pending = False

    def add(self, msg: dict[str, Any]) -> None:
        kind, content = msg.get("msg_type"), msg.get("content", {})
        if kind == "execute_input":
            self.count = content.get("execution_count")
        elif kind == "clear_output":
            self._clear_pending = bool(content.get("wait"))
            if not self._clear_pending:
                self.outputs.clear()
        elif kind in ("stream", "display_data", "execute_result", "error"):
            if self._clear_pending:
                self.outputs.clear()
                self._clear_pending = False
            self.outputs.append(self._from_msg(msg))

    def result(self) -> tuple[list[Any], int | None]:
        return self.outputs, self.count


class Kernel:
    """An ipykernel of this interpreter, over IPC sockets in a private folder, with hard deadlines.

    Every request has a deadline; past it the kernel is interrupted, and ``KILL_GRACE`` seconds
    later every process of the run (the kernel, its process group and session, and anything
    carrying the run's mark in its environment) is killed. No learner code can swallow that.
    """

    def __init__(self, cwd: Path, env: dict[str, str], mark: str) -> None:
        self.cwd, self.env, self.mark = cwd, env, mark
        self.tmp = Path(tempfile.mkdtemp(prefix="memlab-kernel-"))
        self.km: Any = None
        self.kc: Any = None
        self.pid: int | None = None
        self.dead = False
        self._log: Any = None
        self.before: set[int] | None = None  # this process's children before the kernel started
        self._was_subreaper: bool | None = None

    async def start(self) -> None:
        """Start the kernel on this interpreter and wait (up to 120 s) until ``self.kc`` answers;
        MissingExtraError when jupyter_client or ipykernel is not installed."""
        with needs("memlab grade"):
            from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
            from jupyter_client.manager import AsyncKernelManager
        require_installed("ipykernel", "memlab grade")

        class _CurrentEnvSpecs(KernelSpecManager):
            def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: D401
                return KernelSpec(
                    argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                          "--HistoryManager.hist_file=:memory:"],
                    display_name=f"Python ({sys.executable})",
                    language="python",
                    resource_dir="",
                )

        ipc = os.name == "posix"  # IPC sockets: no TCP port, no "running over TCP without encryption" warning
        extra: dict[str, Any] = {"transport": "ipc", "ip": str(self.tmp / "kernel")} if ipc else {}
        self.km = AsyncKernelManager(kernel_name="memlab-current-env", kernel_spec_manager=_CurrentEnvSpecs(),
                                     connection_file=str(self.tmp / "kernel.json"), **extra)
        self._log = open(self.tmp / "kernel.log", "wb")
        if Path("/proc/self/stat").exists():
            self.before = _children_of_this_process()
            self._was_subreaper = child_subreaper(True)  # orphans of the notebook come back to the grader
        await self.km.start_kernel(env=self.env, cwd=str(self.cwd), stdout=self._log, stderr=self._log)
        proc = getattr(getattr(self.km, "provisioner", None), "process", None)
        self.pid = getattr(proc, "pid", None)
        self.kc = self.km.client()
        self.kc.allow_stdin = False
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=120)

    def exit_description(self) -> str:
        """How the kernel ended, a phrase to follow "the kernel" (``"was killed by signal SIGKILL (Killed)"``):
        a signal's name, an exit code, and a fatal error line from its log."""
        proc = getattr(getattr(self.km, "provisioner", None), "process", None)
        rc = proc.poll() if proc is not None else None
        if rc is None:
            what = "stopped responding"
        elif rc < 0:
            try:
                sig = signal.Signals(-rc)
                what = f"was killed by signal {sig.name} ({signal.strsignal(sig) or ''})".replace(" ()", "")
            except ValueError:
                what = f"was killed by signal {-rc}"
            if rc == -signal.SIGKILL:
                what += "; out of memory? the system's OOM killer sends SIGKILL"
        else:
            what = f"exited with code {rc}"
        try:
            log = (self.tmp / "kernel.log").read_text(errors="replace")
            fatal = [ln.strip() for ln in log.splitlines() if "Fatal Python error" in ln or "MemoryError" in ln]
            if fatal:
                what += f" ({shorten(fatal[-1], 120)})"
        except OSError:
            pass
        return what

    async def _alive(self) -> bool:
        try:
            return bool(await self.km.is_alive())
        except Exception:  # noqa: BLE001
            return False

    def kill(self) -> None:
        """Kill every process of this run now; the kernel is marked dead."""
        self.dead = True
        stop_processes(self.mark, self.pid, self.before)

    def main_thread_cpu(self) -> float | None:
        """CPU seconds the kernel's main thread (where cells and checks run) has used, from /proc; None
        where that is not readable."""
        if self.pid is None:
            return None
        try:
            raw = Path(f"/proc/{self.pid}/task/{self.pid}/stat").read_text()
        except OSError:
            return None
        fields = raw[raw.rfind(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks

    async def execute(self, code: str, limit: float, *, keep_outputs: bool = False, store_history: bool = True,
                      silent: bool = False, cpu_limit: float | None = None) -> Outcome:
        """Run ``code``; past ``limit`` seconds (wall clock), or once the kernel's main thread has used
        ``cpu_limit`` seconds of CPU time, interrupt, ``KILL_GRACE`` later kill. Never raises.

        ``store_history``: the kernel numbers this execution; ``silent``: run without broadcasting
        output; ``keep_outputs``: keep the outputs and the execution count, as nbclient stores them
        in a cell (what a notebook's own cells print; never used for the grader's requests).
        Returns the :class:`Outcome` (``"ok"``, ``"error"``, ``"interrupted"``, ``"killed"`` or
        ``"died"``, the error's name and value, the seconds taken).
        """
        start = time.monotonic()
        if self.dead:
            return Outcome("died")
        msg_id = self.kc.execute(code, silent=silent, store_history=store_history, allow_stdin=False, stop_on_error=False)
        deadline, interrupted_at = start + max(limit, 0.0), None
        cpu0 = self.main_thread_cpu() if cpu_limit is not None else None
        ename = evalue = ""
        kept = _CellOutputs() if keep_outputs else None

        def outcome(state: str) -> Outcome:
            outputs, count = kept.result() if kept is not None else ([], None)
            return Outcome(state, ename, evalue, time.monotonic() - start, outputs, count)

        while True:
            now = time.monotonic()
            cpu = self.main_thread_cpu() if cpu0 is not None else None
            over_cpu = cpu is not None and cpu0 is not None and min(cpu - cpu0, now - start) >= cpu_limit
            if interrupted_at is None and (now >= deadline or over_cpu):
                try:
                    await self.km.interrupt_kernel()
                except Exception:  # noqa: BLE001 - a dead or stuck kernel is killed below
                    pass
                interrupted_at = now
            elif interrupted_at is not None and now >= interrupted_at + KILL_GRACE:
                self.kill()
                return outcome("killed")
            wake = (deadline if interrupted_at is None else interrupted_at + KILL_GRACE) - now
            try:
                msg = await self.kc.get_iopub_msg(timeout=max(0.01, min(0.5, wake)))
            except queue.Empty:
                if not await self._alive():
                    self.dead = True
                    return outcome("died")
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg.get("msg_type"), msg.get("content", {})
            if kept is not None:
                kept.add(msg)
            if kind == "error" and not ename:
                ename, evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
            elif kind == "status" and content.get("execution_state") == "idle":
                state = "interrupted" if interrupted_at is not None else ("error" if ename else "ok")
                return outcome(state)

    async def close(self) -> None:
        """Stop every process this run started, then reap the kernel and remove its files.

        The processes are killed before the kernel is reaped, so that its pid cannot have been
        reused by an unrelated process when its session and descendants are looked up.
        """
        try:
            if self.kc is not None:
                self.kc.stop_channels()
        except Exception:  # noqa: BLE001
            pass
        stop_processes(self.mark, self.pid, self.before)
        try:
            if self.km is not None and self.km.has_kernel:
                await asyncio.wait_for(self.km.shutdown_kernel(now=True), timeout=30)  # reaps the killed kernel
        except Exception:  # noqa: BLE001
            try:
                await asyncio.wait_for(self.km.cleanup_resources(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
        finally:
            stop_processes(self.mark, None, (self.before or set()) | ({self.pid} if self.pid else set())
                           if self.before is not None else None)  # anything that appeared meanwhile
            if self._was_subreaper is False:
                child_subreaper(False)
            if self._log is not None:
                self._log.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

