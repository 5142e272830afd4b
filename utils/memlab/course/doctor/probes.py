"""The doctor's small tools: error text, sizes, the machine's memory, and catching what an import prints."""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import tempfile
import warnings
from typing import Any, Callable, Iterator, List, Optional

from memlab.core.units import GiB, KiB


def exc_text(e: BaseException) -> str:
    """An exception as one short line, ``"Type: first line of the message"``, at most 160 characters."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def gib(n: float) -> str:
    """``n`` bytes in GiB, one decimal: ``"1.5 GiB"``."""
    return f"{n / GiB:.1f} GiB"


def plural(n: int, word: str) -> str:
    """``"1 warning"``, ``"2 warnings"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class Captured:
    text: str = ""


@contextlib.contextmanager
def capture_output() -> Iterator[Captured]:
    """Swallow everything written while the block runs: Python-level ``sys.stdout``/``stderr``,
    logging that falls back to stderr, ``warnings``, and (best effort) C-level writes to file
    descriptors 1 and 2. What was written is the yielded object's ``.text`` after the block.
    """
    result = Captured()
    buf = io.StringIO()
    saved: List[tuple] = []
    tmp = None
    try:
        tmp = tempfile.TemporaryFile(mode="w+b")
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(tmp.fileno(), fd)
            except OSError:
                pass
    except Exception:
        tmp = None
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(
            buf
        ), contextlib.redirect_stderr(buf):
            warnings.simplefilter("always")
            yield result
    finally:
        for stream in (sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
        for fd, copy in saved:
            try:
                os.dup2(copy, fd)
            finally:
                os.close(copy)
        fd_text = ""
        if tmp is not None:
            try:
                tmp.seek(0)
                fd_text = tmp.read().decode("utf-8", "replace")
            except Exception:
                pass
            tmp.close()
        warn_text = "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
        result.text = buf.getvalue() + fd_text + warn_text


def first_line(text: str, limit: int = 120) -> str:
    """The first non-blank line of ``text``, cut to ``limit`` characters ('' if there is none)."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


def ram_bytes(import_module: Callable[[str], Any] = importlib.import_module) -> tuple:
    """The machine's memory, from psutil, /proc/meminfo or sysconf, whichever answers first:
    (total bytes, available bytes, source), any of them may be None. ``import_module`` imports
    psutil (the doctor passes its own, which tests replace)."""
    try:
        psutil = import_module("psutil")
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available), "psutil"
    except Exception:
        pass
    total = avail = None
    source = None
    try:
        with open("/proc/meminfo") as f:
            info = {}
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields:
                    info[key] = int(fields[0]) * KiB  # values are in kB (KiB)
        total, avail = info.get("MemTotal"), info.get("MemAvailable", info.get("MemFree"))
        source = "/proc/meminfo"
    except Exception:
        pass
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            source = "sysconf"
            try:
                avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            except Exception:
                pass
        except Exception:
            pass
    if total is None and sys.platform == "win32":
        try:
            import ctypes

            class _MemStatus(ctypes.Structure):
                _fields_ = [
                    ("dwLength", ctypes.c_ulong),
                    ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong),
                    ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong),
                    ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong),
                    ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("sullAvailExtendedVirtual", ctypes.c_ulonglong),
                ]

            st = _MemStatus()
            st.dwLength = ctypes.sizeof(_MemStatus)
            if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(st)):  # type: ignore[attr-defined]
                total, avail, source = int(st.ullTotalPhys), int(st.ullAvailPhys), "GlobalMemoryStatusEx"
        except Exception:
            pass
    return total, avail, source


def cgroup_limit() -> Optional[int]:
    """Memory limit of the container (cgroup v2 or v1) in bytes, None when unlimited or unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except Exception:
            continue
        if raw.isdigit() and int(raw) < 2**60:
            return int(raw)
    return None
