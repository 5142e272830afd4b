"""Will this fine-tune fit? Estimate a training step's peak memory without a GPU.

The idea: run the real training step -- forward, backward, optimizer step -- on *fake*
tensors (``torch._subclasses.fake_tensor.FakeTensorMode``). A fake tensor has a shape, a dtype,
a device and strides but no data, so every operator runs its shape logic only and nothing is
allocated; a 70B-parameter model "trains" on a laptop in seconds. The step is watched by
:class:`memlab.profiler.MemoryTracker`, which counts the bytes of every live storage exactly as
it does on real tensors. Nothing about the model is re-derived by hand: the tensors that
autograd saves, the temporaries of the optimizer, autocast's 16-bit copies of the weights and
checkpointing's recomputation are whatever PyTorch and ``transformers`` really do. For a model
small enough to run for real, the estimate equals the real step's tracked peak to the byte
(``tests/test_estimate.py``).

What "a step" means here: zero the gradients (``set_to_none``), draw a batch of
``batch_size x seq_len`` token ids, the forward pass and the loss, ``loss.backward()``,
``optimizer.step()``. The loss is the one people run: for a transformers model its own
(``model(input_ids=x, labels=x).loss``, as the Trainer computes it, which upcasts the logits to
fp32); ``loss="memlab"`` traces :func:`memlab.models.lm_loss` instead, and ``step=`` any
``step(model, batch) -> loss`` of yours. One untracked warm-up step runs first
(``warmup_steps=1``), then the tracked step: the steady state, in which the optimizer state
already exists while the forward pass's activations are alive -- a first step never shows that,
since Adam creates its state lazily inside the first ``optimizer.step()``.

Precision recipes (``dtype``):

* ``"fp32"``: fp32 weights, gradients, optimizer state and compute.
* ``"bf16"`` / ``"fp16"``: automatic mixed precision as PyTorch's AMP recipe and Hugging Face's
  ``Trainer(bf16=True)`` / ``fp16=True`` run it: the weights (hence gradients and optimizer
  state) stay fp32 and the forward pass runs under ``torch.autocast`` in 16 bits, so the
  activations and autocast's cached 16-bit copies of the weights are 16-bit. For fp16 the
  ``GradScaler`` is not traced (its loss scale is a scalar and it unscales the gradients in
  place, so it adds no tensor of note).
* ``"bf16-pure"``: weights, gradients and optimizer state all in bf16 and no autocast (no fp32
  master copy): the smallest full fine-tune, with bf16's rounding in the update.

Optimizers: ``"adamw"`` (``torch.optim.AdamW``: two fp32 moments per parameter), ``"sgd"``
(``torch.optim.SGD`` without momentum: no state), ``"adamw8bit"``
(``bitsandbytes.optim.AdamW8bit``: both moments in 1 byte per element plus one fp32 absmax
per block of 256 for tensors of at least 4096 elements, traced when bitsandbytes imports,
otherwise modelled with that layout and said so in ``notes``), ``"offload-adamw"``
(:class:`memlab.offload.OffloadedAdamW`, chapter 04: the device side of the step is traced --
the parameters in their dtype, their gradients (freed by the hook with
``optimizer_kwargs={"offload_gradients": True}``), the activations; the CPU step writes the
parameters in place and allocates nothing on the device -- and the host side is counted, not
traced: fp32 master weights, fp32 gradient slots and two fp32 moments (16 bytes per parameter,
:func:`memlab.offload.device_host_bytes`), the step counters, and on CUDA the pinned staging copy
in each parameter's dtype; ``MemoryEstimate.host_bytes``).

The weights' dtype is the recipe's alone: a ``config.json``'s ``torch_dtype`` is ignored.

What is traced and what is stated: the traced peak counts tensor storages. On a CUDA target the
estimate adds, as named lines, what the allocator counts beyond tensors (cuBLAS's 32 MiB
workspace for each of the forward and autograd threads: ``allocated_bytes``), a fragmentation
margin measured on an H100 (``reserved_bytes``), and compares with the card's memory minus a
stated CUDA-context reserve (:mod:`memlab.gpus`). Without a CUDA build the step is traced with
CPU fake tensors under CUDA's rules (:mod:`memlab.cuda_rules`, each rule that fired in ``notes``):
dropout keeps CUDA's 1-byte mask, autocast follows CUDA's op lists (layer_norm, softmax, log_softmax,
sum, pow, ... in fp32), and the attention kernel is the one the CUDA target would run (flash / memory-efficient: output + logsumexp; math for fp32 with grouped KV
heads; eager's softmax-backward scratch by a per-op rule), said in ``attention``. A homogeneous
decoder stack is traced at 1 and 2 layers and extrapolated exactly by layer count (tested equal
to the full trace). The optimizer implementation follows the target
device (``device="cuda"`` uses PyTorch's CUDA default, the foreach AdamW, whose
``sqrt(exp_avg_sq)`` temporary is a full extra copy of one moment during the step; Hugging Face's
Trainer defaults to the fused AdamW, ``optimizer_impl="fused"``, which has none).

Per rank (chapter 08): ``world_size=N, zero_stage=S`` (CLI ``--world-size N --zero-stage S``) estimate
one of N data-parallel ranks under ZeRO stage S. Stages 1 and 2: the step of one rank's batch is traced
once and its optimizer state / gradients sharded as the stage shards them (:func:`shard_estimate`).
Stage 3 is traced with FSDP2 itself, as PyTorch's ``FSDPMemTracker`` does it: the fake-tensor model is
sharded with ``fully_shard`` under a fake process group of N ranks (created for the trace and destroyed
after it) and rank 0's step tracked, FSDP2's all-gathers and frees included; a deep stack is traced at 3
and 4 layers, checked at 5 and extrapolated. Where that cannot run (``torch.distributed`` already
initialised in the process, no decoder layers for ``fully_shard``, FSDP2 failing on fake tensors) FSDP's
unsharded units are modelled instead and a note says why. ``tests/test_estimate_distributed.py`` checks
every stage against ranks measured with 2 gloo processes on CPU.

Adapters (``adapter="lora" | "qlora"``, CLI ``--adapter``): :mod:`memlab.adapters` builds the fake
model (frozen 16-bit or NF4 base, rank-r adapters on the target modules), the one builder that
``memlab plan`` uses too. Hub ids (``meta-llama/Llama-3.1-8B``): only the config.json, through
transformers (:mod:`memlab.hub`). ``--compare``: the rules of thumb beside the trace (:mod:`memlab.peers`).

Vocabulary: "bf16" here is mixed precision with fp32 master weights (as in :mod:`memlab.amp` and
``Trainer(bf16=True)``); :mod:`memlab.plan`'s and :mod:`memlab.train`'s "bf16" is pure bf16, this
module's "bf16-pure" ("bf16-mixed" is accepted here as "bf16"). ``adam8bit`` is another name of
``adamw8bit``.

Reference formulas kept here for comparison: :func:`accelerate_estimate` (``accelerate
estimate-memory``) and :func:`deepspeed_zero_estimate` (DeepSpeed's model-state estimators).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import stat as _stat
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from memlab.optional import needs
from memlab.accounting import format_bytes

__all__ = [
    "DTYPES",
    "OPTIMIZERS",
    "OPTIMIZER_IMPLS",
    "CATEGORIES",
    "MemoryEstimate",
    "estimate_training_memory",
    "measure_training_memory",
    "training_step",
    "parse_size",
    "format_bytes",
    "accelerate_estimate",
    "deepspeed_zero_estimate",
    "suggestions",
    "main",
    "resolve_gpu",
    "load_step",
    "ATTN_IMPLEMENTATIONS",
    "LOSSES",
    "ZERO_STAGES",
    "shard_estimate",
    "fsdp_units",
    "estimate_command",
    "OPTIMIZER_ALIASES",
    "DTYPE_ALIASES",
]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")

DTYPES: dict[str, str] = {
    "fp32": "fp32 weights, gradients, optimizer state and compute",
    "bf16": "mixed precision: fp32 weights/gradients/optimizer state, forward under autocast(bfloat16)",
    "fp16": "mixed precision: fp32 weights/gradients/optimizer state, forward under autocast(float16)",
    "bf16-pure": "bf16 weights, gradients and optimizer state, no autocast, no fp32 master copy",
}

OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW (2 moments per parameter, in the parameter's dtype)",
    "sgd": "torch.optim.SGD without momentum (no state)",
    "adamw8bit": "bitsandbytes.optim.AdamW8bit (2 moments of 1 byte, fp32 absmax per 256 elements)",
    "offload-adamw": "memlab.offload.OffloadedAdamW (chapter 04): device keeps the params in their dtype and their "
                     "grads; host keeps fp32 master weights, an fp32 grad slot and 2 fp32 moments (+ staging on CUDA)",
}

OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")

# One vocabulary across estimate, plan and train: other spellings accepted, one canonical name kept.
# Note "bf16": here (and in memlab.amp, Trainer(bf16=True)) mixed precision with fp32 master weights;
# memlab.plan's Stack(precision="bf16") and memlab.train's "bf16" are pure bf16 = this module's
# "bf16-pure" (plan's "bf16-mixed" = this "bf16").
OPTIMIZER_ALIASES = {"adam8bit": "adamw8bit", "adamw-8bit": "adamw8bit", "adamw_8bit": "adamw8bit"}
DTYPE_ALIASES = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def _canonical_optimizer(name: Any) -> Any:
    return OPTIMIZER_ALIASES.get(name, name) if isinstance(name, str) else name


def _canonical_dtype(name: Any) -> Any:
    return DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name

# bitsandbytes' blockwise 8-bit optimizers (bitsandbytes/optim/optimizer.py, Optimizer8bit /
# Optimizer2State.init_state): tensors with fewer than min_8bit_size elements keep 32-bit
# state; larger ones keep uint8 states and one fp32 absmax per block of 256 elements.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256


# --------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes in a size such as ``"24GB"`` (10**9), ``"80GiB"`` (2**30), ``"24e9"`` or ``512``.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024).
    A GPU sold as "24 GB" usually has 24 GiB: write ``24GiB`` (or the card's name, see
    :func:`resolve_gpu`) to use all of it.
    """
    allowed = "a number of bytes (24e9) or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 24GB, 80GiB)"
    if isinstance(text, bool):
        raise ValueError(f"size={text!r} is invalid; allowed: {allowed}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"size={text!r} is invalid; allowed: {allowed}")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"size={text!r} is invalid; allowed: a positive size, {allowed}")
    return int(round(value * _UNITS[unit]))


# --------------------------------------------------------------------------------------
# CUDA facts the estimate states next to the traced peak (measured on an H100; see
# results/h100/ and memlab.gpus)
# --------------------------------------------------------------------------------------

# cuBLAS allocates a 32 MiB workspace through the caching allocator for each thread that runs
# matmuls: the forward thread and the autograd engine's backward thread (results/h100/diag.log).
# It is in torch.cuda.max_memory_allocated but no op returns it.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
CUBLAS_THREADS = 2
# max_memory_reserved / max_memory_allocated at the peak of a steady training step, measured on
# an H100 (TinyGPT and a Llama with a 32k vocabulary, 6 x 512, batch 8 x 512, fp32 and bf16 AMP):
# 1.05, 1.10, 1.09, 1.14 (results/h100/estimator_probe.json). The largest is the stated margin.
FRAGMENTATION_MARGIN = 1.14

ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash")
LOSSES = ("auto", "hf", "memlab")


# --------------------------------------------------------------------------------------
# The result
# --------------------------------------------------------------------------------------


@dataclass
class MemoryEstimate:
    """Peak bytes of a training step and where they go.

    ``peak_bytes`` is the traced peak of live tensor storages (what ``MemoryTracker`` counts);
    ``breakdown`` its split over :data:`CATEGORIES`, ``breakdown_end`` the same at the end of the
    step. ``peak_phase`` is the phase that holds the peak ("forward", "backward", "optimizer") and
    ``phase_peaks`` the peak of each phase, so the effect of checkpointing stays visible when the
    optimizer step holds the peak. ``extras`` are bytes outside any tensor that the allocator
    still counts on the target (cuBLAS workspaces on CUDA): ``allocated_bytes = peak_bytes +
    sum(extras)`` is the estimate of ``torch.cuda.max_memory_allocated``; ``reserved_bytes`` adds
    the stated fragmentation margin. ``fake`` says whether the step ran on fake tensors (an
    estimate) or real ones (a measurement); ``notes`` lists anything modelled rather than traced.
    ``host_bytes`` (with ``optimizer="offload-adamw"``) is host memory the optimizer keeps, split in
    ``host_breakdown``; it is counted, not traced, and is not part of ``peak_bytes`` (the device's).
    """

    model: str
    n_params: int
    batch_size: int
    seq_len: int
    dtype: str
    optimizer: str
    checkpointing: bool
    peak_bytes: int
    breakdown: dict[str, int]
    breakdown_end: dict[str, int] = field(default_factory=dict)
    max_activation_bytes: int = 0
    largest_layer_params: int = 0
    device: str = "cpu"
    traced_on: str = "cpu"
    fake: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    tracker: Any = field(default=None, repr=False, compare=False)
    peak_phase: str = ""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    extras: dict[str, int] = field(default_factory=dict)
    attention: str = ""
    step: str = ""
    optimizer_impl: str = ""
    extrapolated_from: tuple[int, ...] = ()
    phase_breakdowns: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    host_bytes: int = 0
    host_breakdown: dict[str, int] = field(default_factory=dict)
    world_size: int = 1
    zero_stage: int = 0
    adapter: str = ""  # memlab.adapters.AdapterSpec.describe() of a LoRA/QLoRA estimate, "" for a full fine-tune

    @property
    def allocated_bytes(self) -> int:
        """``peak_bytes`` plus the stated extras: the estimate of ``max_memory_allocated``."""
        return self.peak_bytes + sum(self.extras.values())

    @property
    def reserved_bytes(self) -> int:
        """``allocated_bytes`` times the fragmentation margin on CUDA targets (what
        ``max_memory_reserved`` reached in the measured steps); ``allocated_bytes`` elsewhere."""
        if torch.device(self.device).type != "cuda":
            return self.allocated_bytes
        return int(math.ceil(self.allocated_bytes * FRAGMENTATION_MARGIN))

    def _budget(self, gpu: Any) -> int:
        return resolve_gpu(gpu)[1] if torch.device(self.device).type == "cuda" else parse_size(gpu)

    def fits(self, gpu: int | str) -> bool:
        """True when the peak fits ``gpu``: a card name (``"h100-80gb"``, see :mod:`memlab.gpus`) or
        its memory (``"24GiB"``, ``"24GB"``, an int of bytes).

        On a CUDA target the comparison is honest: ``reserved_bytes`` (tensors + cuBLAS
        workspaces + the fragmentation margin) against the card's memory minus the stated CUDA
        context reserve. On a CPU target, ``peak_bytes`` against ``gpu`` bytes as given.
        """
        need = self.reserved_bytes if torch.device(self.device).type == "cuda" else self.peak_bytes
        return need <= self._budget(gpu)

    def headroom(self, gpu: int | str) -> int:
        """Budget minus what :meth:`fits` compares (negative when it does not fit)."""
        need = self.reserved_bytes if torch.device(self.device).type == "cuda" else self.peak_bytes
        return self._budget(gpu) - need

    def describe(self) -> str:
        kind = "estimate (fake tensors)" if self.fake else "measured"
        ck = ", gradient checkpointing" if self.checkpointing else ""
        impl = f" ({self.optimizer_impl})" if self.optimizer_impl and self.optimizer in ("adamw", "sgd", "offload-adamw") else ""
        return (
            f"{self.model} ({_params(self.n_params)} params): batch {self.batch_size} x seq "
            f"{self.seq_len}, {self.dtype}, {self.optimizer}{impl}{ck}{self._ranks()}"
            f"{'; ' + self.adapter if self.adapter else ''} -- {kind} on {self.traced_on} "
            f"for {self.device}"
        )

    def _ranks(self) -> str:
        if self.world_size == 1 and self.zero_stage == 0:
            return ""
        return f", ZeRO stage {self.zero_stage}, per rank of {self.world_size} (batch per rank)"

    def table(self) -> str:
        """The peak and its breakdown (and the end-of-step state) as a plain-text table."""
        rows = [("category", "at peak", "share", "end of step")]
        for key in CATEGORIES:
            at = self.breakdown.get(key, 0)
            share = f"{100 * at / self.peak_bytes:.1f}%" if self.peak_bytes else "-"
            rows.append((key, format_bytes(at), share, format_bytes(self.breakdown_end.get(key, 0))))
        rows.append(("total", format_bytes(self.peak_bytes), "100.0%",
                     format_bytes(sum(self.breakdown_end.values()))))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [self.describe(), f"recipe {self.dtype}: {DTYPES.get(self.dtype, '')}"]
        if self.step:
            lines.append(f"step: {self.step}")
        if self.attention:
            lines.append(f"attention: {self.attention}")
        lines.append("")
        for j, r in enumerate(rows):
            if j == len(rows) - 1:
                lines.append("  ".join("-" * w for w in widths))
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append(f"peak: {self.peak_bytes:,} bytes of tensors, in the {self.peak_phase or '?'} phase")
        if self.phase_peaks:
            lines.append("phase peaks: " + ", ".join(
                f"{p} {format_bytes(v)}" for p, v in self.phase_peaks.items() if p in ("forward", "backward", "optimizer")))
        if self.peak_phase == "optimizer":
            fb = max(self.phase_peaks.get("forward", 0), self.phase_peaks.get("backward", 0))
            lines.append(f"the optimizer step holds the peak: the activations are freed by then, so checkpointing "
                         f"or a shorter sequence lowers only the forward/backward peak ({format_bytes(fb)})")
        if self.host_breakdown:
            lines.append("device: traced (params in their dtype, grads, activations; the CPU step writes the params "
                         "in place and allocates nothing on the device)")
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host_breakdown.items())
            lines.append(f"host: {format_bytes(self.host_bytes)} counted, not traced ({parts}); "
                         f"not in the device peak")
        for label, b in self.extras.items():
            lines.append(f"+ {label}: {format_bytes(b)}")
        if self.extras:
            lines.append(f"allocated (max_memory_allocated): {format_bytes(self.allocated_bytes)}")
        if torch.device(self.device).type == "cuda":
            lines.append(f"reserved (allocated x {FRAGMENTATION_MARGIN}, allocator fragmentation measured on an H100): "
                         f"{format_bytes(self.reserved_bytes)}")
        if self.extrapolated_from:
            a, b = self.extrapolated_from
            lines.append(f"traced at {a} and {b} decoder layers, extrapolated exactly by layer count "
                         f"(extrapolate=False traces all of them)")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def plot(self, **kwargs: Any):
        """The tracker's timeline plot (see :meth:`memlab.profiler.MemoryTracker.plot`)."""
        if self.tracker is None or not hasattr(self.tracker, "plot"):
            raise ValueError("this MemoryEstimate has no timeline (extrapolated or modelled): "
                             "estimate with extrapolate=False to plot it")
        return self.tracker.plot(**kwargs)


class _PhaseSummary:
    """What an extrapolated estimate can say of its (unbuilt) timeline: the peak's phase and the
    per-phase peaks (the attributes of MemoryTracker that a reader of an estimate uses)."""

    def __init__(self, peak_bytes: int, peak_phase: str, phase_peaks: dict[str, int]) -> None:
        self.peak_bytes = peak_bytes
        self.peak_phase = peak_phase
        self._phase_peaks = dict(phase_peaks)

    def phase_peaks(self) -> dict[str, int]:
        return dict(self._phase_peaks)

    def __repr__(self) -> str:
        return f"_PhaseSummary(peak={format_bytes(self.peak_bytes)}, phase={self.peak_phase})"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**8 else f"{n / 1e6:.2f}M"


def resolve_gpu(gpu: Any) -> tuple[str, int]:
    """(label, usable bytes) of ``--gpu``: a card name of :mod:`memlab.gpus` or a size.

    A card: its total as the driver reports it, minus the stated CUDA context reserve. A size
    (``24GiB`` = 24 x 2**30; ``24GB`` = 24 x 10**9, shown in GiB): that memory minus the same
    reserve. Anything else (a bare number under 1 GiB such as ``0.4``, an unknown name) is a
    ``ValueError`` naming what is allowed.
    """
    from memlab import gpus

    card = gpus.find_gpu(gpu) if isinstance(gpu, str) else None
    if card is not None:
        total = card.total_bytes
        label = f"{card.name}: {format_bytes(total)} as the driver reports it"
    else:
        try:
            total = parse_size(gpu)
        except ValueError:
            raise ValueError(
                f"gpu={gpu!r} is invalid{gpus.suggest(gpu) if isinstance(gpu, str) else ''}; allowed: a card "
                f"({', '.join(gpus.gpu_names())}) or a size such as 24GiB or 24GB"
            ) from None
        if total < 2**30:
            raise ValueError(f"gpu={gpu!r} is {total:,} bytes, less than 1 GiB; allowed: a card "
                             f"({', '.join(gpus.gpu_names())}) or a size with a unit, such as 24GiB or 80GB")
        label = f"{format_bytes(total)}"
        if isinstance(gpu, str) and re.search(r"[0-9.]\s*[kmgt]b\s*$", gpu.strip().lower()):
            label += f" ({gpu.strip()}, decimal units)"
    usable = total - gpus.CONTEXT_RESERVE_BYTES
    return f"{label} - CUDA context {format_bytes(gpus.CONTEXT_RESERVE_BYTES)} = {format_bytes(usable)} usable", usable


# --------------------------------------------------------------------------------------
# Building the model
# --------------------------------------------------------------------------------------


def _is_hf_config(obj: Any) -> bool:
    try:
        from transformers import PretrainedConfig
    except Exception:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, PretrainedConfig)


# A config must give these (one name of each group) for the model to have a size at all.
_REQUIRED_DIMS = (
    ("hidden_size", "n_embd", "d_model"),
    ("num_hidden_layers", "n_layer", "num_layers"),
    ("num_attention_heads", "n_head"),
    ("vocab_size",),
)
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_POSITION_FIELDS = ("max_position_embeddings", "n_positions")
# position tables of learned rows: no flag makes a longer sequence meaningful
_LEARNED_POSITIONS = ("gpt2", "gpt_neo", "gpt_bigcode", "opt", "bert", "roberta")


def load_config(path: str | os.PathLike):
    """A ``transformers`` config from a local ``config.json`` (or a folder holding one), offline.

    Every error names the file: missing, unreadable, not JSON, no ``model_type``, an unknown
    ``model_type``, or a dimension missing (``hidden_size``, layers, heads, ``vocab_size``: a
    config without them would silently become the architecture's default size).
    """
    with needs("memlab estimate"):
        from transformers import AutoConfig

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        st = os.stat(path)
        if not _stat.S_ISREG(st.st_mode):
            raise ValueError(f"config file {path!r} is not a regular file (a device, a pipe or a socket); "
                             "allowed: a config.json file")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"config file {path!r} is larger than {MAX_CONFIG_BYTES // 2**20} MiB; allowed: a "
                             "config.json (a few KiB)")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {path!r} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"config file {path!r} has no 'model_type'; allowed: a transformers config.json")
    missing = [" / ".join(group) for group in _REQUIRED_DIMS if not any(k in data for k in group)]
    if missing:
        raise ValueError(f"config file {path!r} lacks {', '.join(missing)}: without them transformers would "
                         f"use its default size for {data['model_type']!r}; allowed: a complete config.json")
    from memlab.models import validate_config

    validate_config(data, f"config file {path!r}")
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"config file {path!r}: model_type={model_type!r} cannot be built by transformers ({exc})") from None


MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KiB; /dev/zero or a huge file is refused
MAX_BATCH = 2**20  # sequences per step (per rank)
MAX_SEQ_LEN = 2**20  # tokens per sequence
MAX_TOKENS = 2**31  # batch x seq_len: beyond it attention's element counts overflow int64
MAX_WORLD_SIZE = 1024  # ranks: stage 3 traces a fake process group of this many


def check_input_bounds(batch_size: Any, seq_len: Any, world_size: Any = 1) -> None:
    """Refuse, before any work, a batch, a sequence or a world size no trace can finish in seconds.

    ValueError naming the argument, its value and the allowed range (see ``MAX_*`` above)."""
    for name, v, hi in (("batch_size", batch_size, MAX_BATCH), ("seq_len", seq_len, MAX_SEQ_LEN),
                        ("world_size", world_size, MAX_WORLD_SIZE)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ValueError(f"{name}={v!r} is invalid; allowed: an int from 1 to {hi:,}")
    if batch_size * seq_len > MAX_TOKENS:
        raise ValueError(f"batch_size={batch_size} x seq_len={seq_len} = {batch_size * seq_len:,} tokens is invalid; "
                         f"allowed: at most {MAX_TOKENS:,} tokens per step")


def _check_overrides(cfg: Any, overrides: Mapping[str, Any], what: str) -> None:
    """Unknown keys are errors (a typo would otherwise be ignored)."""
    import difflib

    try:
        default = type(cfg)()
    except Exception:  # pragma: no cover - every transformers config has defaults
        default = cfg
    known = set(vars(default)) | set(vars(cfg)) | set(getattr(type(cfg), "attribute_map", {}))
    for key in overrides:
        if key in known or hasattr(default, key):
            continue
        close = difflib.get_close_matches(key, sorted(k for k in known if not k.startswith("_")), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"config_overrides key {key!r} is not a field of {type(cfg).__name__} ({what}){hint}")


@dataclass
class _Spec:
    """What to build: a display name, and either a transformers config or a plain callable."""

    name: str
    config: Any = None
    fn: Callable[[], nn.Module] | None = None
    adapter: Any = None  # a memlab.adapters.AdapterSpec: LoRA / QLoRA built on the base (memlab.adapters)

    @property
    def is_hf(self) -> bool:
        return self.config is not None

    def layers(self) -> tuple[str, int] | None:
        for f in _LAYER_FIELDS:
            v = getattr(self.config, f, None) if self.config is not None else None
            if isinstance(v, int) and v > 0:
                return f, v
        return None

    def homogeneous(self) -> bool:
        """A stack of identical decoder layers (no per-layer types that differ)."""
        if self.layers() is None:
            return False
        for f in ("layer_types", "sliding_window_pattern_list", "block_types"):
            v = getattr(self.config, f, None)
            if isinstance(v, (list, tuple)) and len(set(map(str, v))) > 1:
                return False
        if getattr(self.config, "use_sliding_window", False) and getattr(self.config, "max_window_layers", None) not in (None, 0):
            mw, (_, n) = self.config.max_window_layers, self.layers()
            if 0 < mw < n:
                return False
        return True

    def at_depth(self, depth: int) -> "_Spec":
        cfg = copy.deepcopy(self.config)
        f, n = self.layers()
        setattr(cfg, f, depth)
        for lf in ("layer_types",):
            v = getattr(cfg, lf, None)
            if isinstance(v, (list, tuple)) and len(v) == n:
                setattr(cfg, lf, list(v[:1]) * depth)
        return _Spec(self.name, config=cfg, adapter=self.adapter)

    def build(self, dtype: str, attn: str | None) -> nn.Module:
        if self.adapter is not None:  # the one builder of adapted models (estimate, CLI and plan)
            from memlab import adapters

            base = adapters.base_dtype(dtype)
            if self.fn is not None:
                model = _build_in(self.fn, base)
            else:
                model = self._from_config(base, attn)
            return adapters.apply_adapter(model, self.adapter, dtype)
        if self.fn is not None:
            return _build(self.fn, dtype)
        # The weights' dtype comes from the recipe, never from the config's torch_dtype / dtype
        # (transformers 5 would otherwise build a bf16 model from a config that says bfloat16).
        return self._from_config(torch.bfloat16 if dtype == "bf16-pure" else torch.float32, attn)

    def _from_config(self, param_dtype: torch.dtype, attn: str | None) -> nn.Module:
        with needs("memlab estimate"):
            from transformers import AutoModelForCausalLM
        kw = {} if attn is None else {"attn_implementation": attn}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(self.config, dtype=param_dtype, **kw)


def _resolve_model(model: Any, config_overrides: Mapping[str, Any] | None) -> _Spec:
    """A :class:`_Spec` for a preset name, a config.json path, a config or a callable."""
    from memlab.models import validate_config

    overrides = dict(config_overrides or {})
    if isinstance(model, str):
        from memlab.models import PRESETS, UnknownPresetError, preset_config

        if model in PRESETS:
            if overrides:
                _check_overrides(preset_config(model), overrides, f"preset {model!r}")
            cfg = preset_config(model, **overrides)
            return _Spec(model, config=cfg)
        from memlab import hub

        if hub.looks_like_repo_id(model):  # "org/name": its config.json through transformers (memlab.hub)
            cfg = hub.load_hub_config(model)
            _check_overrides(cfg, overrides, f"model {model!r}")
            for k, v in overrides.items():
                setattr(cfg, k, v)
            validate_config(cfg, f"model {model!r}")
            return _Spec(f"{model} ({getattr(cfg, 'model_type', '?')})", config=cfg)
        if model.endswith(".json") or os.path.isdir(model) or os.sep in model:
            if not os.path.exists(model):
                raise FileNotFoundError(f"config file {model!r}: no such file")
            cfg = load_config(model)
            _check_overrides(cfg, overrides, f"config file {model!r}")
            for k, v in overrides.items():
                setattr(cfg, k, v)
            validate_config(cfg, f"config file {model!r} with --set {overrides}" if overrides else f"config file {model!r}")
            name = os.path.basename(os.path.dirname(os.path.abspath(model))) if model.endswith(".json") else os.path.basename(model.rstrip("/"))
            return _Spec(f"{name} ({getattr(cfg, 'model_type', '?')})", config=cfg)
        import difflib

        close = difflib.get_close_matches(model.lower(), sorted(PRESETS), n=3, cutoff=0.6)
        raise UnknownPresetError(
            f"unknown model={model!r}{f' (did you mean {close[0]}?)' if close else ''}; "
            f"allowed: a preset ({', '.join(sorted(PRESETS))}), "
            f"the path of a transformers config.json, or a Hub model id such as meta-llama/Llama-3.1-8B"
        )
    if _is_hf_config(model):
        cfg = copy.deepcopy(model)
        _check_overrides(cfg, overrides, type(cfg).__name__)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        validate_config(cfg, type(cfg).__name__)
        return _Spec(type(cfg).__name__, config=cfg)
    if isinstance(model, nn.Module):
        raise TypeError(
            f"model={type(model).__name__} instance: pass a function that builds it instead "
            f"(e.g. lambda: {type(model).__name__}(...)), so it can be built on fake tensors"
        )
    if callable(model):
        if overrides:
            raise ValueError("config_overrides only apply to a preset, a config.json or a transformers config")
        return _Spec(getattr(model, "__name__", type(model).__name__), fn=model)
    raise TypeError(
        f"model={model!r} is invalid; allowed: a preset name, a config.json path, a transformers "
        f"config, or a callable returning an nn.Module"
    )


def _check_positions(spec: _Spec, seq_len: int, allow_longer_seq: bool) -> None:
    """seq_len beyond the model's positions is an error (a fake trace would not notice)."""
    if spec.config is None:
        return
    for f in _POSITION_FIELDS:
        n = getattr(spec.config, f, None)
        if isinstance(n, int) and n > 0:
            break
    else:
        return
    if seq_len <= n:
        return
    learned = ("n_positions" in vars(spec.config) or getattr(spec.config, "model_type", "") in _LEARNED_POSITIONS
               or getattr(spec.config, "position_embedding_type", None) == "absolute")
    if learned:
        f = "n_positions" if "n_positions" in vars(spec.config) else f
    if learned:
        raise ValueError(f"seq_len={seq_len} exceeds {spec.name}'s {f}={n}: its position table has {n} rows; "
                         f"allowed: seq_len <= {n} (or a larger {f} in config_overrides, a different model)")
    if not allow_longer_seq:
        raise ValueError(f"seq_len={seq_len} exceeds {spec.name}'s {f}={n}; allowed: seq_len <= {n}, or "
                         f"allow_longer_seq=True (CLI --allow-longer-seq) if you extend its context (e.g. RoPE scaling)")


def _vocab_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError(f"cannot find the vocabulary size of {type(model).__name__}: give it a config.vocab_size or an nn.Embedding")


def _enable_checkpointing(model: nn.Module) -> None:
    from memlab.models import TinyGPT

    if isinstance(model, TinyGPT):
        model.gradient_checkpointing_enable()
        return
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(model, name, None)
        if callable(fn):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                fn()
            return
    raise ValueError(
        f"checkpointing=True but {type(model).__name__} has no gradient_checkpointing_enable(); "
        f"allowed: TinyGPT, transformers models, or a model with that method"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build(builder: Callable[[], nn.Module], dtype: str) -> nn.Module:
    """Build the model; for "bf16-pure" directly in bf16 (created, not converted: converting
    fake parameters in place is refused, and building in bf16 never holds an fp32 copy)."""
    if dtype != "bf16-pure":
        return builder()
    return _build_in(builder, torch.bfloat16)


def _build_in(builder: Callable[[], nn.Module], param_dtype: torch.dtype) -> nn.Module:
    if param_dtype == torch.float32:
        return builder()
    with _default_dtype(param_dtype):
        model = builder()
    for p in model.parameters():  # anything built with an explicit fp32 dtype
        if p.is_floating_point() and p.dtype != param_dtype:
            p.data = p.data.to(param_dtype)
    return model


def _prepare(model: nn.Module, dtype: str, checkpointing: bool) -> nn.Module:
    model.train()
    if checkpointing:
        _enable_checkpointing(model)
    return model


def _largest_layer_params(model: nn.Module) -> int:
    best = 0
    for m in model.modules():
        best = max(best, sum(p.numel() for p in m.parameters(recurse=False)))
    return best


# --------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------


def _check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {', '.join(repr(a) for a in allowed)}")


def _bnb():
    import io

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        import bitsandbytes  # noqa: F401  (prints a warning about optional CPU kernels)
    return bitsandbytes


def _resolve_impl(impl: str, device: str) -> str:
    if impl == "auto":
        return "foreach" if torch.device(device).type == "cuda" else "for-loop"
    return impl


def make_optimizer(
    name: str, params: Any, *, impl: str = "auto", device: str = "cpu", **kwargs: Any
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (see :data:`OPTIMIZERS`) over ``params``.

    ``impl`` picks torch's implementation: "auto" is what ``torch.optim.AdamW(params)`` picks on
    ``device`` (foreach on CUDA, the for-loop on CPU), or "for-loop" / "foreach" / "fused".
    """
    name = _canonical_optimizer(name)
    _check_choice("optimizer", name, tuple(OPTIMIZERS))
    _check_choice("optimizer_impl", impl, OPTIMIZER_IMPLS)
    params = list(params)
    if name == "adamw8bit":
        return _bnb().optim.AdamW8bit(params, **kwargs)
    if name == "offload-adamw":
        from memlab.offload import OffloadedAdamW

        return OffloadedAdamW(params, **kwargs)
    impl = _resolve_impl(impl, device)
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    if name == "adamw":
        return torch.optim.AdamW(params, **{**flags, **kwargs})
    if impl == "fused":
        flags = dict(foreach=False)  # SGD without momentum: fused buys nothing
    return torch.optim.SGD(params, lr=kwargs.pop("lr", 1e-3), **{**flags, **kwargs})


class _OffloadDeviceSide(torch.optim.Optimizer):
    """What :class:`memlab.offload.OffloadedAdamW` does on the device, for a fake trace: nothing is
    allocated there. Gradients stay on the device until the step (or, with ``offload_gradients``,
    a post-accumulate-grad hook frees each one once copied to the host); the step runs on the host
    and copies the updated weights back into the parameters in place. The host side is counted
    (:func:`_offload_host_breakdown`)."""

    def __init__(self, params: Any, offload_gradients: bool = False, **hparams: Any) -> None:
        super().__init__(list(params), {})
        self.offload_gradients = offload_gradients
        if offload_gradients:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(_free_grad)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return None


def _free_grad(p: torch.Tensor) -> None:
    p.grad = None  # copied to its host slot (a device-to-host copy allocates nothing on the device)


def _offload_host_breakdown(params: Sequence[torch.Tensor], target: torch.device) -> dict[str, int]:
    """Host bytes of OffloadedAdamW over ``params``: what its constructor allocates on the host."""
    from memlab.offload import device_host_bytes

    n = sum(p.numel() for p in params)
    fp32 = device_host_bytes(n, "offload-adamw")["host"]  # 16 bytes/param: master + grad slot + 2 moments
    out = {"fp32 master weights": 4 * n, "fp32 grad slots": 4 * n, "fp32 moments": 8 * n}
    assert sum(out.values()) == fp32
    if target.type == "cuda":
        out["pinned staging (param dtype)"] = sum(p.numel() * p.element_size() for p in params)
    out["step counters"] = 4 * len(params)
    return out


def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except Exception:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str,
          step: Callable[[nn.Module, dict], torch.Tensor] | None) -> torch.Tensor:
    from memlab.models import lm_loss

    if step is not None:
        out = step(model, {"input_ids": x, "labels": x})
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise TypeError(f"step={getattr(step, '__name__', step)!r} returned {type(out).__name__}"
                            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}; allowed: a scalar loss tensor")
        return out
    if loss == "hf":
        return model(input_ids=x, labels=x, use_cache=False).loss
    return lm_loss(model, x, y)


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    dtype: str = "fp32",
    loss: str = "memlab",
    step: Callable[[nn.Module, dict], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One step as :func:`estimate_training_memory` runs it: zero_grad(set_to_none), forward and
    loss (under autocast for "bf16"/"fp16"), backward, optimizer.step(). Returns the loss.

    The loss: ``step(model, {"input_ids": x, "labels": x})`` when given; else ``loss="hf"``,
    transformers' own (``model(input_ids=x, labels=x).loss``, as the Trainer computes it: the
    logits upcast to fp32, shifted inside); else ``loss="memlab"``, :func:`memlab.models.lm_loss`
    of ``x`` against the targets ``y``.
    """
    _check_choice("dtype", dtype, tuple(DTYPES))
    optimizer.zero_grad(set_to_none=True)
    if dtype in ("bf16", "fp16"):
        amp = torch.bfloat16 if dtype == "bf16" else torch.float16
        with torch.autocast(device_type=x.device.type, dtype=amp):
            out = _loss(model, x, y, loss, step)
    else:
        out = _loss(model, x, y, loss, step)
    out.backward()
    optimizer.step()
    return out.detach()


def _bnb_state_bytes(model: nn.Module, dtype: str) -> int:
    """Bytes of bitsandbytes AdamW8bit's state for ``model`` (its documented layout)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        if n < BNB_MIN_8BIT_SIZE:
            total += 2 * n * 4  # two fp32 moments
        else:
            blocks = -(-n // BNB_BLOCKSIZE)
            total += 2 * n + 2 * blocks * 4  # two uint8 moments + two fp32 absmax per block
    return total


def load_step(spec: str) -> Callable[[nn.Module, dict], torch.Tensor]:
    """``"module:function"`` -> the function (the current directory is importable)."""
    import importlib

    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"step={spec!r} is invalid; allowed: 'module:function' (e.g. mystep:loss_fn), "
                         f"a function (model, batch) -> loss with batch = {{'input_ids': x, 'labels': x}}")
    mod_name, fn_name = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"step={spec!r}: cannot import module {mod_name!r} ({exc})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"step={spec!r}: module {mod_name!r} ({getattr(mod, '__file__', '?')}) has no function {fn_name!r}")
    return fn


# --------------------------------------------------------------------------------------
# Attention: which kernel the target runs, and what it keeps for backward
# --------------------------------------------------------------------------------------


def _attention_plan(model: nn.Module, spec: _Spec, requested: str, dtype: str, target: torch.device,
                    traced_on: str) -> tuple[str, Any, bool]:
    """(description, context manager for the traced step, softmax-scratch rule on?).

    On a CUDA target traced on CPU fake tensors, SDPA picks its CUDA kernel as PyTorch does
    (``sdp_utils``): flash for fp16/bf16 inputs (keeps output + logsumexp, as the CPU flash kernel
    does, bytes measured equal on an H100); memory-efficient for fp32 without grouped KV heads
    (output + a logsumexp padded to 32 positions: the padding, < 128 B per head and sequence, is
    not modelled); math for fp32 with grouped KV heads (no fused kernel takes fp32 GQA: it keeps
    the b x h x s x s probabilities, measured on an H100), so the step is traced with the math
    kernel forced. Eager attention's softmax backward on CUDA copies its incoming gradient
    (results/h100/diag2.log): a transient rule adds those bytes while the op runs.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg_ = getattr(model, "config", None)
    impl = getattr(cfg_, "_attn_implementation", None) or getattr(cfg_, "attention", None)  # TinyGPT: "attention"
    if not isinstance(impl, str):
        impl = "the model's own"
    cuda = target.type == "cuda"
    if impl == "eager":
        if cuda:
            return ("eager (softmax materialised: b x h x s x s probabilities kept for backward; "
                    "CUDA softmax backward's copy of its incoming gradient added while it runs)"), contextlib.nullcontext(), True
        return "eager (softmax materialised: b x h x s x s probabilities kept for backward)", contextlib.nullcontext(), False
    if impl not in ("sdpa", "manual") and not str(impl).startswith("flash"):
        return str(impl), contextlib.nullcontext(), False
    if impl == "manual":  # TinyGPT's own attention
        extra = ("; CUDA softmax backward's copy of its incoming gradient added while it runs" if cuda else "")
        return f"manual (softmax materialised: b x h x s x s probabilities kept for backward{extra})", contextlib.nullcontext(), cuda
    if not cuda:
        return "sdpa on CPU (flash kernel for CPU: keeps output + logsumexp)", contextlib.nullcontext(), False
    cfg = spec.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    gqa = bool(heads and kv and kv < heads)
    sixteen = dtype in ("bf16", "fp16", "bf16-pure")
    if requested == "flash" and not sixteen:
        raise ValueError(f"attn_implementation='flash' needs fp16/bf16 compute; dtype={dtype!r} computes in fp32")
    if sixteen or requested == "flash":
        kernel, backend = "flash", SDPBackend.FLASH_ATTENTION
        what = "CUDA flash kernel: keeps output + logsumexp (no s x s matrix)"
    elif gqa:
        kernel, backend = "math", SDPBackend.MATH
        what = "CUDA math kernel (fp32 with grouped KV heads has no fused kernel): keeps b x h x s x s probabilities"
    else:
        kernel, backend = "efficient", SDPBackend.FLASH_ATTENTION
        what = "CUDA memory-efficient kernel: keeps output + logsumexp (no s x s matrix)"
    label = "flash" if requested == "flash" else "sdpa"
    if traced_on.startswith("cuda"):
        # fake CUDA tensors pick their kernel by shape rules that accept fp32 GQA; the real kernel is
        # the math one (measured on an H100): force it there, and flash where flash was asked for
        force = requested == "flash" or kernel == "math"
        return f"{label}: {what}, traced", (sdpa_kernel([backend]) if force else contextlib.nullcontext()), False
    backends = [backend] if backend == SDPBackend.MATH else [backend, SDPBackend.MATH]
    return (f"{label}: {what}; modelled on CPU with the {'math' if kernel == 'math' else 'CPU flash'} kernel "
            f"(same saved tensors)"), sdpa_kernel(backends), False


def _make_tracker(model: nn.Module, opt: torch.optim.Optimizer, softmax_rule: bool, per_rank: bool = False):
    """A MemoryTracker that also notes which attention ops ran, with the per-op rule for CUDA
    softmax backward's scratch when asked. ``per_rank`` (a model sharded by FSDP2): the tracker of
    :func:`memlab.distributed.rank_tracker`, which counts a DTensor's local shard and FSDP2's storage
    resizes."""
    from memlab.profiler import MemoryTracker

    base: type = MemoryTracker
    if per_rank:
        from memlab.distributed import rank_tracker

        base = type(rank_tracker(model, opt, resizes=True))

    softmax_bwd = torch.ops.aten._softmax_backward_data.default
    flash_ops = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            flash_ops.add(op.default)

    class _Tracker(base):  # type: ignore[valid-type, misc]
        scratch_bytes = 0
        fused_attention_calls = 0
        softmax_calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func in flash_ops:
                self.fused_attention_calls += 1
            elif func is softmax_bwd:
                self.softmax_calls += 1
            if softmax_rule and func is softmax_bwd and isinstance(args[0], torch.Tensor) and args[0].dim() >= 3:
                g = args[0]
                extra = self.allocated_bytes(g.numel() * g.element_size(), g.device)
                # alive while the kernel runs, with its output: count it at that moment only
                self.add_transient(extra)
                self.scratch_bytes = max(self.scratch_bytes, extra)
            return out

    return _Tracker(model=model, optimizer=opt, resizes=per_rank)


def _run(
    spec: _Spec,
    *,
    batch_size: int,
    seq_len: int,
    dtype: str,
    optimizer: str,
    checkpointing: bool,
    warmup_steps: int,
    device: str,
    optimizer_impl: str,
    optimizer_kwargs: Mapping[str, Any] | None,
    fake: bool,
    seed: int,
    loss: str = "auto",
    step: Callable[[nn.Module, dict], torch.Tensor] | str | None = None,
    attn_implementation: str | None = "auto",
    kernel_scratch: bool = True,
    fsdp_world_size: int = 0,
) -> MemoryEstimate:
    for arg, val, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("warmup_steps", warmup_steps, 0)):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"{arg}={val!r} is invalid; allowed: an int >= {low}")
    _check_choice("dtype", dtype, tuple(DTYPES))
    _check_choice("optimizer", optimizer, tuple(OPTIMIZERS))
    _check_choice("optimizer_impl", optimizer_impl, OPTIMIZER_IMPLS)
    _check_choice("loss", loss, LOSSES)
    attn = "auto" if attn_implementation is None else attn_implementation
    _check_choice("attn_implementation", attn, ATTN_IMPLEMENTATIONS)
    if isinstance(step, str):
        step = load_step(step)
    if step is not None and not callable(step):
        raise TypeError(f"step={step!r} is invalid; allowed: a callable (model, batch) -> loss or 'module:function'")

    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        if not fake:
            raise ValueError("device='cuda' needs a CUDA GPU for a measurement; use device='cpu'")
        traced_on = "cpu"  # a CPU-only torch cannot even fake CUDA tensors: trace on CPU
    else:
        traced_on = str(target)
    if attn == "flash" and target.type != "cuda":
        raise ValueError("attn_implementation='flash' is a CUDA kernel; allowed on device='cpu': 'auto', 'eager', 'sdpa'")
    notes: list[str] = []
    cuda_rules = None
    if traced_on != str(target):
        from memlab import cuda_rules as _cuda_rules

        cuda_rules = _cuda_rules.cuda_semantics()  # CUDA's dropout and autocast op lists (memlab.cuda_rules)
        notes.append(f"traced on {traced_on} fake tensors (no CUDA here): CUDA's dropout and autocast op lists are "
                     f"modelled (memlab.cuda_rules); the attention kernel is the CUDA one, modelled (see attention)")

    if spec.adapter is not None:
        from memlab import adapters as _adapters

        base = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[_adapters.base_dtype(dtype)]
        notes.append(f"{spec.adapter.describe()}; frozen base in {base}"
                     + (" (NF4 linears)" if spec.adapter.kind == "qlora" else "")
                     + (f", forward under autocast({dtype})" if dtype in ("bf16", "fp16") else "")
                     + ": gradients and optimizer state for the adapters only (memlab.adapters)")
    opt_name = optimizer
    modelled_8bit = False
    if optimizer == "adamw8bit":
        try:
            _bnb()
        except Exception as exc:  # pragma: no cover - depends on the install
            modelled_8bit = True
            opt_name = "sgd"
            notes.append(f"bitsandbytes does not import ({type(exc).__name__}); 8-bit AdamW state modelled, not traced")

    build_attn = None if attn == "auto" else ("sdpa" if attn == "flash" else attn)
    if not spec.is_hf and build_attn is not None:
        raise ValueError("attn_implementation applies to transformers models (a preset, a config); "
                         "a callable builds its own attention")

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        # Non-fake inputs are allowed for the few small real tensors an optimizer makes outside
        # the mode (bitsandbytes' quantization maps); they are not model memory.
        mode: Any = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        mode = contextlib.nullcontext()
    with mode, torch.device(traced_on):
        model = _prepare(spec.build(dtype, build_attn), dtype, checkpointing)
        vocab = _vocab_size(model)
    n_params = None
    if fsdp_world_size:  # outside the fake mode: building the device mesh reads real values
        from memlab.models import count_parameters

        n_params = count_parameters(model)  # before sharding (then counted from the DTensors' storages)
        _fully_shard(model)
    if loss == "auto":
        loss = "hf" if _is_hf_model(model) else "memlab"
    if loss == "hf" and step is None and not _is_hf_model(model):
        raise ValueError(f"loss='hf' needs a transformers model; {type(model).__name__} is not one: use loss='memlab' or step=")
    if step is not None:
        step_text = f"your step {getattr(step, '__module__', '?')}.{getattr(step, '__name__', '?')}(model, batch) -> loss, then backward and optimizer.step()"
    elif loss == "hf":
        step_text = "transformers' loss: model(input_ids=x, labels=x).loss (logits upcast to fp32, as the Trainer runs it), backward, optimizer.step()"
    else:
        step_text = "memlab's loss: lm_loss(model, x, y) (cross entropy on the logits), backward, optimizer.step()"
    attention, attn_ctx, softmax_rule = _attention_plan(model, spec, attn, dtype, target, traced_on)
    if softmax_rule and not kernel_scratch:
        softmax_rule = False
        attention = attention.replace("; CUDA softmax backward's copy of its incoming gradient added while it runs",
                                      "; kernel_scratch=False: CUDA softmax backward's scratch copy not added")
    params = [p for p in model.parameters() if p.requires_grad]
    impl = _resolve_impl(optimizer_impl, str(target)) if optimizer != "adamw8bit" else "bitsandbytes"
    host_breakdown: dict[str, int] = {}
    if optimizer == "offload-adamw":
        okw = dict(optimizer_kwargs or {})
        og = okw.get("offload_gradients", False)
        if not isinstance(og, bool):
            raise ValueError(f"optimizer_kwargs['offload_gradients']={og!r} is invalid; allowed: True, False")
        impl = "memlab.offload, step on the CPU" + (", gradients offloaded during backward" if og else "")
        host_breakdown = _offload_host_breakdown(params, target)
        import inspect

        from memlab.offload import OffloadedAdamW

        try:
            inspect.signature(OffloadedAdamW.__init__).bind(None, params, **okw)
        except TypeError as exc:
            raise ValueError(f"optimizer_kwargs={okw!r} is invalid for OffloadedAdamW ({exc}); allowed: lr, betas, eps, "
                             f"weight_decay, pin_memory, overlap, offload_gradients, kernel") from None
        if fake:
            opt = _OffloadDeviceSide(params, **okw)
        else:
            opt = make_optimizer(opt_name, params, device=str(target), **okw)
            if target.type == "cpu":
                notes.append("measured on the CPU, where host == device: OffloadedAdamW's host buffers (master weights, "
                             "moments, step counters; the fp32 grad slots once written) are in the tracked bytes too")
        notes.append("offload-adamw: host bytes counted from OffloadedAdamW's buffers, not traced; device bytes traced")
        if dtype == "bf16-pure":
            notes.append("with offload-adamw the bf16 params have fp32 master weights on the host: "
                         "the update is not rounded to bf16 as plain bf16-pure AdamW's is")
    else:
        opt = make_optimizer(opt_name, params, impl=optimizer_impl, device=str(target), **dict(optimizer_kwargs or {}))
    gen_device = traced_on

    def one_step() -> None:
        x = torch.randint(0, vocab, (batch_size, seq_len), device=gen_device)
        y = torch.randint(0, vocab, (batch_size, seq_len), device=gen_device)
        with cuda_rules if cuda_rules is not None else contextlib.nullcontext():
            training_step(model, opt, x, y, dtype=dtype, loss=loss, step=step)

    with mode, attn_ctx:
        for _ in range(warmup_steps):  # untracked: afterwards the optimizer state exists
            if _FAST_WARMUP and fake:
                # what a first step leaves behind is the optimizer's state (created lazily in its
                # first step()); zero gradients give it at a fraction of a forward/backward's cost
                for p in params:
                    p.grad = torch.zeros_like(p)
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                one_step()
        tracker = _make_tracker(model, opt, softmax_rule, per_rank=bool(fsdp_world_size))
        with tracker:
            one_step()
    seconds = time.perf_counter() - t0

    peak = int(tracker.peak_bytes)
    at_peak = {k: int(v) for k, v in tracker.breakdown(at="peak").items()}
    at_end = {k: int(v) for k, v in tracker.breakdown(at="end").items()}
    max_act = max(_max_category(tracker, "activations"), at_peak["activations"])
    phases: dict[str, int] = {}
    phase_bd: dict[str, dict[str, int]] = {}
    for ev in tracker.timeline:  # each phase's first maximum, as the tracker picks its peak
        if ev.total > phases.get(ev.phase, -1):
            phases[ev.phase] = ev.total
            phase_bd[ev.phase] = {k: int(v) for k, v in ev.bytes.items()}
    if modelled_8bit:
        state = _bnb_state_bytes(model, dtype)
        peak += state  # the state is alive during the whole second step
        at_peak["optimizer"] = at_peak.get("optimizer", 0) + state
        at_end["optimizer"] = at_end.get("optimizer", 0) + state
        phases = {k: v + state for k, v in phases.items()}
        for bd in phase_bd.values():
            bd["optimizer"] = bd.get("optimizer", 0) + state
    if ("flash kernel" in attention or "efficient kernel" in attention) and tracker.fused_attention_calls == 0:
        attention += ("; BUT the model passed an attention mask the CPU flash kernel does not take, so the trace ran the "
                      "math kernel (keeps b x h x s x s probabilities): an overestimate of the CUDA memory-efficient kernel")
        notes.append("attention traced with the math kernel (mask given): activations overestimated for a CUDA target")
    if cuda_rules is not None:
        from memlab import cuda_rules as _cuda_rules

        notes.extend(_cuda_rules.rule_notes(cuda_rules))
    if softmax_rule and getattr(tracker, "scratch_bytes", 0):
        notes.append(f"CUDA softmax backward's scratch copy of its incoming gradient "
                     f"({format_bytes(tracker.scratch_bytes)}) counted while it runs (per-op rule, measured on an H100)")
    extras: dict[str, int] = {}
    if target.type == "cuda":
        extras[f"cuBLAS workspaces ({CUBLAS_WORKSPACE_BYTES // 2**20} MiB x {CUBLAS_THREADS} threads: "
               f"forward and autograd, measured on an H100)"] = CUBLAS_WORKSPACE_BYTES * CUBLAS_THREADS
    from memlab.models import count_parameters

    if n_params is None:
        n_params = count_parameters(model)
    return MemoryEstimate(
        model=spec.name,
        n_params=n_params,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=dtype,
        optimizer=optimizer,
        checkpointing=checkpointing,
        peak_bytes=peak,
        breakdown={k: at_peak.get(k, 0) for k in CATEGORIES},
        breakdown_end={k: at_end.get(k, 0) for k in CATEGORIES},
        max_activation_bytes=int(max_act),
        largest_layer_params=_largest_layer_params(model),
        device=str(target),
        traced_on=traced_on,
        fake=fake,
        seconds=seconds,
        notes=notes,
        tracker=tracker,
        peak_phase=tracker.peak_phase,
        phase_peaks=phases,
        extras=extras,
        attention=attention,
        step=step_text,
        optimizer_impl=impl,
        phase_breakdowns=phase_bd,
        host_bytes=sum(host_breakdown.values()),
        host_breakdown=host_breakdown,
        adapter=spec.adapter.describe() if spec.adapter is not None else "",
    )


def _max_category(tracker: Any, key: str) -> int:
    """Largest value of one category over the tracker's timeline."""
    return max((ev.bytes[key] for ev in tracker.timeline), default=0)


# The untracked warm-up of a fake trace: an optimizer step on zero gradients (same state as a full
# step; tests compare both ways). False runs a full step.
_FAST_WARMUP = True

# Extrapolation by depth: traced at these two depths (decoder layers).
EXTRAPOLATION_DEPTHS = (1, 2)
EXTRAPOLATE_MIN_LAYERS = 4


def _affine(a: int, b: int, d1: int, d2: int, n: int) -> int:
    slope, rem = divmod(b - a, d2 - d1)
    if rem:
        raise ArithmeticError("not affine in the layer count")
    return a + slope * (n - d1)


def _extrapolated(spec: _Spec, kw: dict[str, Any], depths: tuple[int, int] = EXTRAPOLATION_DEPTHS,
                  traced: dict[int, MemoryEstimate] | None = None) -> MemoryEstimate | None:
    """The estimate of the whole stack from traces at two depths, or None where the two traces
    do not show the same shape (peak in a different phase, not affine): then the caller tries
    deeper depths or traces it all."""
    field_name, n = spec.layers()
    d1, d2 = depths
    t0 = time.perf_counter()
    traced = {} if traced is None else traced
    for d in depths:
        if d not in traced:
            traced[d] = _run(spec.at_depth(d), **kw)
    a, b = traced[d1], traced[d2]
    if list(a.phase_breakdowns) != list(b.phase_breakdowns):
        return None
    try:
        lin = lambda x, y: _affine(x, y, d1, d2, n)  # noqa: E731
        phase_bd = {ph: {k: lin(a.phase_breakdowns[ph][k], b.phase_breakdowns[ph][k]) for k in CATEGORIES}
                    for ph in b.phase_breakdowns}
        end = {k: lin(a.breakdown_end[k], b.breakdown_end[k]) for k in CATEGORIES}
        n_params = lin(a.n_params, b.n_params)
        max_act = lin(a.max_activation_bytes, b.max_activation_bytes)
        host_bd = {k: lin(a.host_breakdown[k], b.host_breakdown[k]) for k in b.host_breakdown}
    except ArithmeticError:
        return None
    phases = {ph: sum(bd.values()) for ph, bd in phase_bd.items()}
    if any(v < 0 for v in phases.values()):
        return None
    peak = max(phases.values())
    peak_phase = next(ph for ph, v in phases.items() if v == peak)  # the first in time, as the tracker
    breakdown = phase_bd[peak_phase]
    return MemoryEstimate(
        model=spec.name, n_params=n_params, batch_size=b.batch_size, seq_len=b.seq_len, dtype=b.dtype,
        optimizer=b.optimizer, checkpointing=b.checkpointing, peak_bytes=peak, breakdown=breakdown,
        breakdown_end=end, max_activation_bytes=max_act, largest_layer_params=b.largest_layer_params,
        device=b.device, traced_on=b.traced_on, fake=True, seconds=time.perf_counter() - t0,
        notes=list(b.notes),
        tracker=_PhaseSummary(peak, peak_phase, phases), peak_phase=peak_phase, phase_peaks=phases,
        extras=dict(b.extras), attention=b.attention, step=b.step, optimizer_impl=b.optimizer_impl,
        extrapolated_from=(d1, d2), phase_breakdowns=phase_bd,
        host_bytes=sum(host_bd.values()), host_breakdown=host_bd, adapter=b.adapter,
    )


# FSDP2's per-rank timeline is affine in the layer count only from 3 layers on (with 1 or 2 layers the
# units gathered at the backward peak differ: measured on Llama shapes), so a sharded stack is traced at
# 3 and 4 layers, checked against a trace at 5, and extrapolated; a mismatch traces the whole stack. A
# peak that moved to another moment of the same run of a phase only beyond 5 layers would go unseen:
# Llama-2-70B (batch 1 x 256, 8 ranks) extrapolated equals its 80-layer trace (tests/test_estimate_distributed.py).
FSDP_EXTRAPOLATION_DEPTHS = (3, 4, 5)


def _segments(est: MemoryEstimate) -> list[tuple[str, dict[str, int]]]:
    """Each run of consecutive events of one phase in the traced timeline: (phase, breakdown at its first
    maximum). The "other" phase occurs more than once in a step (before the forward pass; between backward
    and the optimizer step), and which of its runs holds its peak can change with the layer count, so the
    runs are extrapolated one by one."""
    out: list[list[Any]] = []
    best = -1
    for ev in est.tracker.timeline:
        if not out or out[-1][0] != ev.phase:
            out.append([ev.phase, None])
            best = -1
        if ev.total > best:
            best, out[-1][1] = ev.total, {k: int(ev.bytes.get(k, 0)) for k in CATEGORIES}
    return [(ph, bd) for ph, bd in out]


def _extrapolated_fsdp(spec: _Spec, kw: dict[str, Any]) -> MemoryEstimate | None:
    """The FSDP-sharded estimate of the whole stack from traces at 3 and 4 layers, each run of one phase
    (:func:`_segments`) extrapolated by layer count, when the same extrapolation to 5 layers equals the trace
    at 5 (every run's breakdown and the end state); else None (the caller traces every layer)."""
    if kw.get("optimizer") == "adamw8bit":  # its state may be modelled beside the timeline: trace it all
        return None
    t0 = time.perf_counter()
    d1, d2, d3 = FSDP_EXTRAPOLATION_DEPTHS
    traced = {d: _run(spec.at_depth(d), **kw) for d in (d1, d2, d3)}
    segs = {d: _segments(est) for d, est in traced.items()}
    if len({tuple(ph for ph, _ in sg) for sg in segs.values()}) != 1:
        return None

    def runs_at(n: int) -> list[tuple[str, dict[str, int]]] | None:
        try:
            return [(ph, {k: a[k] + (b[k] - a[k]) * (n - d1) for k in CATEGORIES})
                    for (ph, a), (_, b) in zip(segs[d1], segs[d2])]
        except ArithmeticError:  # pragma: no cover - integer arithmetic
            return None

    check = _extrapolated(spec.at_depth(d3), kw, (d1, d2), dict(traced))
    if check is None or runs_at(d3) != segs[d3] or check.breakdown_end != traced[d3].breakdown_end:
        return None
    est = _extrapolated(spec, kw, (d1, d2), dict(traced))
    runs = runs_at(spec.layers()[1])
    if est is None or runs is None or any(sum(bd.values()) < 0 for _, bd in runs):
        return None
    phase_bd: dict[str, dict[str, int]] = {}
    peak, at_peak, peak_phase = -1, {}, ""
    for ph, bd in runs:  # in time order: each phase's first maximum, and the step's, as the tracker picks them
        total = sum(bd.values())
        if ph not in phase_bd or total > sum(phase_bd[ph].values()):
            phase_bd[ph] = bd
        if total > peak:
            peak, at_peak, peak_phase = total, bd, ph
    phases = {ph: sum(bd.values()) for ph, bd in phase_bd.items()}
    est.phase_breakdowns, est.phase_peaks = phase_bd, phases
    est.peak_bytes, est.breakdown, est.peak_phase = peak, dict(at_peak), peak_phase
    est.tracker = _PhaseSummary(peak, peak_phase, phases)
    est.seconds = time.perf_counter() - t0
    est.notes.append(f"FSDP2 per-rank trace: the extrapolation from {d1} and {d2} layers equals the trace at {d3} "
                     f"layers (checked in this run)")
    return est


def estimate_training_memory(
    model: Any,
    *,
    batch_size: int,
    seq_len: int,
    dtype: str = "bf16",
    optimizer: str = "adamw",
    checkpointing: bool = False,
    warmup_steps: int = 1,
    device: str = "cuda",
    optimizer_impl: str = "auto",
    optimizer_kwargs: Mapping[str, Any] | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    loss: str = "auto",
    step: Callable[[nn.Module, dict], torch.Tensor] | str | None = None,
    attn_implementation: str = "auto",
    allow_longer_seq: bool = False,
    extrapolate: bool | str = "auto",
    kernel_scratch: bool = True,
    world_size: int = 1,
    zero_stage: int = 0,
    adapter: str | None = None,
    lora_r: int = 16,
    lora_alpha: float | None = None,
    target_modules: str | Sequence[str] | None = None,
    lora_dropout: float = 0.0,
    adapter_dtype: str | None = None,
) -> MemoryEstimate:
    """Peak memory of a (steady-state) training step of ``model``, traced on fake tensors.

    ``model``: a preset name of :data:`memlab.models.PRESETS`, the path of a ``config.json``,
    a ``transformers`` config, or a callable returning an ``nn.Module`` (built inside the fake
    mode, so it may be any size). ``dtype``: one of :data:`DTYPES`, which alone sets the weights'
    dtype (a config's ``torch_dtype`` is ignored); ``optimizer``: one of :data:`OPTIMIZERS`;
    ``checkpointing``: recompute each block in backward. ``device``: the device you will train
    on; it sets the default optimizer implementation (``optimizer_impl="auto"``), the attention
    kernel modelled and the CUDA extras, and where this torch has CUDA, the fake tensors' device.
    ``config_overrides`` change fields of a preset / config (unknown keys are errors).

    The step: ``loss="auto"`` traces transformers' own loss for transformers models
    (``model(input_ids=x, labels=x).loss``, what the Trainer runs) and :func:`memlab.models.lm_loss`
    for others; ``loss="memlab"`` forces the latter; ``step=`` traces your own
    ``step(model, batch) -> loss`` (``batch = {"input_ids": x, "labels": x}``; or
    ``"module:function"``). ``attn_implementation``: "auto" (what transformers picks), "eager",
    "sdpa" or "flash" (CUDA). ``seq_len`` beyond the model's positions is an error unless
    ``allow_longer_seq``. ``extrapolate``: "auto" traces a homogeneous decoder stack of at least
    4 layers at 1 and 2 layers and extrapolates exactly by layer count (falls back to the full
    trace when the two traces differ in shape); False traces every layer. ``kernel_scratch=False``
    leaves out the per-op rule for scratch that CUDA kernels allocate inside themselves (softmax
    backward's copy of its gradient), to compare with a tracker that cannot see it either.

    ``world_size`` / ``zero_stage`` (chapter 08): the memory of *one* of ``world_size`` data-parallel
    ranks under ZeRO stage 0 (plain data parallelism), 1, 2 or 3 (FSDP), ``batch_size`` being the
    batch of one rank. Stages 1 and 2 shard the traced step (:func:`shard_estimate`); stage 3 traces FSDP2
    (``fully_shard`` on the fake-tensor model under a fake process group of ``world_size`` ranks, created and
    destroyed around the trace), falling back to :func:`shard_estimate`'s model of FSDP's units, with a note
    saying why, where torch.distributed is already initialised in this process or FSDP2 cannot shard the model.

    ``adapter="lora"`` / ``"qlora"`` (CLI ``--adapter``): train adapters on a frozen base, built by
    :mod:`memlab.adapters` (the planner's builder too): ``lora_r`` (16), ``lora_alpha`` (2 x r),
    ``target_modules`` ("all-linear": every linear layer but the head; or names such as
    ``"q_proj,v_proj"``), ``lora_dropout`` (0) and ``adapter_dtype`` ("fp32"; "bf16" under
    "bf16-pure"). The frozen base is 16-bit under a 16-bit ``dtype`` (bf16 / fp16) and NF4 for QLoRA.

    Nothing is allocated: a Llama-2-70B step at seq_len 4096 takes seconds and well under a GB
    of host memory.
    """
    check_input_bounds(batch_size, seq_len, world_size)
    optimizer, dtype = _canonical_optimizer(optimizer), _canonical_dtype(dtype)
    _check_zero(world_size, zero_stage, optimizer)
    from memlab import adapters as _adapters

    ad = _adapters.adapter_spec(adapter, recipe=dtype, lora_r=lora_r, lora_alpha=lora_alpha,
                                target_modules=target_modules, lora_dropout=lora_dropout, adapter_dtype=adapter_dtype)
    kw = dict(batch_size=batch_size, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
              checkpointing=checkpointing, warmup_steps=warmup_steps, device=device,
              optimizer_impl=optimizer_impl, optimizer_kwargs=optimizer_kwargs,
              config_overrides=config_overrides, seed=seed, loss=loss, step=step,
              attn_implementation=attn_implementation, allow_longer_seq=allow_longer_seq,
              extrapolate=extrapolate, kernel_scratch=kernel_scratch, adapter=ad)
    why = ""
    if zero_stage == 3:
        traced, why = _trace_fsdp(model, world_size, kw)
        if traced is not None:
            return traced
    est = _estimate_one_rank(model, **kw)
    if world_size == 1 and zero_stage == 0:
        return est
    units = _fsdp_units(_resolve_model(model, config_overrides), dtype) if zero_stage == 3 else None
    out = shard_estimate(est, world_size, zero_stage, units=units)
    if why:
        out.notes.append(f"FSDP2 not traced ({why}): its unsharded units are modelled")
    return out


def _estimate_one_rank(model: Any, *, batch_size: int, seq_len: int, dtype: str, optimizer: str, checkpointing: bool,
                       warmup_steps: int, device: str, optimizer_impl: str, optimizer_kwargs: Mapping[str, Any] | None,
                       config_overrides: Mapping[str, Any] | None, seed: int, loss: str,
                       step: Callable[[nn.Module, dict], torch.Tensor] | str | None, attn_implementation: str,
                       allow_longer_seq: bool, extrapolate: bool | str, kernel_scratch: bool,
                       fsdp_world_size: int = 0, adapter: Any = None) -> MemoryEstimate:
    spec = _resolve_model(model, config_overrides)
    _check_positions(spec, seq_len, allow_longer_seq)
    if adapter is not None:
        from memlab import adapters as _adapters

        spec = _Spec(spec.name, config=spec.config, fn=spec.fn, adapter=adapter)
        if adapter.kind == "qlora":
            _adapters.warm_quant()
    kw = dict(batch_size=batch_size, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
              checkpointing=checkpointing, warmup_steps=warmup_steps, device=device,
              optimizer_impl=optimizer_impl, optimizer_kwargs=optimizer_kwargs, fake=True, seed=seed,
              loss=loss, step=step, attn_implementation=attn_implementation, kernel_scratch=kernel_scratch,
              fsdp_world_size=fsdp_world_size)
    if extrapolate not in (True, False, "auto"):
        raise ValueError(f"extrapolate={extrapolate!r} is invalid; allowed: 'auto', True, False")
    if fsdp_world_size:
        if extrapolate and spec.is_hf and spec.homogeneous() and spec.layers()[1] > max(FSDP_EXTRAPOLATION_DEPTHS):
            est = _extrapolated_fsdp(spec, kw)
            if est is not None:
                return est
        return _run(spec, **kw)
    if extrapolate and spec.is_hf and spec.homogeneous() and spec.layers()[1] >= (
            EXTRAPOLATE_MIN_LAYERS if extrapolate == "auto" else max(EXTRAPOLATION_DEPTHS) + 1):
        traced: dict[int, MemoryEstimate] = {}
        d1, d2 = EXTRAPOLATION_DEPTHS
        if adapter is not None:  # a frozen embedding: the first layer's input needs no gradient, so the
            d1, d2 = d1 + 1, d2 + 1  # first layer differs from the others (an affine fit from 1 layer is wrong)
        for depths in ((d1, d2), (d2, d2 + 1)):  # the first layer can differ in shape: then one deeper
            if depths[1] >= spec.layers()[1]:
                break
            est = _extrapolated(spec, kw, depths, traced)
            if est is not None:
                return est
    return _run(spec, **kw)


# --------------------------------------------------------------------------------------
# Per rank: ZeRO stages and FSDP (chapter 08)
# --------------------------------------------------------------------------------------

ZERO_STAGES = (0, 1, 2, 3)


def _check_zero(world_size: Any, zero_stage: Any, optimizer: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid; allowed: an int >= 1")
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage={zero_stage!r} is invalid; allowed: 0 (data parallel), 1 (optimizer state "
                         f"sharded), 2 (and gradients), 3 (and parameters: FSDP)")
    if zero_stage and optimizer == "offload-adamw":
        raise ValueError(f"zero_stage={zero_stage} with optimizer='offload-adamw' is not modelled; allowed with ZeRO: "
                         f"'adamw', 'sgd', 'adamw8bit'")


class _NoFSDPUnits(Exception):
    """The model has no decoder layers for ``fully_shard`` to wrap (memlab.distributed.fsdp2_shard)."""


def _fully_shard(model: nn.Module) -> None:
    """FSDP2 as :func:`memlab.distributed.fsdp2_shard` applies it (``fully_shard`` on every decoder layer,
    then the root), here on a model of fake tensors under the fake process group."""
    from memlab.distributed import fsdp2_shard
    from memlab.models import NoDecoderLayersError

    try:
        fsdp2_shard(model)
    except NoDecoderLayersError as exc:
        raise _NoFSDPUnits(str(exc)) from None


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    """A default process group of ``world_size`` fake ranks, this process being rank 0 (PyTorch's
    ``FakeProcessGroup``: collectives return at once, nothing is sent), destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trace_fsdp(model: Any, world_size: int, kw: dict[str, Any]) -> tuple[MemoryEstimate | None, str]:
    """ZeRO stage 3 traced: (the estimate, "") or (None, why it cannot be traced).

    The model is built on fake tensors, sharded with FSDP2 (``fully_shard``) under a fake process group
    of ``world_size`` ranks, and one rank's step is tracked with the tracker of
    :func:`memlab.distributed.rank_tracker` (DTensors count their local shard; FSDP2's all-gathered
    parameters count from the all-gather until FSDP2 resizes their storage to 0 after the unit ran). The
    process group exists only during the trace. Not traced (the caller models FSDP's units instead):
    when ``torch.distributed`` is unavailable or already initialised in this process (a rank of a real
    run: a second default group cannot exist beside it), when the model has no decoder layers that
    ``fsdp2_shard`` finds, or when FSDP2 or the optimizer fails on fake DTensors (the reason is returned).
    """
    import torch.distributed as dist

    if not dist.is_available():
        return None, "torch.distributed is not available in this torch build"
    if dist.is_initialized():
        return None, (f"torch.distributed is already initialised in this process (rank {dist.get_rank()} of "
                      f"{dist.get_world_size()}): the fake process group of the trace cannot be created beside it")
    try:
        with _fake_process_group(world_size):
            est = _estimate_one_rank(model, fsdp_world_size=world_size, **kw)
    except _NoFSDPUnits as exc:
        return None, str(exc)
    except (ValueError, TypeError, KeyError, FileNotFoundError):
        raise  # bad arguments: the same errors as without ZeRO
    except Exception as exc:  # FSDP2 / DTensor on fake tensors: fall back to the model of the units
        return None, f"tracing FSDP2 failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    est.world_size, est.zero_stage = world_size, 3
    est.notes = list(est.notes) + [
        f"per rank of {world_size}, ZeRO stage 3: traced with FSDP2 (fully_shard on every decoder layer and the "
        f"root) on fake tensors under a fake process group, as rank 0; all-gathered units counted while alive"]
    return est, ""


def fsdp_units(model: Any, dtype: str = "bf16", config_overrides: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """(parameters of one decoder layer, parameters outside the layers) of a preset / config: the
    ``units`` of :func:`shard_estimate` for ``zero_stage=3`` (built on the meta device: nothing allocated)."""
    return _fsdp_units(_resolve_model(model, config_overrides), dtype)


def _fsdp_units(spec: _Spec, dtype: str) -> tuple[int, int]:
    """(parameters of one decoder layer, parameters outside the layers): FSDP2's units when
    ``fully_shard`` wraps every decoder layer and the root (memlab.distributed.fsdp2_shard)."""
    if not spec.is_hf or spec.layers() is None:
        raise ValueError("zero_stage=3 needs a decoder stack (a preset, a config.json or a transformers config) "
                         "to know FSDP's units; allowed for a callable model: zero_stage 0, 1, 2")
    from memlab.models import count_parameters

    counts = []
    for depth in (1, 2):
        with torch.device("meta"):
            counts.append(count_parameters(spec.at_depth(depth).build(dtype, None)))
    layer = counts[1] - counts[0]
    return layer, counts[0] - layer


def shard_estimate(est: MemoryEstimate, world_size: int, zero_stage: int, *,
                   units: tuple[int, int] | None = None) -> MemoryEstimate:
    """One rank's share of a traced single-process step (``est``, traced with the batch of one rank).

    Traced: every phase's bytes by category. Sharded, per Rajbhandari et al. 2020 (ZeRO), with
    ``S(x) = ceil(x / world_size)``:

    * stage 0 (data parallelism): as traced (DDP's gradient buckets, an extra copy of the gradients
      unless ``gradient_as_bucket_view``, are not added);
    * stage 1: optimizer state ``S(optimizer)`` in every phase (its temporaries too: the step runs on
      a shard); the gradients are the full gradient in every phase: one flat buffer that persists, as
      memlab.distributed.ZeroOptimizer and DDP keep it;
    * stage 2: the gradients ``S(full gradient)`` in every phase (each gradient is reduced to its
      owner and freed as soon as autograd accumulates it; one parameter's gradient at a time is not
      added);
    * stage 3 (FSDP2, ``fully_shard`` per decoder layer and on the root; the fallback of
      :func:`estimate_training_memory`, which traces FSDP2 itself where it can): parameters, gradients and
      optimizer state sharded; during forward and backward the unsharded units are *modelled*: the
      root's parameters (kept unsharded from forward to backward), the running layer and the one
      prefetched (2 layers), and in backward one layer's unsharded gradients before its
      reduce-scatter, in the parameters' dtype. ``units`` = (parameters of one layer, of the root).

    With a full trace (``extrapolate=False`` or a shallow model) every event of the timeline is
    sharded and the peak taken over them; an extrapolated estimate has only its phase peaks. The
    activations are the traced ones of the per-rank batch. ``tests/test_estimate_distributed.py``
    checks every stage against ranks measured with 2 gloo processes on CPU.
    """
    _check_zero(world_size, zero_stage, est.optimizer)
    N = world_size

    def S(x: int) -> int:
        return -(-int(x) // N)

    bds = dict(est.phase_breakdowns) or {est.peak_phase or "other": dict(est.breakdown)}
    g_full = max((bd.get("gradients", 0) for bd in bds.values()), default=0)
    p_bytes = 2 if est.dtype == "bf16-pure" else 4
    extra_fwd = extra_bwd = 0
    if zero_stage == 3:
        if units is None:
            raise ValueError("zero_stage=3 needs units=(parameters of one decoder layer, parameters of the root)")
        layer, root = units
        extra_fwd = (root + 2 * layer) * p_bytes
        extra_bwd = extra_fwd + layer * p_bytes

    def one(bd: Mapping[str, int], phase: str, end: bool = False) -> dict[str, int]:
        b = {k: int(bd.get(k, 0)) for k in CATEGORIES}
        if zero_stage >= 1:
            b["optimizer"] = S(b["optimizer"])
        if zero_stage == 1:
            b["gradients"] = g_full
        elif zero_stage == 2:
            b["gradients"] = S(g_full)
        elif zero_stage == 3:
            b["gradients"] = S(b["gradients"])
            b["parameters"] = S(b["parameters"])
            if not end and phase == "forward":
                b["parameters"] += extra_fwd
            elif not end and phase == "backward":
                b["parameters"] += extra_bwd
        return b

    timeline = getattr(est.tracker, "timeline", None)
    if isinstance(timeline, list) and timeline:  # a full trace: shard every event of its timeline
        phase_bd: dict[str, dict[str, int]] = {}
        phases: dict[str, int] = {}
        peak, peak_phase, at_peak = -1, "", {}
        for ev in timeline:
            b = one(ev.bytes, ev.phase)
            t = sum(b.values())
            if t > phases.get(ev.phase, -1):
                phases[ev.phase], phase_bd[ev.phase] = t, b
            if t > peak:
                peak, peak_phase, at_peak = t, ev.phase, b
    else:  # extrapolated: the phase peaks are all there is
        phase_bd = {ph: one(bd, ph) for ph, bd in bds.items()}
        phases = {ph: sum(bd.values()) for ph, bd in phase_bd.items()}
        peak = max(phases.values())
        peak_phase = next(ph for ph, v in phases.items() if v == peak)
        at_peak = phase_bd[peak_phase]
    notes = list(est.notes) + [
        f"per rank of {N}, ZeRO stage {zero_stage}: the single-rank trace with parameters / gradients / optimizer "
        f"state sharded by stage (memlab.estimate.shard_estimate)"
        + ("; FSDP's unsharded units in forward/backward modelled (root + 2 layers, + 1 layer of gradients)"
           if zero_stage == 3 else "")]
    out = copy.copy(est)
    out.peak_bytes = peak
    out.breakdown = at_peak
    out.breakdown_end = one(est.breakdown_end, "end", end=True)
    out.phase_breakdowns = phase_bd
    out.phase_peaks = phases
    out.peak_phase = peak_phase
    out.tracker = _PhaseSummary(peak, peak_phase, phases)
    out.notes = notes
    out.world_size = N
    out.zero_stage = zero_stage
    return out


def measure_training_memory(
    model: Any,
    *,
    batch_size: int,
    seq_len: int,
    dtype: str = "bf16",
    optimizer: str = "adamw",
    checkpointing: bool = False,
    warmup_steps: int = 1,
    device: str = "cpu",
    optimizer_impl: str = "auto",
    optimizer_kwargs: Mapping[str, Any] | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    loss: str = "auto",
    step: Callable[[nn.Module, dict], torch.Tensor] | str | None = None,
    attn_implementation: str = "auto",
    allow_longer_seq: bool = False,
    adapter: str | None = None,
    lora_r: int = 16,
    lora_alpha: float | None = None,
    target_modules: str | Sequence[str] | None = None,
    lora_dropout: float = 0.0,
    adapter_dtype: str | None = None,
) -> MemoryEstimate:
    """The same step as :func:`estimate_training_memory`, run for real on ``device`` and
    tracked with :class:`memlab.profiler.MemoryTracker` (for models that fit). A measurement
    has no modelled rules: kernel scratch that no op returns is not in it (compare it with
    ``estimate_training_memory(..., kernel_scratch=False)``)."""
    from memlab import adapters as _adapters

    optimizer, dtype = _canonical_optimizer(optimizer), _canonical_dtype(dtype)
    spec = _resolve_model(model, config_overrides)
    _check_positions(spec, seq_len, allow_longer_seq)
    ad = _adapters.adapter_spec(adapter, recipe=dtype, lora_r=lora_r, lora_alpha=lora_alpha,
                                target_modules=target_modules, lora_dropout=lora_dropout, adapter_dtype=adapter_dtype)
    if ad is not None:
        spec = _Spec(spec.name, config=spec.config, fn=spec.fn, adapter=ad)
        if ad.kind == "qlora":
            _adapters.warm_quant()
    return _run(
        spec, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
        optimizer=optimizer, checkpointing=checkpointing, warmup_steps=warmup_steps, device=device,
        optimizer_impl=optimizer_impl, optimizer_kwargs=optimizer_kwargs, fake=False, seed=seed,
        loss=loss, step=step, attn_implementation=attn_implementation, kernel_scratch=False,
    )


# --------------------------------------------------------------------------------------
# Reference formulas, for comparison
# --------------------------------------------------------------------------------------


def accelerate_estimate(n_params: int, dtype: str = "bf16") -> int:
    """Training bytes by ``accelerate estimate-memory`` ("Training using Adam" column).

    accelerate 1.x (``accelerate/commands/estimate.py``, ``estimate_training_usage``) takes the
    model's fp32 size S = 4 bytes x n_params and reports the *largest* of its components:
    in fp32, model S, gradients S, Adam 2S and "step" 4S -> 4S = 16 bytes/param; in
    fp16/bf16, model S, gradients 1.5S, Adam 2S, step 2S -> 2S = 8 bytes/param. Activations
    are not counted (the docs say so: batch size 1, no activations).
    """
    s = 4 * int(n_params)
    if dtype == "fp32":
        return 4 * s
    if dtype in ("bf16", "fp16", "bf16-pure"):
        return 2 * s
    raise ValueError(f"dtype={dtype!r} is invalid; allowed: 'fp32', 'bf16', 'fp16'")


def deepspeed_zero_estimate(
    n_params: int,
    *,
    stage: int = 2,
    num_gpus: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = False,
    cpu_offload_params: bool = False,
    largest_layer_params: int = 0,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> dict[str, int]:
    """Per-GPU and per-CPU bytes of the *model states* by DeepSpeed's estimators.

    The formulas of ``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/
    stage_1_and_2.py) and ``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/
    stage3.py), documented at https://deepspeed.readthedocs.io/en/latest/memory.html. With
    G = num_gpus x num_nodes and P = n_params:

    * ZeRO-2 without offload: GPU 4P + 16P/G (fp16 weights and gradients, plus the fp32 master
      weights and Adam moments sharded over G); CPU 4P x gpus per node x buffer factor.
      With offload: GPU 2P; CPU P x max(4G, 16) x buffer factor.
    * ZeRO-3 without offload: GPU 4L + 18P/G, with L the largest layer's parameters.
      Offloading the optimizer: GPU 4L + 2P/G; offloading the parameters too: GPU 4L.

    Activations and temporaries are outside these formulas ("model states" only).
    """
    if stage not in (2, 3):
        raise ValueError(f"stage={stage!r} is invalid; allowed: 2, 3")
    P, G = int(n_params), num_gpus * num_nodes
    if stage == 2:
        if cpu_offload:
            gpu = 2 * P
            cpu = P * max(4 * G, 16) * additional_buffer_factor
        else:
            gpu = 4 * P + int(16 * P / G)
            cpu = P * 4 * num_gpus * additional_buffer_factor
        return {"gpu": int(gpu), "cpu": int(cpu)}
    L = 4 * int(largest_layer_params)
    per_node = 1 / num_nodes
    if cpu_offload:
        if cpu_offload_params:
            gpu = L
            cpu = P * (18 * per_node if zero_init else max(4 * num_gpus, 18 * per_node)) * additional_buffer_factor
        else:
            gpu = L + int(2 * P / G)
            cpu = P * (16 * per_node if zero_init else max(4 * num_gpus, 16 * per_node)) * additional_buffer_factor
    else:
        gpu = L + int(18 * P / G)
        cpu = (largest_layer_params if zero_init else P) * 4 * num_gpus * additional_buffer_factor
    return {"gpu": int(gpu), "cpu": int(cpu)}


# --------------------------------------------------------------------------------------
# What would make it fit
# --------------------------------------------------------------------------------------


@dataclass
class Suggestion:
    technique: str
    peak_bytes: int
    how: str  # "traced" (re-ran the estimator) or "formula"
    chapter: str = ""
    detail: str = ""
    phase: str = ""
    fwd_bwd_peak: int = 0
    extra_bytes: int = 0  # extras on the target (cuBLAS workspaces), counted in allocated/reserved
    command: str = ""  # the memlab estimate command that reproduces a traced row ("" for a formula)

    def saving(self, base: MemoryEstimate) -> int:
        return base.peak_bytes - self.peak_bytes

    @property
    def reserved_bytes(self) -> int:
        alloc = self.peak_bytes + self.extra_bytes
        return int(math.ceil(alloc * FRAGMENTATION_MARGIN)) if self.extra_bytes else alloc


# QLoRA (Dettmers et al. 2023, section 3): NF4 weights take 4 bits per parameter; double
# quantization brings the quantization constants to 0.127 bits per parameter.
QLORA_BITS_PER_PARAM = 4 + 0.127


def estimate_command(model: Any, **kw: Any) -> str:
    """The ``memlab estimate`` command line for keywords of :func:`estimate_training_memory`
    (defaults left out; a model that is not a name or a path shows as ``MODEL``)."""
    import shlex

    from memlab import adapters as _adapters

    out = ["memlab", "estimate", model if isinstance(model, str) else "MODEL"]
    flags = (("batch_size", "--batch-size", None), ("seq_len", "--seq-len", None), ("dtype", "--dtype", "bf16"),
             ("optimizer", "--optimizer", "adamw"), ("optimizer_impl", "--optimizer-impl", "auto"),
             ("device", "--device", "cuda"), ("loss", "--loss", "auto"), ("attn_implementation", "--attn", "auto"),
             ("world_size", "--world-size", 1), ("zero_stage", "--zero-stage", 0))
    for key, flag, default in flags:
        if key in kw and kw[key] != default:
            out += [flag, str(kw[key])]
    if kw.get("checkpointing"):
        out.append("--checkpointing")
    if isinstance(kw.get("step"), str):
        out += ["--step", kw["step"]]
    if kw.get("allow_longer_seq"):
        out.append("--allow-longer-seq")
    if kw.get("extrapolate") is False:
        out.append("--no-extrapolate")
    if (kw.get("optimizer_kwargs") or {}).get("offload_gradients"):
        out.append("--offload-gradients")
    for k, v in (kw.get("config_overrides") or {}).items():
        out += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    ad = _adapters.adapter_spec(kw.get("adapter"), recipe=kw.get("dtype", "bf16"),
                                **{k: kw[k] for k in ("lora_r", "lora_alpha", "target_modules", "lora_dropout",
                                                      "adapter_dtype") if k in kw})
    if ad is not None:
        out += ad.cli_args()
    return " ".join(shlex.quote(x) for x in out)


def _fwd_bwd(est: MemoryEstimate) -> int:
    return max(est.phase_peaks.get("forward", 0), est.phase_peaks.get("backward", 0))


def suggestions(base: MemoryEstimate, model: Any, *, config_overrides: Mapping[str, Any] | None = None,
                **run_kwargs: Any) -> list[Suggestion]:
    """Techniques that lower ``base``'s peak, each with its estimated peak.

    Options the estimator has (checkpointing, 8-bit AdamW, the fused AdamW where the foreach
    one's temporaries set the peak, pure bf16, a smaller batch or sequence) are re-estimated
    ("traced"); the others use a byte formula ("formula"): CPU-offloaded AdamW (chapter 04)
    removes the optimizer state and the fp32 master copy from the GPU; LoRA (chapter 06) keeps
    the frozen weights in 16 bits with no gradients or optimizer state for them; QLoRA stores
    them in NF4. LoRA and QLoRA (rank 16, every linear layer but the head, :mod:`memlab.adapters`)
    are traced where ``base`` is a full fine-tune; each traced row carries the ``memlab estimate``
    command that reproduces it (``Suggestion.command``).
    """
    common = dict(batch_size=base.batch_size, seq_len=base.seq_len, dtype=base.dtype,
                  optimizer=base.optimizer, checkpointing=base.checkpointing,
                  config_overrides=config_overrides, **run_kwargs)
    out: list[Suggestion] = []
    extra = sum(base.extras.values())

    def traced(technique: str, chapter: str, **change: Any) -> MemoryEstimate:
        kw = {**common, **change}
        est = estimate_training_memory(model, **kw)
        out.append(Suggestion(technique, est.peak_bytes, "traced", chapter,
                              ", ".join(f"{k}={v}" for k, v in change.items()), est.peak_phase, _fwd_bwd(est), extra,
                              command=estimate_command(model, **kw)))
        return est

    if not base.checkpointing:
        traced("gradient checkpointing", "02", checkpointing=True)
    if base.optimizer == "adamw" and base.optimizer_impl == "foreach" and base.peak_phase == "optimizer":
        traced("fused AdamW (no foreach temporaries)", "01", optimizer_impl="fused")
    if base.optimizer == "adamw":
        traced("8-bit AdamW (bitsandbytes)", "06", optimizer="adamw8bit")
    if base.dtype != "bf16-pure":
        traced("pure bf16 weights and AdamW state (no fp32 master copy)", "03", dtype="bf16-pure")
    if not base.checkpointing and base.optimizer == "adamw":
        traced("gradient checkpointing + 8-bit AdamW", "02+06", checkpointing=True, optimizer="adamw8bit")
    if base.batch_size > 1:
        traced(f"batch size {base.batch_size // 2} (x2 gradient accumulation)", "", batch_size=base.batch_size // 2)
    if base.seq_len > 1:
        traced(f"sequence length {base.seq_len // 2}", "", seq_len=base.seq_len // 2)

    # Formulas, from the traced breakdowns.
    P = base.n_params
    opt_at_peak = base.breakdown.get("optimizer", 0)
    # fp32 weights that become 16-bit on the GPU (an adapter's frozen base is 16-bit already)
    master = 2 * P if base.dtype in ("bf16", "fp16") and not base.adapter else 0
    out.append(Suggestion("CPU-offloaded AdamW (optimizer state and fp32 master weights in CPU RAM)",
                          max(base.peak_bytes - opt_at_peak - master, 0), "formula", "04",
                          "peak - optimizer state at peak" + (" - 2 bytes/param (fp32 weights kept as 16-bit)" if master else ""),
                          extra_bytes=extra))
    if base.adapter:
        return out
    # LoRA / QLoRA traced (memlab.adapters): a 16-bit recipe (bf16 mixed for an fp32 run), AdamW on the adapters
    ad_kw = dict(dtype="bf16" if base.dtype == "fp32" else base.dtype,
                 optimizer="adamw" if base.optimizer == "offload-adamw" else base.optimizer, optimizer_kwargs=None)
    try:
        traced("LoRA on 16-bit frozen weights (rank 16, all linear layers)", "06", adapter="lora", **ad_kw)
        traced("QLoRA (NF4 frozen weights, rank 16, all linear layers)", "06", adapter="qlora", **ad_kw)
    except ValueError:  # a model without linear layers to adapt
        pass
    return out


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


# The order in which to try techniques: least change to the training run first.
_TRY_ORDER = ("fused AdamW", "gradient checkpointing", "8-bit AdamW", "gradient checkpointing + 8-bit AdamW",
              "CPU-offloaded AdamW", "pure bf16", "LoRA", "QLoRA", "batch size", "sequence length")


def _intrusiveness(technique: str) -> int:
    ranks = [i for i, prefix in enumerate(_TRY_ORDER) if technique.startswith(prefix)]
    return max(ranks) if ranks else len(_TRY_ORDER)


# The parser lives in memlab.cli_args (torch-free: memlab.cli parses before importing this module).
from memlab.cli_args import _Parser, _bounded_int, _gpu, _override, _positive_int  # noqa: E402,F401


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_DTYPE_HELP = "; ".join(f"{k}: {v}" for k, v in DTYPES.items())


def main(argv: Sequence[str] | None = None) -> int:
    """``memlab estimate MODEL [options]``: the breakdown, the verdict for a GPU, and what
    would make it fit. ``memlab estimate --validate``: the estimate against published peaks."""
    from memlab.cli_args import parse_estimate

    parser, args = parse_estimate(argv)

    if args.validate:
        from memlab import published_peaks

        return published_peaks.main(model_filter=args.model)

    run_kwargs = dict(optimizer_impl=args.optimizer_impl, device=args.device, loss=args.loss, step=args.step,
                      attn_implementation=args.attn, allow_longer_seq=args.allow_longer_seq,
                      extrapolate=not args.no_extrapolate)
    overrides = dict(args.overrides) or None
    adapter_kw = dict(adapter=args.adapter, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                      target_modules=args.target_modules, lora_dropout=args.lora_dropout,
                      adapter_dtype=args.adapter_dtype)
    if args.offload_gradients and args.optimizer != "offload-adamw":
        print(f"memlab estimate: error: --offload-gradients needs --optimizer offload-adamw "
              f"(got --optimizer {args.optimizer})", file=sys.stderr)
        return 2
    try:
        if args.step is not None:
            run_kwargs["step"] = load_step(args.step)
        est = estimate_training_memory(
            args.model, batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
            optimizer=args.optimizer, checkpointing=args.checkpointing, config_overrides=overrides,
            optimizer_kwargs={"offload_gradients": True} if args.offload_gradients else None,
            world_size=args.world_size, zero_stage=args.zero_stage, **run_kwargs, **adapter_kw,
        )
    except (KeyError, ValueError, TypeError, FileNotFoundError, OverflowError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"memlab estimate: error: {msg}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # torch refused a size: one line, not C++ frames
        print(f"memlab estimate: error: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
        return 2

    print(est.table())
    print(f"estimated in {est.seconds:.1f} s on fake tensors (nothing allocated)")
    if args.compare:
        from memlab import peers

        print("\n" + peers.format_compare(est))
    if args.gpu is None:
        return 0
    label, usable = args.gpu
    need = est.reserved_bytes if args.device == "cuda" else est.peak_bytes
    print(f"\nGPU: {label}")
    if need <= usable:
        print(f"verdict: FITS: {format_bytes(need)} reserved (estimated) in {format_bytes(usable)} usable, "
              f"{format_bytes(usable - need)} to spare")
        return 0
    if est.allocated_bytes <= usable:
        print(f"verdict: TIGHT: the allocated peak {format_bytes(est.allocated_bytes)} fits {format_bytes(usable)} but not "
              f"with the fragmentation margin ({format_bytes(need)}); try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
              f"or one of the techniques below")
    else:
        print(f"verdict: DOES NOT FIT in {format_bytes(usable)} usable: over by {format_bytes(need - usable)}")
    if args.no_suggest:
        return 0
    if args.world_size > 1 or args.zero_stage:
        print(f"\nsuggestions are computed for one GPU; per rank, try a higher --zero-stage (now {args.zero_stage}) or a "
              f"larger --world-size (now {args.world_size}), then the techniques of chapters 02-06 on top")
        return 0
    print("\nwhat would make it fit (estimated tensor peak; 'traced' = re-estimated, 'formula' = byte formula;"
          " 'fits' compares the reserved estimate with the usable memory):")
    try:
        sug = suggestions(est, args.model, config_overrides=overrides,
                          **{**run_kwargs, "step": args.step}, **(adapter_kw if args.adapter else {}))
    except (ValueError, TypeError) as exc:
        print(f"memlab estimate: error: {exc}", file=sys.stderr)
        return 2
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
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
