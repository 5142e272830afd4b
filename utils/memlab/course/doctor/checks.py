"""The doctor's checks: one function per line of the report, each reading the environment without
crashing on a broken package (tests replace ``_import_module`` to simulate one)."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Sequence

from memlab.course.doctor.probes import capture_output, cgroup_limit, exc_text, first_line, gib, ram_bytes

STATUSES = ("OK", "WARN", "FAIL")

_HF = "pip install 'memlab[hf]'"
_GRADE = "pip install 'memlab[grade]'"
#: the lines that decide whether memlab's core (``pip install ./utils``) can run; a FAIL on any
#: other line means "memlab core only": the core works, the course does not
CORE_CHECKS = ("python", "torch", "matplotlib", "memlab", "env")
#: the lowest versions memlab supports: the lower bounds of utils/pyproject.toml
#: (tests/course/test_doctor.py reads that file and checks that the two agree)
MINIMUMS: dict[str, tuple[int, ...]] = {
    "torch": (2, 3),
    "numpy": (1, 24),
    "matplotlib": (3, 7),
    "tqdm": (4, 60),
    "transformers": (5, 16),
    "peft": (0, 12),
    "accelerate": (0, 33),
    "bitsandbytes": (0, 45),
    "nbformat": (5, 9),
    "nbclient": (0, 8),
    "ipykernel": (6, 0),
    "hypothesis": (6, 100),
    "datasets": (2, 14),
}


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
        """This line as a JSON-ready dict, ``{field: value}``."""
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


def _check_ram(ctx: _Context) -> List[CheckLine]:
    total, avail, source = ram_bytes(_import_module)
    if total is None:
        return [CheckLine("ram", "OK", "total RAM unknown (no psutil, /proc/meminfo or sysconf)")]
    detail = f"{gib(total)} total"
    if avail is not None:
        detail += f", {gib(avail)} available"
    limit = cgroup_limit()
    if limit is not None and limit < total:
        detail += f", container limit {gib(limit)}"
    detail += f" (via {source})"
    return [CheckLine("ram", "OK", detail)]


def _check_torch(ctx: _Context) -> List[CheckLine]:
    try:
        torch = _import_module("torch")
    except Exception as e:
        installed = _dist_version("torch")
        if installed:
            detail = f"torch {installed} is installed but importing it failed: {exc_text(e)}"
        else:
            detail = f"not importable ({exc_text(e)}); install it: https://pytorch.org/get-started/locally/"
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
    if vt and vt[:2] < MINIMUMS["torch"]:
        status = "WARN"
        detail += f"; memlab needs torch>={'.'.join(map(str, MINIMUMS['torch']))}"
    try:
        ctx.cuda = bool(torch.cuda.is_available())
        ctx.cuda_count = int(torch.cuda.device_count()) if ctx.cuda else 0
    except Exception as e:
        ctx.cuda = False
        detail += f"; torch.cuda.is_available() raised {exc_text(e)}"
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
                detail += f", {gib(total)} total, {gib(free)} free"
                used = total - free
                if total and used > 0.2 * total:
                    status = "WARN"
                    detail += (
                        f"; {gib(used)} already in use (other processes or notebooks?): "
                        "close them before measuring memory"
                    )
            except Exception as e:
                detail += f", {gib(props.total_memory)} total, free memory unknown ({exc_text(e)})"
                status = "WARN"
        except Exception as e:
            status, detail = "WARN", f"cuda:{i}: could not query the device ({exc_text(e)})"
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
            return [CheckLine("bf16", "WARN", f"torch.cuda.is_bf16_supported() raised {exc_text(e)}")]
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
        return [CheckLine("bf16", "WARN", f"a bf16 matmul failed on CPU: {exc_text(e)}")]
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
    command that installs it; ``minimum`` defaults to the package's entry in ``MINIMUMS``."""
    dist = dist or name
    minimum = minimum or MINIMUMS.get(dist)
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
        return CheckLine(name, "WARN", f"could not check ({exc_text(e)}): {why}")


def _check_transformers(ctx: _Context) -> List[CheckLine]:
    return [
        _package_line(
            "transformers",
            "needed for tiny_llama and the model presets (chapters 00-08)",
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
    with capture_output() as cap:
        try:
            bnb = _import_module("bitsandbytes")
        except Exception as e:  # bitsandbytes raises on broken CUDA setups
            error = e
    printed = first_line(cap.text)
    if bnb is None:
        detail = f"{label} is installed but importing it failed: {exc_text(error) if error else 'unknown error'}"
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
        return [CheckLine("memlab", "FAIL", f"not importable ({exc_text(e)}); run `pip install -e ./utils`")]
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


def _env_parts() -> List[str]:
    parts = []
    for var in ("MEMLAB_DEVICE", "MEMLAB_SMALL"):
        raw = os.environ.get(var)
        if raw is not None:
            parts.append(f"{var}={raw.strip()}" if raw.strip() else f"{var}= (empty: automatic)")
    return parts


def _check_env(ctx: _Context) -> List[CheckLine]:
    """MEMLAB_DEVICE / MEMLAB_SMALL, read by the functions ``memlab.config`` uses
    (:func:`memlab.core.env.read_env`): a value they reject makes ``import memlab.config`` raise, hence FAIL."""
    parts = _env_parts()
    detail = ", ".join(parts) if parts else "MEMLAB_DEVICE and MEMLAB_SMALL not set"
    if ctx.torch is None:
        return [CheckLine("env", "WARN", f"{detail} (not checked: torch is not importable)")]
    try:
        from memlab.core.env import read_env

        dev, small = read_env(cuda_available=ctx.cuda)
    except ValueError as e:
        return [CheckLine("env", "FAIL", f"{detail}; {e}")]
    except Exception as e:  # torch broken in a way its import did not show
        return [CheckLine("env", "WARN", f"{detail}; the variables could not be read: {exc_text(e)}")]
    detail += f" (course runs on {dev.type}, {'small' if small else 'full'} scale)"
    name = os.environ.get("MEMLAB_DEVICE", "").strip()
    if dev.type == "cuda" and dev.index is not None and dev.index >= ctx.cuda_count:
        return [CheckLine("env", "WARN", f"{detail}; MEMLAB_DEVICE={name!r} but only {ctx.cuda_count} GPU(s) are visible")]
    if dev.type not in ("cpu", "cuda"):
        return [CheckLine("env", "WARN", f"{detail}; MEMLAB_DEVICE={name!r}: the course is written for 'cpu' and 'cuda'")]
    return [CheckLine("env", "OK", detail)]


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
    ``gpu`` lines on multi-GPU machines), in the report's order. Never raises: a check that crashes
    becomes a WARN.
    """
    ctx = _Context()
    lines: List[CheckLine] = []
    for name, check in _CHECKS:
        try:
            lines.extend(check(ctx))
        except Exception as e:  # a bug in the doctor must not hide the rest of the report
            lines.append(CheckLine(name, "WARN", f"the doctor's {name} check crashed: {exc_text(e)}"))
    return lines


