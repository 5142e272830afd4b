"""The Makefile's choice of torch, tested without downloading anything: ``make torch-cmd`` prints
the pip command that ``make setup`` would run, with ``nvidia-smi`` absent, present without a GPU,
and present with one (a stub script on PATH)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(MAKE is None, reason="needs GNU make")


def _stub(folder: Path, output: str, code: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '{output}'\nexit {code}\n")
    script.chmod(0o755)
    return folder


def _torch_cmd(path_dir: Path, venv: Path, *extra: str) -> str:
    """Run ``make -s torch-cmd`` with only ``path_dir`` on PATH, so a real nvidia-smi cannot answer."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX", "MAKEFLAGS", "MFLAGS")}
    env["PATH"] = str(path_dir)
    proc = subprocess.run(
        [MAKE, "-s", "-C", str(ROOT), "torch-cmd", f"VENV={venv}", *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def test_no_nvidia_smi_installs_the_cpu_build(tmp_path):
    venv = tmp_path / "venv"
    empty = tmp_path / "empty-path"
    empty.mkdir()
    assert _torch_cmd(empty, venv) == f"{venv}/bin/python -m pip install torch --index-url {CPU_INDEX}"


def test_nvidia_smi_without_a_gpu_installs_the_cpu_build(tmp_path):
    venv = tmp_path / "venv"
    stub = _stub(tmp_path / "bin", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9)
    assert _torch_cmd(stub, venv) == f"{venv}/bin/python -m pip install torch --index-url {CPU_INDEX}"


def test_nvidia_smi_listing_a_gpu_installs_the_cuda_build(tmp_path):
    venv = tmp_path / "venv"
    stub = _stub(tmp_path / "bin", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000)", 0)
    assert _torch_cmd(stub, venv) == f"{venv}/bin/python -m pip install torch"  # PyPI's default wheel is the CUDA build


def test_torch_index_overrides_the_choice(tmp_path):
    venv = tmp_path / "venv"
    stub = _stub(tmp_path / "bin", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000)", 0)
    index = "https://download.pytorch.org/whl/cu126"
    assert _torch_cmd(stub, venv, f"TORCH_INDEX={index}") == f"{venv}/bin/python -m pip install torch --index-url {index}"


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs to run inside a virtual environment")
def test_a_torch_already_in_the_venv_is_kept(tmp_path):
    stub = _stub(tmp_path / "bin", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000)", 0)
    assert _torch_cmd(stub, Path(sys.prefix)) == f"# torch is already in {sys.prefix}: kept"


def test_setup_installs_torch_before_the_requirements(tmp_path):
    """``make -n`` lists the set-up: a venv, then torch (a sub-make), then requirements.txt."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(
        [MAKE, "-n", "-C", str(ROOT), "setup", f"VENV={tmp_path / 'venv'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    venv_at, torch_at, req_at = out.find("-m venv"), out.find("torch"), out.find("pip install -r requirements.txt")
    assert -1 < venv_at < torch_at < req_at, out


def test_make_help_lists_every_target():
    text = (ROOT / "Makefile").read_text()
    phony = next(line for line in text.splitlines() if line.startswith(".PHONY:")).split()[1:]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run([MAKE, "-s", "-C", str(ROOT), "help"], env=env, capture_output=True, text=True, timeout=60)
    for target in ("lab", "test", "grade", "doctor", "estimate", "clean", "torch-cmd", "setup"):
        assert target in phony and f"make {target}" in proc.stdout, target
