"""Fill .whl/ (git-ignored; carried to a lent GPU machine) with the wheels the device image lacks.

The image (Python 3.12, x86_64; its package list: /work/.library/device/KINDS.md) has torch, transformers,
peft, accelerate, matplotlib, pytest, psutil, jinja2, pygments, attrs, but not bitsandbytes, nbclient,
ipykernel or nbval, nor their own needs below. Each is fetched with --no-deps at the version this
checkout's environment holds (the one the tests ran with), so the device runs the same code.

    python3 tools/fetch_wheels.py             # download into .whl/ (network: the package registry)
    python3 tools/fetch_wheels.py --dry-run   # print the pip commands only
    python3 tools/fetch_wheels.py --check     # which required wheels .whl/ lacks (exit 1 if any)
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from gpu_session import check_wheels, missing_wheel_line, wheel_dist  # noqa: E402

# the four the session needs, then their requirements that the image does not have (Requires-Dist, read
# from each wheel's METADATA; the image's own packages left out). jedi (+parso) and debugpy are left out on
# purpose: IPython and ipykernel import them only when present (completion, the debugger), and their 10 MiB
# would push the carried tree (checkout + .whl) past the 64 MiB limit; a kernel without them was run with
# nbclient on Python 3.12 before the 2026-11-28 lease. liger_kernel and cut-cross-entropy are chapter 09's
# peers (bench loss, tests/ch09), pure Python.
PACKAGES = [
    "bitsandbytes", "nbclient", "ipykernel", "nbval",
    "nbformat", "jupyter_client", "jupyter_core", "traitlets", "fastjsonschema", "jsonschema",
    "jsonschema-specifications", "referencing", "rpds-py", "pyzmq", "tornado", "comm",
    "ipython", "ipython_pygments_lexers", "decorator", "matplotlib-inline", "prompt_toolkit",
    "wcwidth", "stack_data", "asttokens", "executing", "pure_eval", "pexpect", "ptyprocess", "nest_asyncio",
    "platformdirs", "liger_kernel", "cut-cross-entropy",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
CARRY_LIMIT_MIB = 64


def pinned(name: str) -> str:
    try:
        return f"{name}=={md.version(name)}"
    except md.PackageNotFoundError:
        return name


def pip_command(spec: str, dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(dest), spec]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        missing = check_wheels(args.dest)
        print(missing_wheel_line(missing, args.dest) if missing else f"every required wheel is in {args.dest}/")
        return 1 if missing else 0
    args.dest.mkdir(exist_ok=True)
    failed = []
    for name in PACKAGES:
        spec = pinned(name)
        cmd = pip_command(spec, args.dest)
        if args.dry_run:
            print(" ".join(cmd))
            continue
        if subprocess.call(cmd) != 0:
            failed.append(spec)
    if args.dry_run:
        return 0
    dists = {}
    for f in sorted(args.dest.glob("*.whl")):  # one version of each: two stop pip's offline install
        dists.setdefault(wheel_dist(f.name), []).append(f)
    for name, files in dists.items():
        if len(files) > 1:
            print(f"two versions of {name} in {args.dest}: {[f.name for f in files]}; keep one")
    size = sum(f.stat().st_size for f in args.dest.glob("*.whl")) / 2**20
    print(f"{len(dists)} wheels, {size:.1f} MiB in {args.dest}/ (the carried tree's limit is {CARRY_LIMIT_MIB} MiB, "
          f"the checkout included)")
    if failed:
        print(f"pip download failed for: {', '.join(failed)}")
    missing = check_wheels(args.dest)
    if missing:
        print(missing_wheel_line(missing, args.dest))
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
