"""``memlab bench explain``: what ``memlab explain`` costs on a large CUDA memory snapshot.

The bench writes a synthetic snapshot of ``--size-mb`` megabytes (default 100) in a temporary folder, in the layout
of ``torch.cuda.memory._snapshot()`` that PyTorch's own reader (``torch/cuda/_memory_viz.py``) takes: segments whose
blocks tile them (``active_allocated`` or ``inactive``), and a device trace of ``segment_alloc``, ``alloc``,
``free_requested`` and ``free_completed`` events, each with a Python stack of eight frames, as
``_record_memory_history(stacks="python")`` records. Its allocations are drawn with a fixed seed: sizes from 512 bytes
to 64 MiB (most small, as a training step's), a quarter of the allocations still live at the end, one in three freed
soon after. The command ``memlab explain FILE`` then runs in a fresh interpreter (``memlab.cli.main``); the
process's wall time (interpreter start and imports included) and its peak resident memory (``ru_maxrss`` of
``resource.getrusage``, read in that process) are compared with the targets: under 10 s and under 2 GB.
``--small`` (a 2 MB snapshot) checks the bench itself cheaply; its verdicts say nothing about the target.
"""
from __future__ import annotations

import argparse
import json
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlab.bench import add_strict, device_name, load_average, report_targets, table
from memlab.core.units import GB, MiB

MB = 10**6

TIME_TARGET_S = 10.0
RSS_TARGET_BYTES = 2 * GB
_SEGMENT = 2 * 1024 * MiB  # one segment holds many blocks; a block never straddles two

_CHILD = r"""
import io, json, resource, sys, time, contextlib
t0 = time.perf_counter()
from memlab.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["explain", sys.argv[1]])
t1 = time.perf_counter()
text = out.getvalue()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps(dict(code=code, seconds=t1 - t0, maxrss_kb=ru.ru_maxrss, cpu_s=ru.ru_utime + ru.ru_stime,
                      head=text.splitlines()[:2])))
"""

_FILES = ["/usr/lib/python3/site-packages/torch/nn/modules/module.py", "/srv/train/model/modeling_llama.py",
          "/usr/lib/python3/site-packages/torch/autograd/graph.py",
          "/usr/lib/python3/site-packages/torch/optim/adamw.py",
          "/srv/train/train.py", "/usr/lib/python3/site-packages/torch/nn/functional.py"]
_NAMES = ["forward", "_call_impl", "_wrapped_call_impl", "backward", "_engine_run_backward", "step", "main", "linear"]


def _frames(rng: random.Random) -> list[dict]:
    return [{"filename": rng.choice(_FILES), "line": rng.randrange(1, 2000), "name": rng.choice(_NAMES)}
            for _ in range(8)]


def _size(rng: random.Random) -> int:
    r = rng.random()
    n = rng.randrange(1, 2048) * 512 if r < 0.7 else rng.randrange(1, 64) * MiB if r < 0.98 else 64 * MiB
    return n


def _events(rng: random.Random, live: dict[int, tuple[int, list[dict]]], segments: list[int]):
    """The trace, event by event: allocations bumped through segments of :data:`_SEGMENT` bytes (never reused),
    three quarters of them freed soon after in random order; ``live`` and ``segments`` follow it."""
    recent: list[int] = []
    cursor = end = 0
    n = 0
    while True:
        if recent and (rng.random() < 0.33 or len(live) > 2000):
            addr = recent.pop(rng.randrange(len(recent)))
            size, _ = live.pop(addr)
            fr = _frames(rng)
            for action in ("free_requested", "free_completed"):
                n += 1
                yield {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": n, "frames": fr}
            continue
        size = _size(rng)
        if cursor + size > end:  # a new segment
            base = 0x7F0000000000 + len(segments) * _SEGMENT
            segments.append(base)
            n += 1
            yield {"action": "segment_alloc", "addr": base, "size": _SEGMENT, "stream": 0, "time_us": n,
                   "frames": _frames(rng)}
            cursor, end = base, base + _SEGMENT
        fr = _frames(rng)
        live[cursor] = (size, fr)
        if rng.random() < 0.75:
            recent.append(cursor)
        n += 1
        yield {"action": "alloc", "addr": cursor, "size": size, "stream": 0, "time_us": n, "frames": fr}
        cursor += size


def synthetic_snapshot(target_bytes: int, seed: int = 0) -> dict:
    """A snapshot dict of about ``target_bytes`` pickled: its trace grows until the pickle reaches it (the bytes an
    event takes measured on the first thousand, the pickle's string memo included)."""
    rng = random.Random(seed)
    live: dict[int, tuple[int, list[dict]]] = {}  # address -> (size, frames of its alloc)
    segments: list[int] = []  # segment base addresses
    gen = _events(rng, live, segments)
    trace = [next(gen) for _ in range(1000)]
    per_event = len(pickle.dumps(trace)) / len(trace)
    while len(trace) * per_event < target_bytes:
        trace.append(next(gen))
    segs = []
    by_segment: dict[int, list[int]] = {}
    for addr in sorted(live):
        by_segment.setdefault(segments[(addr - 0x7F0000000000) // _SEGMENT], []).append(addr)
    for base in segments:
        blocks, at = [], base
        for addr in by_segment.get(base, []):
            if addr > at:
                blocks.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive"})
            size, fr = live[addr]
            blocks.append({"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                           "frames": fr})
            at = addr + size
        if at < base + _SEGMENT:
            blocks.append({"address": at, "size": base + _SEGMENT - at, "requested_size": 0, "state": "inactive"})
        alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segs.append({"device": 0, "address": base, "total_size": _SEGMENT, "allocated_size": alloc,
                     "active_size": alloc, "requested_size": alloc, "stream": 0, "segment_type": "large",
                     "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks})
    return {"segments": segs, "device_traces": [trace]}


def run(size_bytes: int, seed: int = 0) -> dict:
    """Write the snapshot, run ``memlab explain`` on it in a fresh process; the figures as a dict."""
    with tempfile.TemporaryDirectory(prefix="memlab-bench-explain-") as tmp:
        path = Path(tmp) / "snapshot.pickle"
        t0 = time.perf_counter()
        snap = synthetic_snapshot(size_bytes, seed)
        path.write_bytes(pickle.dumps(snap))
        made = time.perf_counter() - t0
        n_events, n_segments = len(snap["device_traces"][0]), len(snap["segments"])
        del snap
        nbytes = path.stat().st_size
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"memlab explain failed:\n{proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if r["code"] != 0:
        raise RuntimeError(f"memlab explain exited {r['code']}")
    return dict(file_bytes=nbytes, events=n_events, segments=n_segments, build_s=made, command_s=r["seconds"],
                process_s=wall, cpu_s=r["cpu_s"], maxrss_bytes=r["maxrss_kb"] * 1024, head=r["head"])


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print its table and a TARGET MET / TARGET MISSED line per target; exit code 0, or 1 with
    ``--strict`` when a target is missed."""
    p = argparse.ArgumentParser(prog="memlab bench explain", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=100.0, help="the snapshot's size in MB (default 100)")
    p.add_argument("--small", action="store_true", help="a 2 MB snapshot: checks the bench, not the target")
    p.add_argument("--seed", type=int, default=0)
    add_strict(p)
    args = p.parse_args(list(argv or []))
    if args.size_mb <= 0:
        p.error(f"--size-mb={args.size_mb:g} must be > 0")
    size = int((2.0 if args.small else args.size_mb) * MB)
    r = run(size, args.seed)
    print(table(f"memlab explain on a synthetic CUDA memory snapshot of {r['file_bytes'] / MB:.1f} MB "
                f"({r['events']:,} trace events with 8 frames each, {r['segments']} segments), a fresh process",
                ("quantity", "value"),
                [("snapshot (MB)", r["file_bytes"] / MB), ("building and writing it (s)", r["build_s"]),
                 ("memlab explain: in-process, imports included (s)", r["command_s"]),
                 ("memlab explain: process wall time (s)", r["process_s"]),
                 ("memlab explain: process CPU time, user + sys (s)", r["cpu_s"]),
                 ("peak RSS of that process (GB)", r["maxrss_bytes"] / GB)], device="cpu"))
    print("its first lines: " + " | ".join(r["head"]))
    scale = ("" if r["file_bytes"] >= 100 * MB else
             f" [a {r['file_bytes'] / MB:.1f} MB snapshot: the target is for 100 MB]")
    checks = [(f"memlab explain {r['process_s']:.1f} s (target < {TIME_TARGET_S:g} s, process wall time){scale}",
               r["process_s"] / TIME_TARGET_S, r["process_s"] < TIME_TARGET_S),
              (f"peak RSS {r['maxrss_bytes'] / GB:.2f} GB (target < {RSS_TARGET_BYTES / GB:g} GB){scale}",
               r["maxrss_bytes"] / RSS_TARGET_BYTES, r["maxrss_bytes"] < RSS_TARGET_BYTES)]
    code = report_targets(checks, "cpu", strict=args.strict)
    print(f"host: {device_name('cpu')}; load average {load_average()} (a busy host stretches the wall time past the CPU "
          f"time)")
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
