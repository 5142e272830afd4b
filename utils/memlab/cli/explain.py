"""``memlab explain FILE [--model MODEL [memlab estimate's flags]]``: what held the memory at the peak, from a CUDA
memory snapshot, a memlab timeline pickle (with the reserved memory and fragmentation a model of the caching allocator
predicts for it, :mod:`memlab.estimate.allocator_replay`) or a pasted OOM message (:mod:`memlab.profiler.explain`); with
``--model`` and the run's settings, the fixes ranked by their traced peak with the command for each (``memlab
estimate``'s suggestions, for the card of the snapshot or message unless ``--gpu`` is given)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence


def explain_parser() -> argparse.ArgumentParser:
    """The parser of ``memlab explain`` (torch-free); arguments it does not know go to ``memlab estimate``."""
    p = argparse.ArgumentParser(
        prog="memlab explain",
        description="Explain an out-of-memory: allocated vs reserved at the peak, the fragmentation (and whether "
                    "expandable_segments would help), live bytes by category and by where they were made, the ten "
                    "largest blocks. FILE: the pickle of torch.cuda.memory._dump_snapshot(), a memlab timeline "
                    "pickle (Timeline.save_snapshot) or a text file holding the OOM message. With --model MODEL and "
                    "memlab estimate's flags for the run (--batch-size, --seq-len, --dtype, --optimizer, ...): the "
                    "fixes ranked by their traced peak, with the command for each.")
    p.add_argument("file", metavar="FILE", help="snapshot pickle, timeline pickle, or OOM message text")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON instead of text")
    p.add_argument("--model", default=None, help="the run's model (as memlab estimate takes it): rank the fixes")
    p.add_argument("--alloc-conf", default=None, metavar="CONF",
                   help="for a memlab timeline: the PYTORCH_CUDA_ALLOC_CONF settings (e.g. expandable_segments:True) "
                        "of the caching-allocator model that predicts its reserved memory (default: PyTorch's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the explanation of FILE (and the ranked fixes with ``--model``); exit 0, or 2 with one line on stderr
    for a file that is none of the three or a bad flag."""
    parser = explain_parser()
    args, rest = parser.parse_known_args(list(argv) if argv is not None else None)
    if rest and args.model is None:
        parser.error(f"unrecognized arguments: {' '.join(rest)} (memlab estimate's flags need --model)")
    est_argv = None
    if args.model is not None:  # check the run's flags before any tracing
        from memlab.cli.args import parse_estimate

        est_argv = [args.model, *rest]
        parse_estimate(est_argv)
    import functools

    from memlab.estimate.allocator_replay import replay
    from memlab.estimate.caching_allocator import AllocatorConfig
    from memlab.profiler.explain import SnapshotError, explain

    try:
        conf = AllocatorConfig.parse(args.alloc_conf) if args.alloc_conf is not None else None
    except ValueError as exc:
        print(f"memlab explain: error: --alloc-conf: {exc}", file=sys.stderr)
        return 2
    try:  # a timeline (no allocator behind it) gets the caching-allocator model's prediction; a snapshot its segments
        e = explain(args.file, allocator=functools.partial(replay, config=conf))
    except (SnapshotError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        print(f"memlab explain: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(e), indent=1) if args.json else e.text())
    if est_argv is None:
        return 0
    if "--gpu" not in rest:
        if not e.capacity_bytes:  # only an OOM message names the card's total
            print("\nno --gpu given and the file does not name the card's capacity: the fixes need --gpu CARD")
            return 0
        est_argv += ["--gpu", f"{e.capacity_bytes}B"]
    print(f"\nthe run, re-traced: memlab estimate {' '.join(est_argv)}\n")
    from memlab.cli.estimate import main as estimate_main

    return estimate_main(est_argv)
