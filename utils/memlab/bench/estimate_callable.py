"""``memlab bench estimate_callable``: a model given as a callable, traced at full depth against extrapolated by
depth (issue 38, point 2).

The model is a transformers Llama of ``--layers`` decoder layers (32 by default) and ``--hidden`` width (1024 by
default; 4096 with ``--intermediate 11008 --vocab 32000`` is Llama-2-7B's shape, minutes per full trace), given
three ways: a model factory ``build(num_hidden_layers=32)`` (memlab's factory route: traced at 3, 4 and 5 layers
and extrapolated), a builder of no arguments returning ``AutoModelForCausalLM.from_config(config)`` (the config
route), and the same builder with ``extrapolate=False`` (every layer traced, what a callable got before). Each is
one ``estimate_training_memory`` call at batch 1 x ``--seq-len`` on a CUDA target (bf16-mixed, AdamW), timed in
turns round by round (:func:`memlab.bench.interleaved_medians`). The extrapolated peaks must equal the full
trace's to the byte. Target: each extrapolated route at least 2x faster than the full trace at 32 layers (the
traced depths are 3, 4 and 5: 12 layers traced against 32, at most 2.7x for the layers, less the meta builds the
routes check the model with; the gain grows with depth). The load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from memlab.bench import add_strict, interleaved_medians, load_average, report_targets, table

SPEED_UP = 2.0  # the target: the extrapolated routes' speed-up over the full trace


def builders(layers: int, hidden: int, intermediate: int, vocab: int) -> dict[str, Any]:
    """The model factory and the builder of no arguments, both building the same Llama."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    def config(n: int) -> Any:
        return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=max(hidden // 128, 1),
                           num_key_value_heads=max(hidden // 128, 1), num_hidden_layers=n, vocab_size=vocab)

    def build(num_hidden_layers: int = layers):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(config(num_hidden_layers))

    def build_llama():
        return build(layers)

    return {"factory": build, "builder": build_llama}


def main(argv: list[str] | None = None) -> int:
    """``memlab bench estimate_callable [--layers N] [--hidden H] [--repeat R] [--strict]``."""
    p = argparse.ArgumentParser(prog="memlab bench estimate_callable", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default 32)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2.75 x hidden)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--repeat", type=int, default=2, help="timed rounds (default 2; the median)")
    add_strict(p)
    args = p.parse_args(argv)
    for name in ("layers", "hidden", "vocab", "seq_len", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; allowed: an int >= 1")
    if args.layers < 6:
        p.error(f"--layers={args.layers} is invalid; allowed: 6 or more (fewer layers are traced, never extrapolated)")
    from memlab.estimate import estimate_training_memory

    b = builders(args.layers, args.hidden, args.intermediate or int(2.75 * args.hidden), args.vocab)
    step = dict(batch_size=1, seq_len=args.seq_len, device="cuda", dtype="bf16-mixed")
    out: dict[str, Any] = {}
    calls = {
        "full trace (extrapolate=False)": lambda: out.__setitem__("full", estimate_training_memory(
            b["builder"], extrapolate=False, **step)),
        "factory route": lambda: out.__setitem__("factory", estimate_training_memory(b["factory"], **step)),
        "config route": lambda: out.__setitem__("config", estimate_training_memory(b["builder"], **step)),
    }
    before = load_average()
    times = interleaved_medians(calls, args.repeat)
    after = load_average()
    keys = dict(zip(calls, ("full", "factory", "config")))
    rows = [(name, times[name], out[keys[name]].peak_bytes, times[next(iter(calls))] / times[name])
            for name in calls]
    print(table(f"estimate_training_memory of a {args.layers}-layer Llama callable (hidden {args.hidden}), batch 1 x "
                f"{args.seq_len}, CUDA target, bf16-mixed; median of {args.repeat} interleaved round(s)",
                ("route", "seconds", "peak bytes", "speed-up"), rows, "cpu"))
    print(f"load average (1, 5, 15 min): {before} before, {after} after")
    full = out["full"]
    checks = []
    for key in ("factory", "config"):
        est = out[key]
        same = (est.peak_bytes, est.phase_breakdowns, est.breakdown_end) == (full.peak_bytes, full.phase_breakdowns,
                                                                              full.breakdown_end)
        checks.append((f"{key} route: extrapolated from {est.extrapolated_from}, its peak and every phase's breakdown "
                       f"equal to the full trace's", None, bool(est.extrapolated_from) and same))
        speed = times[next(iter(calls))] / times[[n for n, k in keys.items() if k == key][0]]
        checks.append((f"{key} route at least {SPEED_UP}x faster than the full trace ({speed:.1f}x)",
                       SPEED_UP / speed, speed >= SPEED_UP))
    return report_targets(checks, "cpu", strict=args.strict)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
