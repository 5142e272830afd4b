"""`pip install ./utils` (not editable) builds in a temporary copy: nothing is written into the
checkout (no utils/build/, no utils/memlab.egg-info), and the wheel holds memlab only."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_wheel_build_leaves_the_source_folder_as_it_was(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "utils"
    shutil.copytree(ROOT / "utils", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = sorted(p.relative_to(src) for p in src.rglob("*") if "__pycache__" not in p.parts)
    assert after == [p for p in before if "__pycache__" not in p.parts], set(after) ^ set(before)
    (wheel,) = (tmp_path / "dist").glob("memlab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "memlab/profiler/timeline.py" in names and not any(n.startswith("_build") for n in names)
    # package data: the C++ source memlab.offload.kernel compiles on first use
    assert "memlab/offload/adamw.cpp" in names, sorted(n for n in names if n.startswith("memlab/offload/"))
    assert "memlab/quant/nf4.cpp" in names, sorted(n for n in names if n.startswith("memlab/quant/"))
