"""Tests for ``memlab doctor`` (memlab/course/doctor/): real runs in this environment plus simulated
missing or broken packages."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

try:
    import memlab  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e ./utils`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "utils"))

import torch

import memlab
import memlab.config  # noqa: F401 - imported before the tests set MEMLAB_DEVICE, as in a session
from memlab.course import doctor
from memlab.course.doctor import checks as dchecks
from memlab.course.doctor import probes

EXPECTED_NAMES = {
    "python",
    "platform",
    "cpu",
    "ram",
    "torch",
    "gpu",
    "bf16",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "matplotlib",
    "jupyterlab",
    "ipywidgets",
    "nbclient",
    "ipykernel",
    "memlab",
    "env",
}

LINE_RE = re.compile(r"^\[(?: OK |WARN|FAIL)\] (\S+)\s+(.*)$")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("MEMLAB_DEVICE", raising=False)
    monkeypatch.delenv("MEMLAB_SMALL", raising=False)


def _by_name(lines):
    return {line.name: line for line in lines}


def _fake_import(monkeypatch, broken: dict):
    """Make dchecks._import_module raise broken[name] (an exception instance) for those names."""
    real = dchecks._import_module

    def fake(name):
        if name in broken:
            raise broken[name]
        return real(name)

    monkeypatch.setattr(dchecks, "_import_module", fake)


# ------------------------------------------------------------------ real runs in this environment


def test_main_text_report(capsys):
    code = doctor.main([])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[0] == "memlab doctor"
    assert lines[-2].startswith("memlab core can run")  # two verdicts: the core, then the course
    assert lines[-1].startswith("the course can run")
    body = lines[1:-2]
    assert body and all(LINE_RE.match(line) for line in body), body
    torch_lines = [line for line in body if LINE_RE.match(line).group(1) == "torch"]
    assert len(torch_lines) == 1
    assert torch_lines[0].startswith("[ OK ] torch")
    assert torch.__version__ in torch_lines[0]
    # the detail column is aligned
    starts = {len(line) - len(LINE_RE.match(line).group(2)) for line in body}
    assert len(starts) == 1, body
    names = {LINE_RE.match(line).group(1) for line in body}
    assert EXPECTED_NAMES <= names


def test_main_json(capsys):
    code = doctor.main(["--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 == payload["exit_code"]
    names = [c["name"] for c in payload["checks"]]
    assert EXPECTED_NAMES <= set(names)
    assert len(names) == len(set(names))
    assert all(c["status"] in doctor.STATUSES for c in payload["checks"])
    assert all(isinstance(c["detail"], str) and c["detail"] for c in payload["checks"])
    assert payload["failures"] == 0
    assert payload["warnings"] == sum(c["status"] == "WARN" for c in payload["checks"])
    assert payload["summary"].startswith("the course can run")
    by_name = {c["name"]: c for c in payload["checks"]}
    assert by_name["torch"]["detail"].startswith(torch.__version__)
    assert by_name["transformers"]["detail"] == importlib.metadata.version("transformers")


def test_run_checks_types_and_gpu_line():
    lines = doctor.run_checks()
    assert all(isinstance(line, doctor.CheckLine) for line in lines)
    by = _by_name(lines)
    assert by["python"].status == "OK"  # this venv runs Python >= 3.10
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0) in by["gpu"].detail
        assert "compute capability" in by["gpu"].detail and "free" in by["gpu"].detail
    else:
        assert by["gpu"].status == "WARN"  # no GPU is a warning, not a failure
        assert "no CUDA GPU: the course runs at small scale on CPU" in by["gpu"].detail
        assert by["bf16"].status == "OK"  # a bf16 matmul runs on any recent CPU build
    assert "backend" in by["bitsandbytes"].detail
    assert by["memlab"].detail.startswith(memlab.__version__)


def test_checkline_rejects_unknown_status():
    with pytest.raises(ValueError):
        doctor.CheckLine("x", "MAYBE", "")


@pytest.mark.parametrize(
    "version, status",
    [((3, 8, 10), "FAIL"), ((3, 9, 18), "WARN"), ((3, 10, 0), "OK"), ((3, 13, 1), "OK")],
)
def test_python_thresholds(version, status):
    assert dchecks._python_status(version) == status


# ------------------------------------------------------------------ simulated missing packages


def test_missing_peft_metadata_and_module_is_warn(monkeypatch, capsys):
    real_version = importlib.metadata.version
    real_find_spec = importlib.util.find_spec

    def version(dist):
        if dist == "peft":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    def find_spec(name, *args, **kwargs):
        if name == "peft":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    by = _by_name(doctor.run_checks())
    assert by["peft"].status == "WARN"
    assert "not installed" in by["peft"].detail and "chapter 06" in by["peft"].detail
    assert by["transformers"].status == "OK"  # the others are untouched

    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\[WARN\] peft\s+not installed", out, re.M), out
    assert "the course can run" in out


def test_peft_without_metadata_but_importable_is_warn(monkeypatch):
    real_version = importlib.metadata.version

    def version(dist):
        if dist == "peft":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    line = _by_name(doctor.run_checks())["peft"]
    assert line.status == "WARN" and "not pip-installed" in line.detail


def _without_package(monkeypatch, name: str) -> None:
    """Make the doctor see package ``name`` as not installed (no metadata, not importable)."""
    real_version = importlib.metadata.version
    real_find_spec = importlib.util.find_spec

    def version(dist):
        if dist == name:
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    def find_spec(module, *args, **kwargs):
        return None if module == name else real_find_spec(module, *args, **kwargs)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize(
    "package, extra",
    [("transformers", "hf"), ("nbclient", "grade"), ("ipykernel", "grade")],
)
def test_course_package_missing_is_memlab_core_only(monkeypatch, capsys, package, extra):
    """Without a package the notebooks or the grader import, memlab's core still runs but the
    course does not: the report says both, names the extra, and exits 1."""
    _without_package(monkeypatch, package)
    code = doctor.main([])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(rf"^\[FAIL\] {package}\s+not installed: .*pip install 'memlab\[{extra}\]'", out, re.M), out
    verdicts = out.strip().splitlines()[-2:]
    assert verdicts[0].startswith("memlab core can run"), verdicts
    assert verdicts[1].startswith("the course cannot run") and "memlab core only" in verdicts[1], verdicts

    assert doctor.main(["--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["core_can_run"] is True and payload["course_can_run"] is False


def test_core_verdict_names_the_failing_core_line(monkeypatch, capsys):
    _fake_import(monkeypatch, {"torch": ImportError("No module named 'torch'")})
    assert doctor.main([]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == "memlab core cannot run: fix the FAIL lines of torch"
    assert "memlab core only" not in lines[-1]


def test_too_old_transformers_is_warn(monkeypatch):
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda d: "4.30.2" if d == "transformers" else real_version(d)
    )
    line = _by_name(doctor.run_checks())["transformers"]
    assert line.status == "WARN" and "4.30.2" in line.detail and ">=5.16" in line.detail


def test_broken_bitsandbytes_import_is_contained(monkeypatch, capfd):
    """An import that prints at Python and C level, then raises, becomes one WARN line."""
    real = dchecks._import_module

    def fake(name):
        if name == "bitsandbytes":
            print("NOISE-STDOUT from bitsandbytes")
            sys.stderr.write("NOISE-STDERR from bitsandbytes\n")
            os.write(2, b"NOISE-FD2 from the native library\n")
            raise RuntimeError("CUDA Setup failed despite GPU being available")
        return real(name)

    monkeypatch.setattr(dchecks, "_import_module", fake)
    capfd.readouterr()
    lines = doctor.run_checks()
    leaked = capfd.readouterr()
    assert "NOISE" not in leaked.out and "NOISE" not in leaked.err
    line = _by_name(lines)["bitsandbytes"]
    assert line.status == "WARN"
    assert "CUDA Setup failed" in line.detail and "chapter 06" in line.detail
    assert "NOISE-STDOUT" in line.detail  # what it printed is kept for the bug report
    assert doctor.exit_code(lines) == 0


def test_bitsandbytes_without_native_cuda_library_on_gpu_is_warn(monkeypatch):
    """On a CUDA machine, a bitsandbytes whose native library failed to load is flagged."""
    cext = types.SimpleNamespace(BNB_BACKEND="CUDA", lib=type("ErrorHandlerMockBNBNativeLibrary", (), {})())
    fake_bnb = types.SimpleNamespace(__version__="0.50.2")
    real = dchecks._import_module

    def fake(name):
        if name == "bitsandbytes":
            return fake_bnb
        if name == "bitsandbytes.cextension":
            return cext
        return real(name)

    monkeypatch.setattr(dchecks, "_import_module", fake)
    monkeypatch.delitem(sys.modules, "bitsandbytes.cextension", raising=False)
    ctx = dchecks._Context()
    ctx.torch, ctx.cuda, ctx.cuda_count = torch, True, 1
    (line,) = dchecks._check_bitsandbytes(ctx)
    assert line.status == "WARN" and "CUDA backend" in line.detail and "no native library" in line.detail


def test_missing_torch_is_fail(monkeypatch, capsys):
    _fake_import(monkeypatch, {"torch": ImportError("No module named 'torch'")})
    code = doctor.main([])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"^\[FAIL\] torch\s+.*No module named 'torch'", out, re.M), out
    assert out.strip().splitlines()[-1].startswith("the course cannot run: fix the FAIL lines")
    # the checks that need torch degrade to warnings instead of crashing
    assert re.search(r"^\[WARN\] gpu\s+not checked", out, re.M)
    assert re.search(r"^\[WARN\] bf16\s+not checked", out, re.M)
    assert re.search(r"^\[WARN\] bitsandbytes\s+.*torch is not importable", out, re.M)
    assert "crashed" not in out

    assert doctor.main(["--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["exit_code"] == 1 and payload["failures"] == 1


def test_a_crashing_check_does_not_stop_the_report(monkeypatch):
    def boom(ctx):
        raise ZeroDivisionError("bug")

    checks = [(n, boom if n == "ram" else f) for n, f in dchecks._CHECKS]
    monkeypatch.setattr(dchecks, "_CHECKS", checks)
    by = _by_name(doctor.run_checks())
    assert by["ram"].status == "WARN" and "crashed" in by["ram"].detail
    assert by["torch"].status == "OK" and by["env"].status == "OK"


def test_ram_without_psutil(monkeypatch):
    _fake_import(monkeypatch, {"psutil": ImportError("No module named 'psutil'")})
    total, avail, source = probes.ram_bytes(dchecks._import_module)
    if sys.platform.startswith("linux"):
        assert source == "/proc/meminfo" and total > 0 and 0 < avail <= total


# ------------------------------------------------------------------ environment variables


def test_env_variables_reported_and_validated(monkeypatch):
    monkeypatch.setenv("MEMLAB_SMALL", "1")
    monkeypatch.setenv("MEMLAB_DEVICE", "cpu")
    line = _by_name(doctor.run_checks())["env"]
    assert line.status == "OK"
    assert "MEMLAB_DEVICE=cpu" in line.detail and "MEMLAB_SMALL=1" in line.detail
    assert "small scale" in line.detail

    monkeypatch.setenv("MEMLAB_SMALL", "maybe")
    lines = doctor.run_checks()
    assert _by_name(lines)["env"].status == "FAIL"  # memlab.config would refuse to import
    assert doctor.exit_code(lines) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_gpu_is_fail(monkeypatch):
    monkeypatch.setenv("MEMLAB_DEVICE", "cuda")
    line = _by_name(doctor.run_checks())["env"]
    assert line.status == "FAIL" and "asks for CUDA" in line.detail  # memlab.config's own message


# ------------------------------------------------------------------ independent of the repo layout


def test_module_runs_from_an_empty_directory(tmp_path):
    env = dict(os.environ)
    env.pop("MEMLAB_DEVICE", None)
    env.pop("MEMLAB_SMALL", None)
    # works whether memlab is pip-installed or only importable through this checkout
    pkg_parent = str(Path(dchecks.__file__).resolve().parents[3])  # utils/, above memlab/course/doctor/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "memlab.course.doctor", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(proc.stdout)  # nothing but JSON on stdout
    assert EXPECTED_NAMES <= {c["name"] for c in payload["checks"]}
    assert list(tmp_path.iterdir()) == []  # writes nothing into the working directory


def test_main_from_an_empty_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert doctor.main([]) == 0
    assert "memlab doctor" in capsys.readouterr().out


# ------------------------------------------------------------------ the CUDA code paths, faked


def _fake_cuda_torch(free_gib=70.0, bf16=True):
    props = types.SimpleNamespace(name="NVIDIA Fake 80GB", major=9, minor=0, total_memory=80 * 2**30)

    def is_bf16_supported(including_emulation=True):
        return bf16

    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        get_device_properties=lambda i: props,
        mem_get_info=lambda i: (int(free_gib * 2**30), 80 * 2**30),
        is_bf16_supported=is_bf16_supported,
    )
    return types.SimpleNamespace(
        __version__="2.13.0+cu128",
        version=types.SimpleNamespace(cuda="12.8", hip=None),
        cuda=cuda,
        device=torch.device,
    )


def test_gpu_lines_with_a_fake_cuda_torch(monkeypatch):
    fake_torch = _fake_cuda_torch()
    _real = dchecks._import_module
    monkeypatch.setattr(dchecks, "_import_module", lambda n: fake_torch if n == "torch" else _real(n))
    ctx = dchecks._Context()
    (tline,) = dchecks._check_torch(ctx)
    assert tline == doctor.CheckLine("torch", "OK", "2.13.0+cu128 (CUDA 12.8 build)")
    assert ctx.cuda and ctx.cuda_count == 2
    gpu = dchecks._check_gpu(ctx)
    assert [g.name for g in gpu] == ["gpu", "gpu:1"]
    assert gpu[0].status == "OK"
    assert gpu[0].detail == "cuda:0 NVIDIA Fake 80GB, compute capability 9.0, 80.0 GiB total, 70.0 GiB free"
    assert dchecks._check_bf16(ctx)[0].status == "OK"

    monkeypatch.setenv("MEMLAB_DEVICE", "cuda:3")
    (env,) = dchecks._check_env(ctx)
    assert env.status == "WARN" and "only 2 GPU" in env.detail


def test_busy_gpu_and_no_bf16_are_warnings():
    ctx = dchecks._Context()
    ctx.torch, ctx.cuda, ctx.cuda_count = _fake_cuda_torch(free_gib=10.0, bf16=False), True, 1
    (gpu,) = dchecks._check_gpu(ctx)
    assert gpu.status == "WARN" and "already in use" in gpu.detail
    (bf16,) = dchecks._check_bf16(ctx)
    assert bf16.status == "WARN" and "8.0" in bf16.detail


def test_ipywidgets_line_says_what_it_is_for(monkeypatch):
    """Without ipywidgets a JupyterLab progress bar is text (and may warn 'IProgress not found'):
    a WARN naming the fix, never a FAIL (the course runs without it)."""
    monkeypatch.setattr(dchecks, "_dist_version", lambda dist: None if dist == "ipywidgets" else "1.0")
    monkeypatch.setattr(dchecks, "_module_location", lambda module: None)
    (line,) = dchecks._check_ipywidgets(None)
    assert line.status == "WARN" and "IProgress not found" in line.detail and "requirements.txt" in line.detail


def test_minimum_versions_are_those_of_pyproject():
    """The doctor's minimums are utils/pyproject.toml's lower bounds, every one of them."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "utils" / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [d for deps in project["optional-dependencies"].values() for d in deps]
    declared = {}
    for spec in specs:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", spec)
        assert m, f"{spec!r} has no lower bound"
        declared[m.group(1).lower()] = tuple(int(x) for x in m.group(2).split("."))
    assert doctor.MINIMUMS == declared


def test_too_old_peft_is_warn_with_pyproject_minimum(monkeypatch):
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.10.0" if d == "peft" else real_version(d))
    line = _by_name(doctor.run_checks())["peft"]
    assert line.status == "WARN" and ">=0.12" in line.detail


def test_old_path_is_the_new_package():
    import memlab.course.doctor as old

    assert old is doctor and old.main is doctor.main
