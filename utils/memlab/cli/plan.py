"""``memlab plan``: the ranked stacks for a model, a budget and a batch. The parser is
:func:`memlab.cli.args.plan_parser` (torch-free)."""
from __future__ import annotations

import sys
from typing import Sequence

from memlab.plan.planner import plan
from memlab.plan.result import format_count


def main(argv: Sequence[str] | None = None) -> int:
    """``memlab plan MODEL --gpu CARD | --budget SIZE --batch-size B --seq-len T``: the ranked stacks
    (``argv``: None reads ``sys.argv``). The exit code is 0 when a stack fits, 1 when none does, 2 on bad input."""
    from memlab.cli.args import plan_parser

    parser = plan_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    allow: dict[str, list] = {}
    for k, v in args.allow:
        allow.setdefault(k, []).extend(v)
    try:
        res = plan(args.model, args.budget, batch_size=args.batch_size, seq_len=args.seq_len, gpu=args.gpu,
                   allow=allow or None, device=args.device, top=args.top, prefer=args.prefer,
                   config_overrides=dict(args.overrides) or None, host_budget=args.host_budget,
                   progress=not args.no_progress)
    except (ValueError, TypeError, FileNotFoundError, OverflowError) as exc:
        print(f"memlab plan: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # torch refused a size: one line, not C++ frames
        print(f"memlab plan: error: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
        return 2
    target = f"{args.gpu} (CUDA)" if args.gpu else ("a CUDA GPU" if args.device == "cuda" else "the CPU")
    print(f"{res.model} ({format_count(res.n_params)} params), effective batch {res.batch_size} x seq {res.seq_len}, "
          f"for {target}")
    print(f"budget: {res.budget_label} ({res.budget:,} bytes); compared: "
          + ("reserved estimate (tensors + cuBLAS workspaces, replayed through a model of the caching allocator)" if res.device == "cuda"
             else "traced tensor peak"))
    print(f"ranking: {'fidelity tier, then relative cost' if res.prefer == 'fidelity' else 'relative cost'} "
          f"(1.00 = the effective batch's 16-bit forward + backward at the cost model's MFU)")
    print(f"costs: {res.cost_basis}\n")
    print(res.table(limit=None if args.all else 12))
    print("\ncolumns:")
    for line in res.legend():
        print(f"  {line}")
    print()
    for n in res.notes:
        print(f"note: {n}")
    print(f"\n{res.summary}")
    print(res.verdict)
    return 0 if res.pick is not None else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))


