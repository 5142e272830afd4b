"""``memlab explain FILE``: what held the memory at the peak, from a CUDA memory snapshot, a memlab timeline pickle or
a pasted OOM message (:mod:`memlab.profiler.explain`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence


def explain_parser() -> argparse.ArgumentParser:
    """The parser of ``memlab explain`` (torch-free)."""
    p = argparse.ArgumentParser(
        prog="memlab explain",
        description="Explain an out-of-memory: allocated vs reserved at the peak, the fragmentation (and whether "
                    "expandable_segments would help), live bytes by category and by where they were made, the ten "
                    "largest blocks. FILE: the pickle of torch.cuda.memory._dump_snapshot(), a memlab timeline "
                    "pickle (Timeline.save_snapshot) or a text file holding the OOM message.")
    p.add_argument("file", metavar="FILE", help="snapshot pickle, timeline pickle, or OOM message text")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON instead of text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the explanation of FILE; exit 0, or 2 with one line on stderr for a file that is none of the three."""
    args = explain_parser().parse_args(list(argv) if argv is not None else None)
    from memlab.profiler.explain import SnapshotError, explain

    try:
        e = explain(args.file)
    except (SnapshotError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        print(f"memlab explain: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(e), indent=1) if args.json else e.text())
    return 0
