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

ROOT = Path(__file__).resolve().parents[2]
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


def _dry_run(target: str, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run([MAKE, "-n", "-C", str(ROOT), target, *extra], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_lab_roots_jupyterlab_at_the_repository_with_venv_on_path(tmp_path):
    """``make lab``: lectures and labs side by side (root = the repository, not work/), opened on
    the start page, .venv/bin first on the server's PATH (its terminals find ``memlab``) and a plain
    shell in its terminals (a login shell's /etc/profile may reset PATH)."""
    stamp = tmp_path / "stamp"
    stamp.touch()  # set-up done: the dry run shows only the lab's own commands
    out = _dry_run("lab", f"STAMP={stamp}")
    line = next(ln for ln in out.splitlines() if "jupyter lab" in ln)
    assert f'--ServerApp.root_dir="{ROOT}"' in line, line
    assert "root_dir=work" not in line
    assert f'PATH="{ROOT}/.venv/bin:$PATH"' in line, line
    # the start page, the file browser kept at the root (a /lab/tree URL alone moves it into docs/)
    assert "--LabApp.default_url='/lab/tree/docs/start.md?file-browser-path=/'" in line
    assert (ROOT / "docs" / "start.md").is_file()
    assert 'shell_command="${SHELL:-/bin/sh}"' in line
    assert "--ServerApp.answer_yes=True" in line  # one Ctrl-C stops it (the y/n prompt would be hidden by the filter)
    assert f'--LabApp.app_settings_dir="{ROOT}/.jupyter/lab/settings"' in line
    assert "memlab labs start" in out  # the learner's copies are made first (never overwriting)


def test_make_lab_prints_only_the_url(tmp_path):
    """The filter the recipe pipes JupyterLab's banner through keeps its first URL and later warnings."""
    stamp = tmp_path / "stamp"
    stamp.touch()
    out = _dry_run("lab", f"STAMP={stamp}")
    pipeline = next(ln for ln in out.splitlines() if "jupyter lab" in ln)
    filt = pipeline.split("2>&1 | ", 1)[1].rstrip(" \\").rstrip(";")  # the filter's subshell, not the line after
    banner = (
        "No web browser found: Error('could not locate runnable browser').\n\n    \n"
        "    To access the server, open this file in a browser:\n"
        "        file:///root/.local/share/jupyter/runtime/jpserver-1-open.html\n"
        "    Or copy and paste one of these URLs:\n"
        "        http://127.0.0.1:8888/lab/tree/docs/start.md?file-browser-path=/?token=abc123\n"
        "        http://localhost:8888/lab/tree/docs/start.md?file-browser-path=/?token=abc123\n"
        "Notebook notebooks/00_where_the_memory_goes.ipynb is not trusted\n"
        "[IPKernelApp] WARNING | Kernel is running over TCP without encryption. All communication ...\n"
        "The websocket_ping_timeout (90000) cannot be longer than the websocket_ping_interval (30000).\n"
        "    Setting websocket_ping_timeout=30000\n"
        "Kernel restarted: something worth seeing\n"
    )
    proc = subprocess.run(["sh", "-c", filt], input=banner, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "JupyterLab (Ctrl-C to stop): http://127.0.0.1:8888/lab/tree/docs/start.md?file-browser-path=/&token=abc123",
        "Kernel restarted: something worth seeing",
    ]


@pytest.mark.parametrize("lab", ["xx", "²", "99"])
def test_make_grade_with_a_bad_lab_says_the_allowed_chapters(tmp_path, lab):
    """``make grade LAB=xx``: one line from memlab naming the value and the chapters there are, no
    table, no traceback; make exits 2 (its own ``Error 2`` line follows memlab's)."""
    stamp = tmp_path / "stamp"
    stamp.touch()  # set-up done
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run([MAKE, "-s", "--no-print-directory", "-C", str(ROOT), "grade", f"LAB={lab}", f"STAMP={stamp}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    memlab_lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("make")]
    assert len(memlab_lines) == 1 and repr(lab) in memlab_lines[0], proc.stderr
    assert "allowed: 00, 01, 02" in memlab_lines[0] and "invalid literal" not in memlab_lines[0], proc.stderr
