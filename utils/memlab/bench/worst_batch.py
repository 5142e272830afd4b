"""``memlab bench worst_batch``: what the worst batch of a data set costs (``memlab estimate --lengths``).

The bench draws ``--samples`` token counts (default 100,000; seeded) from a log-normal distribution (median 350
tokens, cut to 16 .. ``--max-len``, default 4096: the long tail of a chat data set), writes them as a ``.npy`` in a
temporary folder, and in a fresh process reads them (:func:`memlab.estimate.batches.read_lengths`), lays out one
shuffled epoch (``--batch-size``, ``--collator``) and traces its worst batch for ``--model`` (default the Llama-2-7B
preset; bf16, AdamW, gradient checkpointing) with :func:`memlab.estimate.batches.worst_batch`. The process's wall
time (interpreter start and imports included) is compared with the target: under 30 s for 100,000 lengths and a 7B
preset on 2 cores. ``--small`` (1,000 lengths of at most 128 tokens, the GPT-2 preset) checks the bench itself
cheaply; its verdict says nothing about the target.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlab.bench import add_strict, device_name, load_average, report_targets, table
from memlab.core.units import GB, GiB

TIME_TARGET_S = 30.0

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from memlab.estimate.batches import batch_shapes, read_lengths, worst_batch
a = json.loads(sys.argv[1])
t1 = time.perf_counter()
lengths = read_lengths(a["path"])
t2 = time.perf_counter()
shapes = batch_shapes(lengths, a["batch_size"], a["collator"], a["seed"])
t3 = time.perf_counter()
w = worst_batch(a["model"], lengths, a["batch_size"], a["collator"], a["seed"], dtype="bf16", optimizer="adamw",
                checkpointing=True)
t4 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, read_s=t2 - t1, shapes_s=t3 - t2, trace_s=t4 - t3, total_s=t4 - t0,
                      samples=len(lengths), batches=w.batches, distinct=len(w.shapes), traced=len(w.peaks),
                      shape=list(w.shape), index=w.index, peak=w.peak,
                      maxrss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      cpu_s=resource.getrusage(resource.RUSAGE_SELF).ru_utime
                      + resource.getrusage(resource.RUSAGE_SELF).ru_stime)))
"""


def lengths(samples: int, max_len: int, seed: int = 0) -> "numpy.ndarray":  # noqa: F821
    """``samples`` token counts, log-normal around 350 tokens, cut to 16 .. ``max_len`` (int32)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(350), 0.9, samples)), 16, max_len).astype(np.int32)


def run(samples: int, model: str, batch_size: int, collator: str, max_len: int, seed: int = 0) -> dict:
    """Write the lengths, run the worst batch in a fresh process; its figures as a dict."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="memlab-bench-worst-batch-") as tmp:
        path = Path(tmp) / "lengths.npy"
        np.save(path, lengths(samples, max_len, seed))
        arg = json.dumps(dict(path=str(path), model=model, batch_size=batch_size, collator=collator, seed=seed))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the worst batch failed:\n{proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["process_s"] = wall
    r["maxrss_bytes"] = r["maxrss_kb"] * 1024
    return r


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print its table and a TARGET MET / TARGET MISSED line; exit code 0, or 1 with ``--strict``
    when the target is missed."""
    p = argparse.ArgumentParser(prog="memlab bench worst_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100_000, help="token counts in the data set (default 100,000)")
    p.add_argument("--model", default="llama-2-7b", help="the preset traced (default llama-2-7b)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--collator", default="pad-longest", help="pad-longest, pad-multiple:N or pack:N")
    p.add_argument("--max-len", type=int, default=4096, help="the longest sample (default 4096)")
    p.add_argument("--small", action="store_true", help="1,000 lengths and the GPT-2 preset: checks the bench only")
    p.add_argument("--seed", type=int, default=0)
    add_strict(p)
    args = p.parse_args(list(argv or []))
    for name in ("samples", "batch_size", "max_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    samples, model = (1000, "gpt2") if args.small else (args.samples, args.model)
    max_len = min(args.max_len, 128) if args.small else args.max_len
    r = run(samples, model, args.batch_size, args.collator, max_len, args.seed)
    print(table(f"the worst batch of {r['samples']:,} lengths (log-normal, median 350, at most {max_len}), {model}, "
                f"batch size {args.batch_size}, {args.collator}, shuffled (seed {args.seed}); bf16, AdamW, "
                f"checkpointing; a fresh process", ("quantity", "value"),
                [("batches in the epoch", r["batches"]), ("distinct padded shapes", r["distinct"]),
                 ("shapes traced (the others covered)", r["traced"]),
                 ("worst batch", f"#{r['index']}: {r['shape'][0]} x {r['shape'][1]} tokens"),
                 ("its peak (GiB)", r["peak"] / GiB), ("imports (s)", r["import_s"]),
                 ("reading the .npy (s)", r["read_s"]), ("laying out the epoch (s)", r["shapes_s"]),
                 ("tracing the worst batch (s)", r["trace_s"]), ("process wall time (s)", r["process_s"]),
                 ("process CPU time, user + sys (s)", r["cpu_s"]),
                 ("peak RSS (GB)", r["maxrss_bytes"] / GB)], device="cpu"))
    scale = "" if (samples >= 100_000 and not args.small) else \
        f" [{samples:,} lengths, {model}: the target is for 100,000 lengths and a 7B preset]"
    code = report_targets([(f"the worst batch in {r['process_s']:.1f} s (target < {TIME_TARGET_S:g} s, process wall "
                            f"time){scale}", r["process_s"] / TIME_TARGET_S, r["process_s"] < TIME_TARGET_S)],
                          "cpu", strict=args.strict)
    print(f"host: {device_name('cpu')}; load average {load_average()} (a busy host stretches the wall time past the CPU "
          f"time)")
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
