"""Small C++ kernels built on first use with the system compiler and loaded with ctypes.

memlab ships a few C++ sources as package data (chapter 04's AdamW step, chapter 06's NF4 dequantize).
:func:`build_library` compiles one of them with ``$CXX`` (else ``g++``, else ``c++`` on ``PATH``) into
memlab's cache folder (``$MEMLAB_CACHE``, default ``~/.cache/memlab``) once per source text, flags,
compiler and, for ``-march=native``, CPU, and loads the shared library with :mod:`ctypes`. The kernels
take only pointers and numbers: no Python or torch headers, so a build takes a second or two and needs
nothing but a compiler.

A build writes a per-process temporary file and renames it into place (a reader meets no library or a
whole one, and parallel test workers may build at once); within one process a lock makes each library
build and load once, whatever the threads asking. Callers keep their own fallback for a machine with no
compiler: every failure is raised, as ``RuntimeError`` naming what was missing or what the compiler said.
Nothing here imports torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Sequence

__all__ = ["NATIVE_FLAGS", "find_compiler", "cache_folder", "cpu_fingerprint", "library_path", "build_library"]

#: the flags chapter 04's kernel was built with: fast code for this machine, IEEE arithmetic kept (no fused
#: multiply-add the source does not write, no fast-math), OpenMP, a shared library
NATIVE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp",
                                 "-shared", "-fPIC")

_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL] = {}  # library path -> the library loaded from it in this process


def find_compiler() -> str | None:
    """The C++ compiler a build uses: ``$CXX`` when set, else ``g++`` or ``c++`` on ``PATH``; None when none."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def cache_folder() -> Path:
    """Where built libraries go: ``$MEMLAB_CACHE``, else ``~/.cache/memlab`` (read at each call)."""
    return Path(os.environ.get("MEMLAB_CACHE", Path.home() / ".cache" / "memlab"))


def cpu_fingerprint() -> str:
    """What ``-march=native`` compiles for: the machine type and this CPU's model and feature flags (Linux's
    ``/proc/cpuinfo``; elsewhere the processor name). A cache folder shared by machines of different CPUs (a home
    folder on a cluster) then holds one library per CPU, where one built for another would stop the process
    with an illegal instruction."""
    import platform

    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("model name", "flags", "features", "cpu part", "isa"):
                    parts.append(line.strip())
                elif not line.strip() and len(parts) > 2:  # the first processor's block is enough
                    break
    except OSError:
        pass
    return "\n".join(parts)


def library_path(name: str, source: str, flags: Sequence[str], cxx: str, cache: Path,
                 cpu: str | None = None) -> Path:
    """The library file of ``source`` (its text) built with ``flags`` by ``cxx``: ``memlab_<name>_<key>.so`` in
    ``cache``, ``key`` the first 16 hex digits of the SHA-256 of the text, the flags and the compiler, and with
    ``-march=native`` among the flags the CPU too (``cpu``; None reads :func:`cpu_fingerprint`)."""
    if "-march=native" in flags:
        cpu = cpu_fingerprint() if cpu is None else cpu
    else:
        cpu = ""
    key = hashlib.sha256((source + " ".join(flags) + cxx + cpu).encode()).hexdigest()[:16]
    return cache / f"memlab_{name}_{key}.so"


def build_library(source_path: Path, name: str, flags: Sequence[str] = NATIVE_FLAGS,
                  cache: Path | None = None) -> ctypes.CDLL:
    """Compile ``source_path`` (once per text, flags, compiler and CPU: :func:`library_path`) into ``cache``
    (None: :func:`cache_folder`) and load it; the same library object on every later call in this process.

    Args:
        source_path: the C++ file (package data beside the module that uses it).
        name: a short name for the library file (``memlab_<name>_<key>.so``).
        flags: the compiler flags (:data:`NATIVE_FLAGS` by default); they must make a shared library.

    Raises:
        RuntimeError: no compiler on ``PATH`` (``$CXX`` unset), or the compiler failed (its last output
            lines are in the message), or the library did not load.
        OSError: the source cannot be read or the cache folder cannot be written.
    """
    cxx = find_compiler()
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    source = Path(source_path).read_text()
    so = library_path(name, source, flags, cxx, cache_folder() if cache is None else Path(cache))
    with _LOCK:
        lib = _LOADED.get(str(so))
        if lib is not None and so.exists():
            return lib
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            tmp = so.with_name(f"{so.stem}.{os.getpid()}.so")  # per process: parallel test workers may build at once
            try:
                done = subprocess.run([cxx, *flags, str(source_path), "-o", str(tmp)], capture_output=True, text=True,
                                      timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"{cxx} could not build {Path(source_path).name}: {exc}") from exc
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                said = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
                raise RuntimeError(f"{cxx} failed (exit {done.returncode}) on {Path(source_path).name}:\n{said}")
            os.replace(tmp, so)  # atomic: a reader sees no library or a whole one
        try:
            lib = ctypes.CDLL(str(so))
        except OSError as exc:
            raise RuntimeError(f"{so} did not load: {exc}") from exc
        _LOADED[str(so)] = lib
        return lib
