"""One trainer per checkpoint directory: a lock file created with ``O_EXCL`` that holds the owner's pid.

Two trainers writing into one directory destroy each other's work: the second one, when it opens the
directory, removes the temp files of killed writers (:func:`memlab.train.state.remove_stale_temps`),
and so deletes the first one's checkpoint in flight (its ``os.replace`` then fails), and both keep
deleting checkpoints by the keep rule. :class:`DirectoryLock` makes the directory one trainer's:

* **taken**: ``open(".memlab-trainer.lock", O_CREAT | O_EXCL)`` (POSIX ``open(2)``: exactly one
  creator succeeds, the others get ``EEXIST``), the owner's pid written into it at once;
* **refused**: while that pid is a live process, another process gets :class:`DirectoryInUseError`
  naming the directory and the pid;
* **taken over**: the lock of a process that is gone (killed, ``kill -9``, a crash: nothing removed
  the file) is stale. It is removed by one taker at a time, under a second ``O_EXCL`` file (the
  takeover guard), after reading it again, and then created anew by ``O_EXCL`` as above: of several
  processes taking a stale lock over at once, exactly one gets it.
* **in one process** the newest trainer object on a directory owns it (a notebook re-runs a cell:
  the old object is superseded, and refuses to write afterwards), unless the owner is training at
  that moment (another thread), which is refused like another process.

A process is alive when ``os.kill(pid, 0)`` finds it and it is not a zombie (``/proc/<pid>/stat``).
Limits: pids are a machine's, so a directory shared between machines (NFS) is not protected, and a
pid the system reused for an unrelated process keeps a stale lock (the error names the file to
remove; on Windows every recorded pid counts as alive, so a stale lock there is removed by hand).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

__all__ = ["LOCK_NAME", "DirectoryInUseError", "DirectoryLock", "pid_alive"]

LOCK_NAME = ".memlab-trainer.lock"
_STARTING_S = 2.0  # a lock file younger than this with no pid in it yet: its creator is writing the pid
_GUARD_STALE_S = 10.0  # a takeover guard older than this belongs to a taker that died under it

# this process's owners: resolved directory -> the lock object that owns it (weakly held)
_OWNERS: dict[str, tuple["weakref.ref[DirectoryLock]", object]] = {}
_GUARD = threading.Lock()


class DirectoryInUseError(RuntimeError):
    """Another live trainer holds the checkpoint directory (the message names the directory and its pid)."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a zombie, dead but not yet reaped, does not)."""
    if pid <= 0:
        return False
    if os.name == "nt":  # signal 0 is CTRL_C_EVENT there, not a probe: every pid counts as alive
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OSError:
        return False
    try:  # Linux: field 3 of /proc/<pid>/stat is the state; Z is a zombie
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:][:1] != "Z"
    except (OSError, ValueError):
        return True


def _read_pid(path: Path) -> int | None:
    # The pid in a lock file, or None (no file, empty, not a pid)
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) <= 10 else None


class DirectoryLock:
    """The lock on ``directory`` (see the module doc): :meth:`acquire` it, :meth:`check` before each
    write, :meth:`release` when done (also when the owner object is garbage collected or the process
    exits). ``busy()`` marks the span in which the owner writes, so no newer object of this process
    takes the directory over meanwhile."""

    def __init__(self, directory: str | os.PathLike, *, name: str = "ckpt_dir") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.name = name
        self._key = str(self.directory.resolve())
        self._busy = 0
        self._held = False
        self._finalizer: Any = None

    # ------------------------------------------------------------------ taking it
    def acquire(self) -> "DirectoryLock":
        """Take the directory; raises :class:`DirectoryInUseError` if a live trainer holds it."""
        with _GUARD:
            deadline = time.monotonic() + 3 * _STARTING_S
            while time.monotonic() < deadline:  # each round: a create, a refusal, or a lock that changed meanwhile
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    if self._resolve_existing():  # taken over from an idle object of this process
                        return self
                    continue
                try:
                    os.write(fd, f"{os.getpid()}\n".encode())
                finally:
                    os.close(fd)
                self._own()
                return self
            raise DirectoryInUseError(f"{self.name}={str(self.directory)!r}: the lock file {self.path} keeps changing "
                                      "(other trainers starting at the same time?); try again")

    def _own(self) -> None:
        self._held = True
        token = object()
        _OWNERS[self._key] = (weakref.ref(self), token)
        self._finalizer = weakref.finalize(self, _release, self._key, str(self.path), os.getpid(), token)

    def _resolve_existing(self) -> bool:
        # The lock file exists: False to retry the create (it was stale and is gone, or is being written),
        # True once this object owns it (taken over from an idle object of this process), or raise.
        pid = _read_pid(self.path)
        if pid is None:
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return False  # released meanwhile: create it
            if age < _STARTING_S:  # its creator is writing the pid now
                time.sleep(0.01)
                return False
            self._remove_stale(None)
            return False
        if pid == os.getpid():
            entry = _OWNERS.get(self._key)
            owner = entry[0]() if entry is not None else None
            if owner is not None and owner._busy:
                raise DirectoryInUseError(
                    f"{self.name}={str(self.directory)!r} is in use by another BudgetTrainer of this process (pid "
                    f"{pid}), which is writing checkpoints there now; wait for its train() to return, or use another "
                    f"{self.name}")
            if owner is not None:  # an idle object of this process: the newer one takes the directory over
                owner._held = False
                if owner._finalizer is not None:
                    owner._finalizer.detach()
                self._own()
                return True
            self._remove_stale(pid)  # this process's lock with no owner left (an object that failed to start)
            return False
        if pid_alive(pid):
            raise DirectoryInUseError(
                f"{self.name}={str(self.directory)!r} is in use by another BudgetTrainer (pid {pid}, lock file "
                f"{self.path}); two trainers on one directory delete each other's checkpoints. Wait for it to finish "
                f"or stop it, or use another {self.name}; if no such trainer runs (pid {pid} is another program), "
                "remove the lock file")
        self._remove_stale(pid)
        return False

    def _remove_stale(self, pid: int | None) -> None:
        # Remove the stale lock of ``pid`` (None: an empty one), one taker at a time: under the takeover guard
        # (itself an O_EXCL file) the lock is read again and removed only if it is still that stale one. No
        # fresh lock can appear meanwhile: the name is taken by the stale file, which only a guard holder removes.
        guard = self.directory / f"{LOCK_NAME}.takeover"
        try:
            fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:  # a taker killed inside its few microseconds under the guard leaves it: old means dead
                if time.time() - guard.stat().st_mtime > _GUARD_STALE_S:
                    guard.unlink()
            except FileNotFoundError:
                pass
            time.sleep(0.005)
            return
        try:
            still = _read_pid(self.path)
            if still == pid and (pid is not None or self._old_enough()):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)
            guard.unlink(missing_ok=True)

    def _old_enough(self) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime >= _STARTING_S
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------ holding it
    @property
    def held(self) -> bool:
        """Whether this object still owns the directory (a newer object of this process may have taken it over)."""
        entry = _OWNERS.get(self._key)
        return self._held and entry is not None and entry[0]() is self

    def check(self) -> None:
        """Raise :class:`DirectoryInUseError` unless this object still owns the directory."""
        if not self.held:
            raise DirectoryInUseError(
                f"{self.name}={str(self.directory)!r} was taken over by a newer BudgetTrainer (or this one was "
                "closed): this trainer no longer writes there; create a new BudgetTrainer on it to resume")

    def busy(self) -> "_Busy":
        """A context in which this object writes: no other object of this process takes the directory over."""
        return _Busy(self)

    def release(self) -> None:
        """Give the directory up (the lock file is removed if it is still this process's)."""
        if self.held and self._finalizer is not None:
            self._finalizer()
        self._held = False


class _Busy:
    def __init__(self, lock: DirectoryLock) -> None:
        self.lock = lock

    def __enter__(self) -> DirectoryLock:
        self.lock.check()
        self.lock._busy += 1
        return self.lock

    def __exit__(self, *exc: Any) -> None:
        self.lock._busy -= 1


def _release(key: str, path: str, pid: int, token: object) -> None:
    # The finalizer of a DirectoryLock: forget the owner and remove the lock file, if both are still its own.
    entry = _OWNERS.get(key)
    if entry is None or entry[1] is not token:
        return
    del _OWNERS[key]
    if os.getpid() != pid:  # a forked child inherits the finalizer: the lock is its parent's
        return
    p = Path(path)
    if _read_pid(p) == pid:
        try:
            p.unlink()
        except OSError:
            pass
