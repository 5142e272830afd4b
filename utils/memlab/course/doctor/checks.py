"""``memlab doctor``: an environment report a learner can paste into a bug report.

Usage::

    memlab doctor            # aligned text report
    memlab doctor --json     # the same lines as JSON
    python -m memlab.doctor  # without the console script

Every check produces one :class:`CheckLine` with a status:

* ``OK``: fine.
* ``WARN``: the course still runs, but something is missing or runs at reduced scale
  (no CUDA GPU, an optional package absent ...). The detail says which chapters are affected.
* ``FAIL``: the course cannot run until this is fixed (no torch, Python too old, an
  environment variable that ``memlab.config`` will reject, a package the notebooks or the grader
  import: transformers, nbclient, ipykernel).

The report ends with two verdicts: whether memlab's core (``pip install ./utils``: torch, numpy,
matplotlib, tqdm) can run, and whether the whole course can (the ``hf`` and ``grade`` extras,
JupyterLab). ``memlab doctor`` exits 1 when the course cannot run, even if the core can.

Design rules: the doctor never crashes because one package is broken (every optional import is
lazy and wrapped in ``try/except Exception``), it needs no network and no notebooks, and it is
quick: only ``torch`` and ``bitsandbytes`` are imported; every other package is looked up through
``importlib.metadata`` without importing it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Iterator, List, Optional, Sequence

__all__ = ["CheckLine", "run_checks", "main", "summarize", "core_summary", "CORE_CHECKS", "STATUSES"]

STATUSES = ("OK", "WARN", "FAIL")

_GIB = 2**30
_HF = "pip install 'memlab[hf]'"
_GRADE = "pip install 'memlab[grade]'"
#: the lines that decide whether memlab's core (``pip install ./utils``) can run; a FAIL on any
#: other line means "memlab core only": the core works, the course does not
CORE_CHECKS = ("python", "torch", "matplotlib", "memlab", "env")
_MIN_TORCH = (2, 3)  # utils/pyproject.toml: torch>=2.3
_MIN_TRANSFORMERS = (4, 45)  # utils/pyproject.toml: transformers>=4.45


@dataclass(frozen=True)
class CheckLine:
    """One line of the report: ``name`` (short, e.g. ``"torch"``), ``status`` (OK/WARN/FAIL),
    and a human-readable ``detail``."""

    name: str
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# small helpers (tests monkeypatch _import_module to simulate missing or broken packages)
# --------------------------------------------------------------------------------------------


def _import_module(name: str) -> Any:
    """Import ``name``. The single place where the doctor imports third-party code."""
    return importlib.import_module(name)


def _dist_version(dist: str) -> Optional[str]:
    """Installed version of distribution ``dist`` from its metadata, None when not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # broken metadata: treat as unknown
        return None


def _module_location(module: str) -> Optional[str]:
    """Where ``module`` would be imported from, without importing it; None when absent."""
    try:
        spec = importlib.util.find_spec(module)
    except Exception:
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else (spec.origin or module)


def _vtuple(version: str) -> tuple:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; stops at the first non-numeric part."""
    parts = []
    for piece in re.split(r"[.+-]", version):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.group() != piece:
            break
    return tuple(parts)


def _exc(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _gib(n: float) -> str:
    return f"{n / _GIB:.1f} GiB"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class _Captured:
    text: str = ""


@contextlib.contextmanager
def _capture_output() -> Iterator[_Captured]:
    """Swallow everything written while the block runs: Python-level ``sys.stdout``/``stderr``,
    logging that falls back to stderr, ``warnings``, and (best effort) C-level writes to file
    descriptors 1 and 2. What was written is available as ``.text`` after the block."""
    result = _Captured()
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


def _first_line(text: str, limit: int = 120) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


# --------------------------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------------------------


class _Context:
    """What later checks need from earlier ones."""

    def __init__(self) -> None:
        self.torch: Any = None  # the torch module when importable
        self.cuda: bool = False  # torch.cuda.is_available()
        self.cuda_count: int = 0


def _python_status(version_info: Sequence[int]) -> str:
    vi = tuple(version_info[:2])
    if vi < (3, 9):
        return "FAIL"
    if vi < (3, 10):
        return "WARN"
    return "OK"


def _check_python(ctx: _Context) -> List[CheckLine]:
    vi = sys.version_info
    status = _python_status(vi)
    detail = f"{platform.python_version()} ({platform.python_implementation()}) at {sys.executable}"
    if status == "FAIL":
        detail += "; the course needs Python 3.10 or newer"
    elif status == "WARN":
        detail += "; Python 3.10+ is recommended (`pip install ./utils` requires it)"
    return [CheckLine("python", status, detail)]


def _check_platform(ctx: _Context) -> List[CheckLine]:
    system = platform.system() or sys.platform
    release = platform.release()
    detail = f"{system} {release} ({platform.machine() or 'unknown arch'})"
    if system == "Linux":
        try:
            import glob

            if glob.glob("/proc/sys/fs/binfmt_misc/WSLInterop*") or "microsoft" in release.lower():
                detail += ", WSL"
        except Exception:
            pass
    elif system == "Darwin":
        mac = platform.mac_ver()[0]
        if mac:
            detail += f", macOS {mac}"
    return [CheckLine("platform", "OK", detail)]


def _check_cpu(ctx: _Context) -> List[CheckLine]:
    total = os.cpu_count()
    detail = f"{total} logical CPUs" if total else "CPU count unknown"
    try:
        usable = len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
        if total and usable < total:
            detail += f" ({usable} usable by this process)"
    except Exception:
        pass
    return [CheckLine("cpu", "OK", detail)]


def _ram_bytes() -> tuple:
    """(total, available, source); any element may be None."""
    try:
        psutil = _import_module("psutil")
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
                    info[key] = int(fields[0]) * 1024  # values are in kB
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


def _cgroup_limit() -> Optional[int]:
    """Memory limit of the container (cgroup v2 or v1), None when unlimited or unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except Exception:
            continue
        if raw.isdigit() and int(raw) < 2**60:
            return int(raw)
    return None


def _check_ram(ctx: _Context) -> List[CheckLine]:
    total, avail, source = _ram_bytes()
    if total is None:
        return [CheckLine("ram", "OK", "total RAM unknown (no psutil, /proc/meminfo or sysconf)")]
    detail = f"{_gib(total)} total"
    if avail is not None:
        detail += f", {_gib(avail)} available"
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        detail += f", container limit {_gib(limit)}"
    detail += f" (via {source})"
    return [CheckLine("ram", "OK", detail)]


def _check_torch(ctx: _Context) -> List[CheckLine]:
    try:
        torch = _import_module("torch")
    except Exception as e:
        installed = _dist_version("torch")
        if installed:
            detail = f"torch {installed} is installed but importing it failed: {_exc(e)}"
        else:
            detail = f"not importable ({_exc(e)}); install it: https://pytorch.org/get-started/locally/"
        return [CheckLine("torch", "FAIL", detail)]
    ctx.torch = torch
    version = str(getattr(torch, "__version__", "unknown"))
    tv = getattr(torch, "version", None)
    hip = getattr(tv, "hip", None)
    cuda_build = getattr(tv, "cuda", None)
    if hip:
        build = f"ROCm {hip} build"
    elif cuda_build:
        build = f"CUDA {cuda_build} build"
    else:
        build = "cpu build"
    detail = f"{version} ({build})"
    status = "OK"
    vt = _vtuple(version)
    if vt and vt[:2] < _MIN_TORCH:
        status = "WARN"
        detail += f"; memlab needs torch>={'.'.join(map(str, _MIN_TORCH))}"
    try:
        ctx.cuda = bool(torch.cuda.is_available())
        ctx.cuda_count = int(torch.cuda.device_count()) if ctx.cuda else 0
    except Exception as e:
        ctx.cuda = False
        detail += f"; torch.cuda.is_available() raised {_exc(e)}"
        status = "WARN"
    return [CheckLine("torch", status, detail)]


def _check_gpu(ctx: _Context) -> List[CheckLine]:
    torch = ctx.torch
    if torch is None:
        return [CheckLine("gpu", "WARN", "not checked: torch is not importable")]
    if not ctx.cuda:
        detail = "no CUDA GPU: the course runs at small scale on CPU"
        tv = getattr(torch, "version", None)
        try:
            mps = getattr(getattr(torch, "backends", None), "mps", None)
            if mps is not None and mps.is_available():
                detail += " (Apple MPS is available, but the memory measurements need CUDA)"
        except Exception:
            pass
        if not getattr(tv, "cuda", None) and not getattr(tv, "hip", None) and shutil.which("nvidia-smi"):
            detail += (
                "; nvidia-smi exists but this torch is a CPU build: reinstall torch with CUDA "
                "(https://pytorch.org/get-started/locally/)"
            )
        return [CheckLine("gpu", "WARN", detail)]
    lines = []
    for i in range(max(ctx.cuda_count, 1)):
        name = "gpu" if i == 0 else f"gpu:{i}"
        try:
            props = torch.cuda.get_device_properties(i)
            detail = f"cuda:{i} {props.name}, compute capability {props.major}.{props.minor}"
            status = "OK"
            try:
                free, total = torch.cuda.mem_get_info(i)
                detail += f", {_gib(total)} total, {_gib(free)} free"
                used = total - free
                if total and used > 0.2 * total:
                    status = "WARN"
                    detail += (
                        f"; {_gib(used)} already in use (other processes or notebooks?): "
                        "close them before measuring memory"
                    )
            except Exception as e:
                detail += f", {_gib(props.total_memory)} total, free memory unknown ({_exc(e)})"
                status = "WARN"
        except Exception as e:
            status, detail = "WARN", f"cuda:{i}: could not query the device ({_exc(e)})"
        lines.append(CheckLine(name, status, detail))
    return lines


def _check_bf16(ctx: _Context) -> List[CheckLine]:
    torch = ctx.torch
    if torch is None:
        return [CheckLine("bf16", "WARN", "not checked: torch is not importable")]
    if ctx.cuda:
        try:
            try:
                native = bool(torch.cuda.is_bf16_supported(including_emulation=False))
            except TypeError:  # older torch without the keyword
                native = bool(torch.cuda.is_bf16_supported())
        except Exception as e:
            return [CheckLine("bf16", "WARN", f"torch.cuda.is_bf16_supported() raised {_exc(e)}")]
        if native:
            return [CheckLine("bf16", "OK", "supported on cuda:0")]
        return [
            CheckLine(
                "bf16",
                "WARN",
                "not supported natively on cuda:0 (needs compute capability 8.0+); "
                "the bf16 mixed-precision examples will not run there, fp16 will",
            )
        ]
    try:
        a = torch.ones(8, 8, dtype=torch.bfloat16)
        ok = float((a @ a).float().sum().item()) == 8.0 * 64
    except Exception as e:
        return [CheckLine("bf16", "WARN", f"a bf16 matmul failed on CPU: {_exc(e)}")]
    if not ok:
        return [CheckLine("bf16", "WARN", "a bf16 matmul on CPU gave a wrong result")]
    return [CheckLine("bf16", "OK", "bf16 matmul runs on CPU")]


def _package_line(
    name: str,
    why: str,
    *,
    dist: Optional[str] = None,
    module: Optional[str] = None,
    minimum: Optional[tuple] = None,
    missing: str = "WARN",
    install: Optional[str] = None,
) -> CheckLine:
    """Report a package from its metadata, without importing it. ``missing`` is the status when
    it is not installed (``"FAIL"`` for what the course cannot run without); ``install`` the
    command that installs it."""
    dist = dist or name
    module = module or name
    try:
        version = _dist_version(dist)
        if version is None:
            where = _module_location(module)
            if where is None:
                return CheckLine(name, missing, f"not installed: {why}" + (f" ({install})" if install else ""))
            return CheckLine(
                name, "WARN", f"importable from {where} but not pip-installed (no package metadata): {why}"
            )
        if minimum and _vtuple(version) and _vtuple(version)[: len(minimum)] < minimum:
            need = ".".join(map(str, minimum))
            return CheckLine(name, "WARN", f"{version} is too old, {name}>={need} is {why}")
        return CheckLine(name, "OK", version)
    except Exception as e:
        return CheckLine(name, "WARN", f"could not check ({_exc(e)}): {why}")


def _check_transformers(ctx: _Context) -> List[CheckLine]:
    return [
        _package_line(
            "transformers",
            "needed for tiny_llama and the model presets (chapters 00-08)",
            minimum=_MIN_TRANSFORMERS,
            missing="FAIL",
            install=_HF,
        )
    ]


def _check_peft(ctx: _Context) -> List[CheckLine]:
    return [_package_line("peft", "needed for chapter 06 (QLoRA)", install=_HF)]


def _check_accelerate(ctx: _Context) -> List[CheckLine]:
    return [_package_line("accelerate", "needed for the chapter 01 comparisons", install=_HF)]


_BNB_WHY = f"needed for chapter 06 and 8-bit Adam estimates; {_HF}"


def _check_bitsandbytes(ctx: _Context) -> List[CheckLine]:
    version = _dist_version("bitsandbytes")
    if version is None and _module_location("bitsandbytes") is None:
        return [CheckLine("bitsandbytes", "WARN", f"not installed: {_BNB_WHY}")]
    label = version or "unknown version"
    if ctx.torch is None:
        return [CheckLine("bitsandbytes", "WARN", f"{label}, not imported because torch is not importable")]
    bnb = None
    error: Optional[BaseException] = None
    with _capture_output() as cap:
        try:
            bnb = _import_module("bitsandbytes")
        except Exception as e:  # bitsandbytes raises on broken CUDA setups
            error = e
    printed = _first_line(cap.text)
    if bnb is None:
        detail = f"{label} is installed but importing it failed: {_exc(error) if error else 'unknown error'}"
        if printed:
            detail += f"; it printed: {printed}"
        return [CheckLine("bitsandbytes", "WARN", f"{detail} ({_BNB_WHY})")]
    label = str(getattr(bnb, "__version__", None) or label)

    status = "OK"
    backend = None
    native = None
    try:
        cext = sys.modules.get("bitsandbytes.cextension") or _import_module("bitsandbytes.cextension")
        backend = getattr(cext, "BNB_BACKEND", None)
        lib_cls = type(getattr(cext, "lib", None)).__name__
        if lib_cls.startswith("Cuda"):
            native = "native CUDA library loaded"
        elif lib_cls.startswith("Xpu"):
            native = "native XPU library loaded"
        elif "Mock" in lib_cls or "Error" in lib_cls:
            native = "no native library"
        elif lib_cls != "NoneType":
            native = "native CPU library loaded"
    except Exception:
        pass
    if backend is None:  # other bitsandbytes versions: fall back on what torch sees
        backend = "CUDA (guessed)" if ctx.cuda else "CPU (guessed)"
    detail = f"{label}, {backend} backend"
    if native:
        detail += f", {native}"
    if ctx.cuda and native == "no native library":
        status = "WARN"
        detail += ": the CUDA kernels failed to load, 4-bit/8-bit layers will not work"
        if printed:
            detail += f"; it printed: {printed}"
    elif ctx.cuda and str(backend).startswith("CPU"):
        status = "WARN"
        detail += ": a CUDA GPU is present but bitsandbytes did not pick it up"
    return [CheckLine("bitsandbytes", status, detail)]


def _check_matplotlib(ctx: _Context) -> List[CheckLine]:
    return [
        _package_line(
            "matplotlib", "memlab needs it for its plots", missing="FAIL", install="pip install ./utils"
        )
    ]


def _check_jupyterlab(ctx: _Context) -> List[CheckLine]:
    return [
        _package_line(
            "jupyterlab",
            "needed by `make lab` to open the notebooks (or use another Jupyter front end)",
            install="pip install -r requirements.txt",
        )
    ]


def _check_ipywidgets(ctx: _Context) -> List[CheckLine]:
    return [
        _package_line(
            "ipywidgets",
            "progress bars (tqdm.auto) render as widgets in JupyterLab; without it they fall back to text "
            "and JupyterLab may warn 'IProgress not found'",
            install="pip install -r requirements.txt",
        )
    ]


def _check_nbclient(ctx: _Context) -> List[CheckLine]:
    return [
        _package_line(
            "nbclient", "needed to run notebooks headless (nbval in `make test`)", missing="FAIL", install=_GRADE
        )
    ]


def _check_ipykernel(ctx: _Context) -> List[CheckLine]:
    return [
        _package_line(
            "ipykernel", "the notebooks' kernel, needed to run and grade them", missing="FAIL", install=_GRADE
        )
    ]


def _check_memlab(ctx: _Context) -> List[CheckLine]:
    try:
        memlab = _import_module("memlab")
    except Exception as e:
        return [CheckLine("memlab", "FAIL", f"not importable ({_exc(e)}); run `pip install -e ./utils`")]
    version = getattr(memlab, "__version__", None) or _dist_version("memlab") or "unknown version"
    path = None
    if getattr(memlab, "__file__", None):
        path = os.path.dirname(os.path.abspath(memlab.__file__))
    else:
        locations = list(getattr(memlab, "__path__", []) or [])
        path = locations[0] if locations else None
    detail = f"{version} at {path or 'unknown path'}"
    status = "OK"
    try:
        dist = importlib.metadata.distribution("memlab")
        direct = dist.read_text("direct_url.json")
        if direct and json.loads(direct).get("dir_info", {}).get("editable"):
            detail += " (editable install)"
    except importlib.metadata.PackageNotFoundError:
        status = "WARN"
        detail += " (found on sys.path, not pip-installed: run `pip install -e ./utils` for the `memlab` command)"
    except Exception:
        pass
    return [CheckLine("memlab", status, detail)]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _check_env(ctx: _Context) -> List[CheckLine]:
    """MEMLAB_DEVICE / MEMLAB_SMALL, validated the way ``memlab.config`` reads them (a value it
    rejects makes ``import memlab.config`` raise, hence FAIL)."""
    torch = ctx.torch
    parts: List[str] = []
    problems: List[tuple] = []
    device_raw = os.environ.get("MEMLAB_DEVICE")
    small_raw = os.environ.get("MEMLAB_SMALL")
    device_type = "cuda" if ctx.cuda else "cpu"

    if device_raw is not None and device_raw.strip():
        name = device_raw.strip()
        parts.append(f"MEMLAB_DEVICE={name}")
        if torch is not None:
            try:
                dev = torch.device(name)
                device_type = dev.type
                if dev.type == "cuda" and not ctx.cuda:
                    problems.append(("FAIL", f"MEMLAB_DEVICE={name!r} asks for CUDA but no CUDA GPU is available"))
                elif dev.type == "cuda" and dev.index is not None and dev.index >= ctx.cuda_count:
                    problems.append(("WARN", f"MEMLAB_DEVICE={name!r} but only {ctx.cuda_count} GPU(s) are visible"))
                elif dev.type not in ("cpu", "cuda"):
                    problems.append(("WARN", f"MEMLAB_DEVICE={name!r}: the course is written for 'cpu' and 'cuda'"))
            except Exception:
                problems.append(("FAIL", f"MEMLAB_DEVICE={name!r} is not a device torch understands ('cpu', 'cuda', 'cuda:N')"))
    elif device_raw is not None:
        parts.append("MEMLAB_DEVICE= (empty: automatic)")

    small = device_type != "cuda"
    if small_raw is not None:
        parts.append(f"MEMLAB_SMALL={small_raw}")
        val = small_raw.strip().lower()
        if val in _TRUE:
            small = True
        elif val not in _FALSE:
            problems.append(("FAIL", f"MEMLAB_SMALL={small_raw!r} is not understood (1/0, true/false, yes/no, on/off)"))

    if not parts:
        detail = "MEMLAB_DEVICE and MEMLAB_SMALL not set"
    else:
        detail = ", ".join(parts)
    if ctx.torch is not None and not any(s == "FAIL" for s, _ in problems):
        detail += f" (course runs on {device_type}, {'small' if small else 'full'} scale)"
    status = "OK"
    if problems:
        status = "FAIL" if any(s == "FAIL" for s, _ in problems) else "WARN"
        detail += "; " + "; ".join(msg for _, msg in problems)
    return [CheckLine("env", status, detail)]


_CHECKS: List[tuple] = [
    ("python", _check_python),
    ("platform", _check_platform),
    ("cpu", _check_cpu),
    ("ram", _check_ram),
    ("torch", _check_torch),
    ("gpu", _check_gpu),
    ("bf16", _check_bf16),
    ("transformers", _check_transformers),
    ("peft", _check_peft),
    ("accelerate", _check_accelerate),
    ("bitsandbytes", _check_bitsandbytes),
    ("matplotlib", _check_matplotlib),
    ("jupyterlab", _check_jupyterlab),
    ("ipywidgets", _check_ipywidgets),
    ("nbclient", _check_nbclient),
    ("ipykernel", _check_ipykernel),
    ("memlab", _check_memlab),
    ("env", _check_env),
]


def run_checks() -> List[CheckLine]:
    """Run every check and return one :class:`CheckLine` per line of the report (two or more
    ``gpu`` lines on multi-GPU machines). Never raises: a check that crashes becomes a WARN."""
    ctx = _Context()
    lines: List[CheckLine] = []
    for name, check in _CHECKS:
        try:
            lines.extend(check(ctx))
        except Exception as e:  # a bug in the doctor must not hide the rest of the report
            lines.append(CheckLine(name, "WARN", f"the doctor's {name} check crashed: {_exc(e)}"))
    return lines


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def _core_fails(lines: Sequence[CheckLine]) -> List[str]:
    return [line.name for line in lines if line.status == "FAIL" and line.name.split(":")[0] in CORE_CHECKS]


def core_summary(lines: Sequence[CheckLine]) -> str:
    """``"memlab core can run"`` or ``"memlab core cannot run: fix the FAIL lines of torch"``."""
    bad = _core_fails(lines)
    if bad:
        return f"memlab core cannot run: fix the FAIL lines of {', '.join(bad)}"
    return "memlab core can run (torch, numpy, matplotlib, tqdm: `pip install ./utils`)"


def summarize(lines: Sequence[CheckLine]) -> str:
    """``"the course can run (2 warnings)"`` or ``"the course cannot run: fix the FAIL lines ..."``
    (with ``"memlab core only"`` when the failures are all outside memlab's core)."""
    fails = sum(1 for line in lines if line.status == "FAIL")
    warns = sum(1 for line in lines if line.status == "WARN")
    if fails:
        text = (
            f"the course cannot run: fix the FAIL lines ({_plural(fails, 'failure')}, "
            f"{_plural(warns, 'warning')})"
        )
        if not _core_fails(lines):
            text += "; memlab core only: `make setup` or `pip install -r requirements.txt` installs the rest"
        return text
    if warns:
        return f"the course can run ({_plural(warns, 'warning')})"
    return "the course can run (no warnings)"


def format_report(lines: Sequence[CheckLine]) -> str:
    width = max([14] + [len(line.name) for line in lines]) + 1
    tags = {"OK": "[ OK ]", "WARN": "[WARN]", "FAIL": "[FAIL]"}
    out = ["memlab doctor"]
    for line in lines:
        out.append(f"{tags[line.status]} {line.name.ljust(width)}{line.detail}")
    out.append(core_summary(lines))
    out.append(summarize(lines))
    return "\n".join(out)


def _exit_code(lines: Sequence[CheckLine]) -> int:
    return 1 if any(line.status == "FAIL" for line in lines) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``memlab doctor``; returns 0 when the course can run (no line is FAIL), else 1."""
    parser = argparse.ArgumentParser(
        prog="memlab doctor",
        description="Check that this environment can run LLM Memory Lab; paste the output into bug reports.",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON instead of text")
    if argv is None and "ipykernel" in sys.modules:
        argv = []  # called as doctor.main() in a notebook: sys.argv holds the kernel's arguments
    args = parser.parse_args(list(argv) if argv is not None else None)

    lines = run_checks()
    code = _exit_code(lines)
    if args.json:
        payload = {
            "checks": [line.to_dict() for line in lines],
            "failures": sum(1 for line in lines if line.status == "FAIL"),
            "warnings": sum(1 for line in lines if line.status == "WARN"),
            "summary": summarize(lines),
            "core_summary": core_summary(lines),
            "core_can_run": not _core_fails(lines),
            "course_can_run": code == 0,
            "exit_code": code,
        }
        print(json.dumps(payload, indent=2))
    else:
        print(format_report(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
