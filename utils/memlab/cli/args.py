"""The argument parsers of ``memlab estimate`` and ``memlab plan``, without torch.

``memlab.cli`` parses a command's arguments with these parsers before it imports the command's
module, so an argument error (an unknown option, a bad int, a missing model) is one line on stderr
within a fraction of a second instead of after the 1-4 s import of torch and transformers.
:func:`memlab.cli.estimate.main` and :func:`memlab.cli.plan.main` parse with the same parsers, so the
options and messages have one source.

Only what ``--help`` shows needs the heavy modules (the preset names, the dtype descriptions):
those parts are filled in when the help is formatted. ``--gpu`` of ``memlab estimate`` is checked
by :func:`memlab.estimate.resolve_gpu`, imported when a ``--gpu`` is given.

The name lists below equal the constants of :mod:`memlab.estimate` and :mod:`memlab.estimate.adapters`
(tests/shared/test_cli.py asserts it); recipes and optimizers come from :mod:`memlab.core.vocab` (torch-free).
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any, Callable, Sequence

from memlab.core.vocab import OPTIMIZER_ALIASES, RECIPE_ALIASES, Optimizer, Recipe

# = memlab.estimate.DTYPES + DTYPE_ALIASES, OPTIMIZERS + OPTIMIZER_ALIASES, OPTIMIZER_IMPLS, LOSSES,
# ATTN_IMPLEMENTATIONS, ZERO_STAGES, MAX_*; memlab.estimate.adapters.ADAPTERS, ADAPTER_DTYPES
DTYPE_CHOICES = tuple(r.value for r in Recipe) + tuple(RECIPE_ALIASES)
OPTIMIZER_CHOICES = tuple(o.value for o in Optimizer) + tuple(OPTIMIZER_ALIASES)
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")
LOSSES = ("auto", "hf", "memlab", "chunked", "fused")
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash")
ZERO_STAGES = (0, 1, 2, 3)
ADAPTERS = ("lora", "qlora")
ADAPTER_DTYPES = ("fp32", "bf16", "fp16")
MAX_BATCH = 2**20  # sequences per step (per rank)
MAX_SEQ_LEN = 2**20  # tokens per sequence
MAX_WORLD_SIZE = 1024  # ranks: stage 3 traces a fake process group of this many
MAX_GRAD_ACCUM = 2**16  # = memlab.estimate.api.MAX_GRAD_ACCUM


def _fsdp_version(text: str) -> int:
    """``--fsdp-version``: checked by the API's own rule (memlab.estimate.step.check_fsdp_version, torch-free), the
    same message under the option's name."""
    from memlab.estimate.step import check_fsdp_version

    value: Any = int(text) if text.strip().isdigit() and len(text) < 30 else text
    try:
        return check_fsdp_version("--fsdp-version", value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit code 2, one line on stderr (the usage only with --help)
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help for usage)\n")


class _LazyHelp:
    """A parser whose help parts that need heavy imports are filled in by ``fill(parser)`` the
    first time the help is formatted."""

    _fill: Callable[[argparse.ArgumentParser], None] | None = None

    def format_help(self) -> str:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill(self)  # type: ignore[arg-type]
        return super().format_help()  # type: ignore[misc]


class _EstimateParser(_LazyHelp, _Parser):
    pass


class _PlanParser(_LazyHelp, argparse.ArgumentParser):
    pass


def _bounded_int(hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = _positive_int(text)
        if v > hi:
            raise argparse.ArgumentTypeError(f"{text!r} is too large; allowed: an int from 1 to {hi:,}")
        return v
    return parse


def _collator(text: str) -> str:
    """``--collator``: pad-longest, pad-multiple:N or pack:N (checked here, torch-free)."""
    kind, _, n = text.partition(":")
    if (kind == "pad-longest" and not n) or (kind in ("pad-multiple", "pack") and n.isdigit() and int(n) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: pad-longest, pad-multiple:N or pack:N (N >= 1)")


def _positive_int(text: str) -> int:
    if len(text) > 30:
        raise argparse.ArgumentTypeError(f"{text[:30]!r}... is invalid; allowed: a positive int")
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int; allowed: a positive int") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: a positive int")
    return v


class GpuArg(tuple):
    """``--gpu`` parsed: ``(label, usable bytes)`` as :func:`memlab.estimate.resolve_gpu` gives, with
    ``card``, the card's name of :mod:`memlab.core.gpus` (None for a size), and ``text``, what was given (a card
    or a size: the estimate's ``gpu=``, so the output names it)."""

    card: str | None = None
    text: str = ""


def _gpu(text: str) -> tuple[str, int]:
    from memlab.core import gpus

    try:
        card, _ = gpus.parse_gpu(text)  # torch-free: a bad --gpu is refused before torch is imported
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    from memlab.estimate import resolve_gpu  # torch: only when a --gpu is given

    out = GpuArg(resolve_gpu(text))
    out.card, out.text = card, text
    return out


def _finite(lo: float, hi: float | None, what: str) -> Callable[[str], float]:
    """A float flag that is finite and within ``lo`` (excluded when ``hi`` is None: ``> lo``) and ``hi`` (excluded)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not math.isfinite(v) or not ((v > lo) if hi is None else (lo <= v < hi)):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is invalid; allowed: {what}")
        return v
    return parse


def _seed(text: str) -> int:
    if len(text) > 20 or not text.strip().isdigit() or int(text) > 2**63 - 1:
        raise argparse.ArgumentTypeError(f"{text[:30]!r} is invalid; allowed: an int from 0 to 2**63 - 1")
    return int(text)


class _NotFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _NotFinite(text)
    return v


def _no_constant(text: str) -> Any:
    raise _NotFinite(text)


def _override(text: str) -> tuple[str, Any]:
    """``--set KEY=VALUE`` (``memlab estimate`` and ``memlab plan``): VALUE as JSON (``2``, ``1e-5``, ``true``,
    ``"silu"``), else the text itself; NaN, Infinity and numbers no float holds are refused here, one line, for both
    commands (the values are then checked against the config by :func:`memlab.estimate.api.check_config_overrides`)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: KEY=VALUE (e.g. num_hidden_layers=2)")
    try:
        parsed = json.loads(value, parse_float=_finite_float, parse_constant=_no_constant)
    except _NotFinite:
        raise argparse.ArgumentTypeError(f"--set {key.strip()}={value[:40]} is invalid; allowed: a finite value (a "
                                         f"number, true/false, a string; NaN and Infinity are no setting)") from None
    except ValueError:  # not JSON (a bare word such as silu), or an int of thousands of digits
        if value.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"--set {key.strip()}={value[:40]}... is invalid; allowed: a number of "
                                             f"at most a few thousand digits") from None
        parsed = value
    return key.strip(), parsed


def _allow_arg(text: str) -> tuple[str, list[Any]]:
    key, sep, values = text.partition("=")
    if not sep or not values:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: KEY=V1,V2 (e.g. adapter=full,lora)")
    out: list[Any] = []
    for v in values.split(","):
        v = v.strip()
        out.append(int(v) if v.isdigit() else v)
    return key.strip(), out


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def _fill_estimate_help(parser: argparse.ArgumentParser) -> None:
    from memlab.core import gpus
    from memlab.estimate import DTYPES
    from memlab.models import PRESETS

    parser.epilog = ("models: " + ", ".join(sorted(PRESETS)) + ", or the path of a transformers config.json. "
                     "GPUs: " + ", ".join(gpus.gpu_names()) + ", or a size (24GiB = 24 x 2**30; 24GB = 24 x 10**9).")
    _action(parser, "dtype").help = ("; ".join(f"{k}: {v}" for k, v in DTYPES.items())
                                     + " (bf16 = bf16-mixed, fp16 = fp16-mixed, everywhere in memlab)")


def estimate_parser() -> argparse.ArgumentParser:
    """The parser of ``memlab estimate`` (torch-free until its help is formatted)."""
    from memlab.core import gpus  # torch-free

    parser = _EstimateParser(
        prog="memlab estimate",
        description="Estimate the peak memory of a training step without a GPU (fake tensors).",
    )
    parser._fill = _fill_estimate_help
    parser.add_argument("model", nargs="?", help="a preset name, the path of a config.json, or a Hub model id "
                        "(org/name: only its config.json is read, through transformers' cache; HF_HUB_OFFLINE=1 works)")
    parser.add_argument("--batch-size", type=_bounded_int(MAX_BATCH), default=1)
    parser.add_argument("--seq-len", type=_bounded_int(MAX_SEQ_LEN), default=2048)
    parser.add_argument("--dtype", choices=list(DTYPE_CHOICES), default=Recipe.BF16_MIXED.value)
    parser.add_argument("--optimizer", choices=list(OPTIMIZER_CHOICES), default="adamw",
                        help="adam8bit is another name of adamw8bit")
    parser.add_argument("--optimizer-impl", choices=list(OPTIMIZER_IMPLS), default="auto",
                        help="torch optimizer implementation (auto: PyTorch's default on the device: foreach on CUDA)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--offload-gradients", action="store_true",
                        help="with --optimizer offload-adamw: free each gradient on the device once copied to the host")
    parser.add_argument("--loss", choices=list(LOSSES), default="auto",
                        help="auto: transformers' own loss (model(input_ids=x, labels=x), as the Trainer) for "
                             "transformers models; memlab: cross entropy on the logits (memlab.models.lm_loss); "
                             "chunked: memlab.loss.chunked_cross_entropy (logits a chunk at a time); fused: "
                             "memlab.loss.enable (head and loss fused, the logits never materialised)")
    parser.add_argument("--offload-checkpoints", action="store_true",
                        help="with --checkpointing: keep each checkpointed layer's input in host memory "
                             "(memlab.checkpoint.offload_checkpoints)")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="step each parameter's optimizer in backward and free its gradient at once "
                             "(memlab.offload.optimizer_in_backward; no gradient accumulation)")
    parser.add_argument("--step", default=None, metavar="MODULE:FUNCTION",
                        help="trace your own step: FUNCTION(model, batch) -> loss, batch = {'input_ids': x, 'labels': x}")
    parser.add_argument("--attn", choices=list(ATTN_IMPLEMENTATIONS), default="auto",
                        help="attention implementation (auto: what transformers picks, sdpa for most models)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the device you will train on")
    parser.add_argument("--set", dest="overrides", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (repeatable), e.g. --set num_hidden_layers=2")
    parser.add_argument("--allow-longer-seq", action="store_true",
                        help="allow --seq-len beyond max_position_embeddings (RoPE scaling and the like)")
    parser.add_argument("--no-extrapolate", action="store_true",
                        help="trace every decoder layer instead of two depths extrapolated by layer count")
    parser.add_argument("--gpu", type=_gpu, default=None, help=gpus.allowed_text())
    parser.add_argument("--world-size", type=_bounded_int(MAX_WORLD_SIZE), default=1,
                        help="data-parallel ranks: the estimate is per rank, --batch-size being one rank's batch")
    parser.add_argument("--zero-stage", type=int, choices=list(ZERO_STAGES), default=0,
                        help="0: data parallel; 1: optimizer state sharded; 2: and gradients; 3: and parameters (FSDP)")
    parser.add_argument("--fsdp-version", type=_fsdp_version, default=2,
                        help="with --zero-stage 3: 2 (fully_shard, default) or 1 (FullyShardedDataParallel with its "
                             "FULL_SHARD defaults: flat parameters, the root unit gathered through forward and "
                             "backward, accumulation under no_sync() keeping unsharded gradients)")
    parser.add_argument("--grad-accum", type=_bounded_int(MAX_GRAD_ACCUM), default=1,
                        help="micro-batches of --batch-size per optimizer step (gradient accumulation)")
    parser.add_argument("--keep-previous-outputs", action="store_true",
                        help="the loop keeps the previous step's outputs (out = model(...), kept for logging: its "
                             "logits) alive through the next forward")
    parser.add_argument("--zero-grad-keep", action="store_true",
                        help="the loop zeroes the gradients in place instead of freeing them "
                             "(optimizer.zero_grad(set_to_none=False); model.zero_grad() before torch 2.0): they stay "
                             "allocated through the next forward and backward")
    parser.add_argument("--adapter", choices=list(ADAPTERS), default=None,
                        help="train LoRA adapters on a frozen 16-bit base (lora) or on an NF4 base (qlora)")
    parser.add_argument("--lora-r", type=_positive_int, default=16, help="adapter rank (default 16)")
    parser.add_argument("--lora-alpha", type=_finite(0.0, None, "a finite number > 0"), default=None,
                        help="adapter scale numerator (default 2 x rank)")
    parser.add_argument("--target-modules", default=None, metavar="NAMES",
                        help="comma-separated linear layer names (e.g. q_proj,v_proj) or all-linear (default)")
    parser.add_argument("--lora-dropout", type=_finite(0.0, 1.0, "a finite number in [0, 1)"), default=0.0,
                        help="dropout on the adapters' input (default 0)")
    parser.add_argument("--adapter-dtype", choices=list(ADAPTER_DTYPES), default=None,
                        help="the adapters' dtype (default fp32; bf16 with --dtype bf16-pure)")
    parser.add_argument("--compare", action="store_true",
                        help="print accelerate's, DeepSpeed's and the bytes-per-parameter rule's answers beside memlab's")
    parser.add_argument("--no-suggest", action="store_true", help="skip what-would-make-it-fit")
    _add_worst_batch_args(parser)
    parser.add_argument("--validate", action="store_true",
                        help="compare the estimate with published, measured peaks of real fine-tunes (offline)")
    return parser


def _add_worst_batch_args(parser: argparse.ArgumentParser) -> None:
    """The worst batch of a data set (memlab.estimate.batches): --lengths and the flags that go with it."""
    parser.add_argument("--lengths", default=None, metavar="FILE",
                        help="a data set's token counts (one per line, a .npy, a .jsonl of input_ids or of texts "
                             "with --tokenizer, or a folder saved with datasets' save_to_disk): the peak "
                             "of the worst batch of an epoch (--batch-size, --collator, --shuffle-seed) instead of "
                             "one --seq-len")
    parser.add_argument("--collator", type=_collator, default="pad-longest",
                        help="with --lengths: pad-longest, pad-multiple:N or pack:N (default pad-longest)")
    parser.add_argument("--shuffle-seed", type=_seed, default=None,
                        help="with --lengths: the order of DataLoader(shuffle=True, generator=torch.Generator()"
                             ".manual_seed(SEED)); default: the file's order")
    parser.add_argument("--max-batch-size", action="store_true",
                        help="with --lengths and --gpu: the largest micro-batch whose worst batch fits the card")
    parser.add_argument("--exact-shapes", action="store_true",
                        help="with --lengths: trace every distinct batch shape, also those a larger one covers")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="with --lengths FILE.jsonl of texts: a LOCAL tokenizer (a save_pretrained folder or a "
                             "tokenizer.json; offline, nothing downloaded) that counts each line's 'text'")


def parse_estimate(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """``(parser, parsed arguments)`` of ``memlab estimate``; an error exits 2 with one line, before torch."""
    parser = estimate_parser()
    args = parser.parse_args(list(argv or []))
    if args.model is None and not args.validate:
        parser.error("the following arguments are required: model (or --validate)")
    return parser, args


def _fill_plan_help(parser: argparse.ArgumentParser) -> None:
    from memlab.core import gpus
    from memlab.models import PRESETS
    from memlab.plan import DEFAULT_ALLOW

    parser.epilog = ("models: " + ", ".join(sorted(PRESETS)) + ", a config.json, or a Hub model id (org/name: its "
                     "config.json only). GPUs: " + ", ".join(gpus.gpu_names())
                     + ". --allow keys: " + ", ".join(DEFAULT_ALLOW)
                     + " (e.g. --allow adapter=qlora --allow micro_batch=1,2).")


def plan_parser() -> argparse.ArgumentParser:
    """The parser of ``memlab plan`` (torch-free until its help is formatted)."""
    parser = _PlanParser(
        prog="memlab plan",
        description="Pick the training stack that fits a model into a memory budget (chapter 07): every "
                    "candidate traced by memlab.estimate on fake tensors, ranked by a stated cost model.",
    )
    parser._fill = _fill_plan_help
    parser.add_argument("model", help="a preset name, the path of a config.json, or a Hub model id (org/name: "
                        "only its config.json is read, through transformers' cache; HF_HUB_OFFLINE=1 works)")
    parser.add_argument("--gpu", default=None, help="a card: its memory as the driver reports it and its cost constants")
    parser.add_argument("--budget", default=None, help="bytes or a size (24GiB, 24GB); default: the card's usable memory")
    parser.add_argument("--batch-size", type=_bounded_int(MAX_BATCH), required=True,
                        help="the effective batch (micro-batch x accumulation)")
    parser.add_argument("--seq-len", type=_bounded_int(MAX_SEQ_LEN), required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--allow", type=_allow_arg, action="append", default=[], metavar="KEY=V1,V2")
    parser.add_argument("--prefer", choices=["fidelity", "cost"], default="fidelity")
    parser.add_argument("--host-budget", default="auto", help="host memory for offloaded stacks (e.g. 128GiB; "
                        "default: this machine's available memory; 'none': no bound)")
    parser.add_argument("--top", type=_bounded_int(10_000), default=5, help="stop after this many stacks that fit")
    parser.add_argument("--set", dest="overrides", type=_override, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--all", action="store_true", help="print every row")
    parser.add_argument("--no-progress", action="store_true")
    return parser


PARSERS: dict[str, Callable[[Sequence[str] | None], Any]] = {
    "estimate": parse_estimate,
    "plan": lambda argv: plan_parser().parse_args(list(argv) if argv is not None else None),
}
