"""``memlab estimate``: the breakdown, the verdict for a GPU, what would make it fit, the peers side by
side (``--compare``) and the published comparisons (``--validate``). The parser is
:func:`memlab.cli.args.estimate_parser` (torch-free)."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Sequence

from memlab.core.forking import before_first_trace, spare_cpu
from memlab.core.units import format_bytes
from memlab.estimate.api import estimate_training_memory
from memlab.estimate.recipes import LOSS_ALIASES
from memlab.estimate.result import MemoryEstimate
from memlab.estimate.step import load_step
from memlab.estimate.suggest import Speculation, Suggestion, suggestions

# The order in which to try techniques: least change to the training run first.
_TRY_ORDER = ("fused AdamW", "fused linear cross-entropy", "chunked cross-entropy", "gradient checkpointing", "offloaded checkpoint inputs",
              "optimizer step in backward", "8-bit AdamW", "gradient checkpointing + 8-bit AdamW",
              "CPU-offloaded AdamW", "pure bf16", "LoRA", "QLoRA", "batch size", "sequence length")


def _intrusiveness(technique: str) -> int:
    ranks = [i for i, prefix in enumerate(_TRY_ORDER) if technique.startswith(prefix)]
    return max(ranks) if ranks else len(_TRY_ORDER)


def _error(msg: Any) -> int:
    """One line on stderr, exit code 2; the API's ``config_overrides['KEY']=`` is the CLI's ``--set KEY=``."""
    text = re.sub(r"config_overrides\['([^']+)'\]=", r"--set \1=", " ".join(str(msg).split()))
    print(f"memlab estimate: error: {text}", file=sys.stderr)
    return 2


def _keywords(args: argparse.Namespace) -> tuple[dict, dict, dict | None]:
    """(run keywords, adapter keywords, config overrides) of the parsed arguments."""
    run_kwargs = dict(optimizer_impl=args.optimizer_impl, device=args.device, loss=args.loss, step=args.step,
                      offload_checkpoints=args.offload_checkpoints, optimizer_in_backward=args.optimizer_in_backward,
                      attn_implementation=args.attn, allow_longer_seq=args.allow_longer_seq,
                      extrapolate=not args.no_extrapolate,
                      gpu=getattr(args.gpu, "text", None) or None)  # a card or a size: the API's gpu=, named in the output
    # the loop's settings, passed only when set (so the worst-batch and suggestion routes see them too)
    for key, default in (("grad_accum", 1), ("fsdp_version", 2), ("keep_previous_outputs", False)):
        if getattr(args, key) != default:
            run_kwargs[key] = getattr(args, key)
    if args.zero_grad_keep:  # zero_grad(set_to_none=False): the gradients kept between steps
        run_kwargs["zero_grad_set_to_none"] = False
    adapter_kw = dict(adapter=args.adapter, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                      target_modules=args.target_modules, lora_dropout=args.lora_dropout,
                      adapter_dtype=args.adapter_dtype)
    return run_kwargs, adapter_kw, dict(args.overrides) or None


def _estimate(args: argparse.Namespace, run_kwargs: dict, adapter_kw: dict,
              overrides: dict | None) -> MemoryEstimate | int:
    """The estimate the arguments ask for, or the exit code of a one-line error."""
    try:
        kw = dict(run_kwargs)
        if args.step is not None:
            kw["step"] = load_step(args.step)
        return estimate_training_memory(
            args.model, batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
            optimizer=args.optimizer, checkpointing=args.checkpointing, config_overrides=overrides,
            optimizer_kwargs={"offload_gradients": True} if args.offload_gradients else None,
            world_size=args.world_size, zero_stage=args.zero_stage, **kw, **adapter_kw,
        )
    except (KeyError, ValueError, TypeError, FileNotFoundError, OverflowError) as exc:
        return _error(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    except RuntimeError as exc:  # torch refused a size: one line, not C++ frames
        return _error(str(exc).splitlines()[0][:300])


def _verdict(est: MemoryEstimate, args: argparse.Namespace) -> bool:
    """Print the verdict for ``--gpu``; True when it fits."""
    label, usable = args.gpu
    need = est.reserved_bytes if args.device == "cuda" else est.peak_bytes
    print(f"\nGPU: {label}")
    if need <= usable:
        print(f"verdict: FITS: {format_bytes(need)} reserved (estimated) in {format_bytes(usable)} usable, "
              f"{format_bytes(usable - need)} to spare")
        return True
    if est.allocated_bytes <= usable:
        print(f"verdict: TIGHT: the allocated peak {format_bytes(est.allocated_bytes)} fits {format_bytes(usable)} but not "
              f"with the allocator's cached blocks ({format_bytes(need)} reserved, by the caching-allocator replay); try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
              f"or one of the techniques below")
    else:
        print(f"verdict: DOES NOT FIT in {format_bytes(usable)} usable: over by {format_bytes(need - usable)}")
    return False


def _print_suggestions(est: MemoryEstimate, sug: list[Suggestion], usable: int) -> None:
    sug.sort(key=lambda s: s.peak_bytes)
    rows = [("technique", "chapter", "peak", "peak in", "fwd/bwd peak", "saving", "how", "fits")]
    for s in sug:
        rows.append((s.technique, s.chapter or "-", format_bytes(s.peak_bytes), s.phase or "-",
                     format_bytes(s.fwd_bwd_peak) if s.fwd_bwd_peak else "-", format_bytes(s.saving(est)),
                     s.how, "yes" if s.reserved_bytes <= usable else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  " + "  ".join(c.ljust(w) if i in (0, 3, 6) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))
    fitting = [s for s in sug if s.reserved_bytes <= usable]
    if fitting:
        first = min(fitting, key=lambda s: _intrusiveness(s.technique))
        print(f"\nnext to try: {first.technique} ({first.how}): {format_bytes(first.peak_bytes)}, "
              f"saves {format_bytes(first.saving(est))}")
    else:
        print("\nno single technique above fits: combine them (chapter 07 plans the stack) or use more GPUs (chapter 08)")
    commands = [s for s in sug if s.command]
    if commands:
        print("\nto reproduce a traced row:")
        for s in commands:
            print(f"  {s.technique}: {s.command}")


def main(argv: Sequence[str] | None = None) -> int:
    """``memlab estimate MODEL [options]`` and ``memlab estimate --validate`` (``argv``: ``sys.argv[1:]``
    style; None reads none). The exit code is 0, or 2 on bad input (one line on stderr)."""
    from memlab.cli.args import parse_estimate

    _, args = parse_estimate(argv)
    from memlab.estimate.trace_cache import disk_cache

    with disk_cache():  # a repeated estimate (and its suggestions) read from the trace cache, in this run only
        return _run(args)


def _run(args: Any) -> int:
    if args.validate:
        from memlab.estimate import validate

        return validate.main(model_filter=args.model)
    run_kwargs, adapter_kw, overrides = _keywords(args)
    if args.lengths is not None:  # the worst batch of a data set (memlab.cli.worst_batch)
        from memlab.cli.worst_batch import run_worst_batch

        return run_worst_batch(args, run_kwargs, adapter_kw, overrides)
    if args.offload_gradients and args.optimizer != "offload-adamw":
        return _error(f"--offload-gradients needs --optimizer offload-adamw (got --optimizer {args.optimizer})")
    sug_kwargs = {**run_kwargs, "step": args.step, **(adapter_kw if args.adapter else {})}
    ahead: list[Any] = []  # the suggestions' rows traced ahead (memlab.estimate.suggest.Speculation)
    try:
        with before_first_trace(lambda: ahead.extend(_speculation(args, overrides, sug_kwargs))):
            est = _estimate(args, run_kwargs, adapter_kw, overrides)
        return _report(est, args, overrides, sug_kwargs, ahead[0] if ahead else None)
    finally:
        for spec in ahead:
            spec.close()


def _speculation(args: Any, overrides: dict | None, sug_kwargs: dict) -> list[Any]:
    """[a Speculation] where the estimate may need its suggestions (``--gpu``, one rank, no step file) and a second
    CPU is free when the estimate starts tracing (the imports done), else []."""
    if args.gpu is None or args.no_suggest or args.world_size > 1 or args.zero_stage or args.step is not None \
            or args.offload_gradients or not spare_cpu():
        return []
    from types import SimpleNamespace

    from memlab.core import vocab

    loss = LOSS_ALIASES.get(args.loss, args.loss)
    loss = "hf" if loss == "auto" else loss  # a name or a config: a transformers model
    provisional = SimpleNamespace(
        batch_size=args.batch_size, seq_len=args.seq_len, dtype=vocab.canonical_recipe(args.dtype, argument="dtype"),
        optimizer=vocab.canonical_optimizer(args.optimizer), checkpointing=args.checkpointing, loss=loss,
        device=args.device, offload_checkpoints=args.offload_checkpoints, world_size=1, zero_stage=0,
        optimizer_in_backward=args.optimizer_in_backward, optimizer_impl="", peak_phase="", adapter=args.adapter or "")
    _import_for_trace(args.model, overrides)  # here, before the fork: the child starts with them
    try:
        return [Speculation(args.model, provisional, overrides, sug_kwargs)]
    except (OSError, ValueError):  # no process to be had, or nothing to guess: the suggestions trace as before
        return []


def _import_for_trace(model: str, overrides: dict | None) -> None:
    # what the first trace imports (the tracer, the fake mode's torch._dynamo, the model's transformers module); a
    # model that does not resolve here is left to the estimate, which says why
    from memlab.estimate.fake_mode import fake_mode
    from memlab.estimate.model import resolve_model

    fake_mode()
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(resolve_model(model, overrides).config)]
    except Exception:  # noqa: BLE001  (nothing imported ahead: the trace imports it)
        pass


def _report(est: Any, args: Any, overrides: dict | None, sug_kwargs: dict, ahead: Any) -> int:
    """Print the estimate, the verdict and (when it does not fit) the suggestions; the exit code."""
    if isinstance(est, int):
        return est
    print(est.table())
    from memlab.estimate.trace_cache import CACHE_NOTE

    cached = any(n.startswith(CACHE_NOTE) for n in est.notes)
    print(f"estimated in {est.seconds:.1f} s on fake tensors (nothing allocated)"
          + (f"; {CACHE_NOTE}, see the notes" if cached else ""))
    if args.compare:
        from memlab.estimate import peers

        print("\n" + peers.format_compare(est))
    if args.gpu is None or _verdict(est, args) or args.no_suggest:
        return 0
    if args.world_size > 1 or args.zero_stage:
        print(f"\nsuggestions are computed for one GPU; per rank, try a higher --zero-stage (now {args.zero_stage}) or a "
              f"larger --world-size (now {args.world_size}), then the techniques of chapters 02-06 on top")
        return 0
    print("\nwhat would make it fit (estimated tensor peak; 'traced' = re-estimated, 'formula' = byte formula;"
          " 'fits' compares the reserved estimate with the usable memory):")
    try:
        sug = suggestions(est, args.model, config_overrides=overrides, speculation=ahead, **sug_kwargs)
    except (ValueError, TypeError) as exc:
        return _error(exc)
    _print_suggestions(est, sug, args.gpu[1])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
