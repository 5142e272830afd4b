"""Take a GPU session's packed results (results.tgz.NN from tools/gpu_session.py) into the repository.

    python3 tools/gpu_import.py /work/.device/<files_at>/          # a folder holding results.tgz.00, .01, ...
    python3 tools/gpu_import.py results.tgz.00 results.tgz.01 --dry-run

Where things go (``--root`` the repository, default this checkout):
  notebooks/NN_*.ipynb          executed lectures whose step finished ('ok'); a timed-out or failed one is
                                 left under results/<gpu>/<date>/partial/ instead (--partial takes it anyway)
  results/<gpu>/<date>/          summary.json and every step's log (<gpu>: h100, h200, ... from the env log)
  tests/fixtures/snapshots/<gpu>/ CUDA memory snapshots (*.pickle), the OOM post-mortem fixtures
"""
from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chunks(paths: list[Path]) -> list[Path]:
    """The results.tgz.NN files named or held in ``paths``, in order; an error names a gap or an absence."""
    found: list[Path] = []
    for p in paths:
        found += sorted(p.glob("results.tgz.[0-9][0-9]")) if p.is_dir() else [p]
    if not found:
        raise SystemExit(f"gpu_import: no results.tgz.NN in {[str(p) for p in paths]}")
    found.sort(key=lambda f: f.name)
    idx = [int(f.name.rsplit(".", 1)[1]) for f in found]
    if idx != list(range(len(found))):
        raise SystemExit(f"gpu_import: chunks {[f.name for f in found]}: expected results.tgz.00 .. "
                         f"results.tgz.{len(found) - 1:02d} with none missing")
    return found


def gpu_tag(text: str) -> str:
    """'h100', 'h200', 'a100', ... from nvidia-smi / memlab doctor output; 'gpu' when no known name is there."""
    m = re.search(r"\b(H100|H200|A100|A10G|L40S|L4|RTX ?\d{4}|V100|T4|GH200|B200)\b", text, re.I)
    return m.group(1).replace(" ", "").lower() if m else "gpu"


def import_results(paths: list[Path], root: Path = ROOT, gpu: str | None = None, date: str | None = None,
                   partial: bool = False, dry_run: bool = False) -> list[tuple[str, str]]:
    """Unpack the chunks and copy their files into ``root``; returns (archive member, destination) pairs."""
    blob = b"".join(f.read_bytes() for f in chunks(paths))
    tar = tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz")
    members = {m.name: m for m in tar.getmembers() if m.isfile()}
    for name in members:
        if name.startswith("/") or ".." in Path(name).parts:
            raise SystemExit(f"gpu_import: unsafe path {name!r} in the archive")
    read = lambda n: tar.extractfile(members[n]).read()  # noqa: E731
    summary = json.loads(read("summary.json")) if "summary.json" in members else {"steps": []}
    env_text = read("logs/env.log").decode(errors="replace") if "logs/env.log" in members else ""
    gpu = gpu or gpu_tag(env_text)
    date = date or str(summary.get("started", "unknown"))[:10]
    status = {s["step"]: s.get("status", "") for s in summary.get("steps", [])}
    dest_dir = root / "results" / gpu / date
    moves: list[tuple[str, str]] = []
    for name in sorted(members):
        p = Path(name)
        if p.parts[0] == "notebooks" and p.suffix == ".ipynb":
            ok = status.get(f"lecture_{p.stem}") == "ok"
            dest = root / "notebooks" / p.name if ok or partial else dest_dir / "partial" / p.name
        elif p.parts[0] == "snapshots":
            dest = root / "tests" / "fixtures" / "snapshots" / gpu / p.name
        elif p.parts[0] == "logs" and p.suffix == ".pid":
            continue
        else:
            dest = dest_dir / Path(*p.parts[1:]) if p.parts[0] == "logs" else dest_dir / p
        moves.append((name, str(dest.relative_to(root))))
        if not dry_run:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(members[name]) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return moves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path, help="results.tgz.NN files, or folders holding them")
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--gpu", default=None, help="results/<gpu>/: default read from the env log (h100, h200, ...)")
    ap.add_argument("--date", default=None, help="results/<gpu>/<date>/: default the session's start date")
    ap.add_argument("--partial", action="store_true", help="take timed-out or failed notebooks into notebooks/ too")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    moves = import_results(args.paths, args.root, args.gpu, args.date, args.partial, args.dry_run)
    for src, dst in moves:
        print(f"{'would copy' if args.dry_run else 'copied'} {src} -> {dst}")
    nbs = [d for _, d in moves if d.startswith("notebooks/")]
    if nbs and not args.dry_run:
        print("then: python tools/clean_outputs.py " + " ".join(nbs) + "; python tools/render_results.py --check"
              "   (review git diff; a GPU figure worth a results row goes into results/recorded.json by hand)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
