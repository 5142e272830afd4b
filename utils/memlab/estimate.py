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
``batch_size x seq_len`` token ids, the forward pass and the loss (:func:`memlab.models.lm_loss`),
``loss.backward()``, ``optimizer.step()``. One untracked warm-up step runs first
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
otherwise modelled with that layout and said so in ``notes``).

Limits, said plainly: the estimate counts tensor storages (what ``torch.cuda.memory_allocated``
counts). It does not count the CUDA context, the caching allocator's fragmentation,
nor workspaces that kernels allocate internally (cuBLAS, flash attention):
keep a margin of a few percent plus the context (see :meth:`MemoryEstimate.fits`). Without a
CUDA build the step is traced with CPU fake tensors, so device-dependent choices follow the CPU
path (autocast's op lists, the SDPA kernel); the optimizer implementation follows the target
device (``device="cuda"`` uses PyTorch's CUDA default, the foreach AdamW, whose
``sqrt(exp_avg_sq)`` temporary is a full extra copy of one moment during the step; Hugging Face's
Trainer defaults to the fused AdamW, ``optimizer_impl="fused"``, which has none).

Reference formulas kept here for comparison: :func:`accelerate_estimate` (``accelerate
estimate-memory``) and :func:`deepspeed_zero_estimate` (DeepSpeed's model-state estimators).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from memlab._optional import needs
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
}

OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")

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
    A GPU sold as "24 GB" usually has 24 GiB: write ``24GiB`` to use all of it.
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
# The result
# --------------------------------------------------------------------------------------


@dataclass
class MemoryEstimate:
    """Peak bytes of a training step and where they go.

    ``breakdown`` is the split of the peak over :data:`CATEGORIES` (the five keys of
    :meth:`memlab.profiler.MemoryTracker.breakdown`); ``breakdown_end`` the same at the end of
    the last step. ``fake`` says whether the step ran on fake tensors (an estimate) or real
    ones (a measurement); ``notes`` lists anything modelled rather than traced.
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

    def fits(self, gpu_bytes: int | str) -> bool:
        """True when the peak is at most ``gpu_bytes`` (an int or a size such as "24GB").

        The comparison is bare: the CUDA context (a few hundred MiB, outside PyTorch's
        allocator) and the caching allocator's fragmentation are not in ``peak_bytes``, so pass
        the memory you can really give PyTorch (e.g. ``torch.cuda.mem_get_info()[0]`` on an idle
        GPU) or subtract a margin yourself.
        """
        return self.peak_bytes <= parse_size(gpu_bytes)

    def headroom(self, gpu_bytes: int | str) -> int:
        """``gpu_bytes - peak_bytes`` (negative when it does not fit)."""
        return parse_size(gpu_bytes) - self.peak_bytes

    def describe(self) -> str:
        kind = "estimate (fake tensors)" if self.fake else "measured"
        ck = ", gradient checkpointing" if self.checkpointing else ""
        return (
            f"{self.model} ({_params(self.n_params)} params): batch {self.batch_size} x seq "
            f"{self.seq_len}, {self.dtype}, {self.optimizer}{ck} -- {kind} on {self.traced_on}"
        )

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
        lines = [self.describe(), ""]
        for j, r in enumerate(rows):
            if j == len(rows) - 1:
                lines.append("  ".join("-" * w for w in widths))
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append(f"peak: {self.peak_bytes:,} bytes")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def plot(self, **kwargs: Any):
        """The tracker's timeline plot (see :meth:`memlab.profiler.MemoryTracker.plot`)."""
        if self.tracker is None:
            raise ValueError("this MemoryEstimate has no tracker (modelled, not traced)")
        return self.tracker.plot(**kwargs)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**8 else f"{n / 1e6:.2f}M"


# --------------------------------------------------------------------------------------
# Building the model
# --------------------------------------------------------------------------------------


def _is_hf_config(obj: Any) -> bool:
    try:
        from transformers import PretrainedConfig
    except Exception:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, PretrainedConfig)


def load_config(path: str | os.PathLike):
    """A ``transformers`` config from a local ``config.json`` (or a folder holding one), offline."""
    with needs("memlab estimate"):
        from transformers import AutoConfig

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"config file {path!r} has no 'model_type'; allowed: a transformers config.json")
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"config file {path!r}: model_type={model_type!r} is not known to transformers ({exc})") from None


def _resolve_model(model: Any, config_overrides: Mapping[str, Any] | None) -> tuple[Callable[[], nn.Module], str]:
    """(builder, display name) for a preset name, a config.json path, a config or a callable."""
    overrides = dict(config_overrides or {})
    if isinstance(model, str):
        from memlab.models import PRESETS, UnknownPresetError, preset_config

        if model in PRESETS:
            cfg = preset_config(model, **overrides)
            name = model
        elif model.endswith(".json") or os.path.isdir(model):
            if not os.path.exists(model):
                raise FileNotFoundError(f"model={model!r}: no such config file")
            cfg = load_config(model)
            for k, v in overrides.items():
                setattr(cfg, k, v)
            name = os.path.basename(os.path.dirname(os.path.abspath(model))) if model.endswith(".json") else os.path.basename(model.rstrip("/"))
            name = f"{name} ({getattr(cfg, 'model_type', '?')})"
        else:
            raise UnknownPresetError(
                f"unknown model={model!r}; allowed: a preset ({', '.join(sorted(PRESETS))}) "
                f"or the path of a transformers config.json"
            )
        return _hf_builder(cfg), name
    if _is_hf_config(model):
        cfg = model
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return _hf_builder(cfg), f"{type(cfg).__name__}"
    if isinstance(model, nn.Module):
        raise TypeError(
            f"model={type(model).__name__} instance: pass a function that builds it instead "
            f"(e.g. lambda: {type(model).__name__}(...)), so it can be built on fake tensors"
        )
    if callable(model):
        if overrides:
            raise ValueError("config_overrides only apply to a preset, a config.json or a transformers config")
        return model, getattr(model, "__name__", type(model).__name__)
    raise TypeError(
        f"model={model!r} is invalid; allowed: a preset name, a config.json path, a transformers "
        f"config, or a callable returning an nn.Module"
    )


def _hf_builder(cfg: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with needs("memlab estimate"):
            from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(cfg)

    return build


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
    with _default_dtype(torch.bfloat16):
        model = builder()
    for p in model.parameters():  # anything built with an explicit fp32 dtype
        if p.is_floating_point() and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)
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


def make_optimizer(
    name: str, params: Any, *, impl: str = "auto", device: str = "cpu", **kwargs: Any
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (see :data:`OPTIMIZERS`) over ``params``.

    ``impl`` picks torch's implementation: "auto" is what ``torch.optim.AdamW(params)`` picks on
    ``device`` (foreach on CUDA, the for-loop on CPU), or "for-loop" / "foreach" / "fused".
    """
    _check_choice("optimizer", name, tuple(OPTIMIZERS))
    _check_choice("optimizer_impl", impl, OPTIMIZER_IMPLS)
    params = list(params)
    if name == "adamw8bit":
        return _bnb().optim.AdamW8bit(params, **kwargs)
    if impl == "auto":
        impl = "foreach" if torch.device(device).type == "cuda" else "for-loop"
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    if name == "adamw":
        return torch.optim.AdamW(params, **{**flags, **kwargs})
    if impl == "fused":
        flags = dict(foreach=False)  # SGD without momentum: fused buys nothing
    return torch.optim.SGD(params, lr=kwargs.pop("lr", 1e-3), **{**flags, **kwargs})


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    dtype: str = "fp32",
) -> torch.Tensor:
    """One step as :func:`estimate_training_memory` runs it: zero_grad(set_to_none), forward and
    loss (under autocast for "bf16"/"fp16"), backward, optimizer.step(). Returns the loss."""
    from memlab.models import lm_loss

    _check_choice("dtype", dtype, tuple(DTYPES))
    optimizer.zero_grad(set_to_none=True)
    if dtype in ("bf16", "fp16"):
        amp = torch.bfloat16 if dtype == "bf16" else torch.float16
        with torch.autocast(device_type=x.device.type, dtype=amp):
            loss = lm_loss(model, x, y)
    else:
        loss = lm_loss(model, x, y)
    loss.backward()
    optimizer.step()
    return loss.detach()


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


def _run(
    builder: Callable[[], nn.Module],
    *,
    name: str,
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
) -> MemoryEstimate:
    from memlab.profiler import MemoryTracker

    for arg, val, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("warmup_steps", warmup_steps, 0)):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"{arg}={val!r} is invalid; allowed: an int >= {low}")
    _check_choice("dtype", dtype, tuple(DTYPES))
    _check_choice("optimizer", optimizer, tuple(OPTIMIZERS))
    _check_choice("optimizer_impl", optimizer_impl, OPTIMIZER_IMPLS)

    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        if not fake:
            raise ValueError("device='cuda' needs a CUDA GPU for a measurement; use device='cpu'")
        traced_on = "cpu"  # a CPU-only torch cannot even fake CUDA tensors: trace on CPU
    else:
        traced_on = str(target)
    notes: list[str] = []
    if traced_on != str(target):
        notes.append(f"traced on {traced_on} fake tensors (no CUDA here): autocast and attention follow the CPU path")

    opt_name = optimizer
    modelled_8bit = False
    if optimizer == "adamw8bit":
        try:
            _bnb()
        except Exception as exc:  # pragma: no cover - depends on the install
            modelled_8bit = True
            opt_name = "sgd"
            notes.append(f"bitsandbytes does not import ({type(exc).__name__}); 8-bit AdamW state modelled, not traced")

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
        model = _prepare(_build(builder, dtype), dtype, checkpointing)
        vocab = _vocab_size(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(opt_name, params, impl=optimizer_impl, device=str(target), **dict(optimizer_kwargs or {}))
    gen_device = traced_on
    def one_step() -> None:
        x = torch.randint(0, vocab, (batch_size, seq_len), device=gen_device)
        y = torch.randint(0, vocab, (batch_size, seq_len), device=gen_device)
        training_step(model, opt, x, y, dtype=dtype)

    with mode:
        for _ in range(warmup_steps):  # untracked: afterwards the optimizer state exists
            one_step()
        tracker = MemoryTracker(model=model, optimizer=opt)
        with tracker:
            one_step()
    seconds = time.perf_counter() - t0

    peak = int(tracker.peak_bytes)
    at_peak = {k: int(v) for k, v in tracker.breakdown(at="peak").items()}
    at_end = {k: int(v) for k, v in tracker.breakdown(at="end").items()}
    max_act = max(_max_category(tracker, "activations"), at_peak["activations"])
    if modelled_8bit:
        state = _bnb_state_bytes(model, dtype)
        peak += state  # the state is alive during the whole second step
        at_peak["optimizer"] = at_peak.get("optimizer", 0) + state
        at_end["optimizer"] = at_end.get("optimizer", 0) + state
    from memlab.models import count_parameters

    n_params = count_parameters(model)
    return MemoryEstimate(
        model=name,
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
    )


def _max_category(tracker: Any, key: str) -> int:
    """Largest value of one category over the tracker's timeline."""
    return max((ev.bytes[key] for ev in tracker.timeline), default=0)


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
) -> MemoryEstimate:
    """Peak memory of a (steady-state) training step of ``model``, traced on fake tensors.

    ``model``: a preset name of :data:`memlab.models.PRESETS`, the path of a ``config.json``,
    a ``transformers`` config, or a callable returning an ``nn.Module`` (built inside the fake
    mode, so it may be any size). ``dtype``: one of :data:`DTYPES`; ``optimizer``: one of
    :data:`OPTIMIZERS`; ``checkpointing``: recompute each block in backward (TinyGPT's or
    transformers' gradient checkpointing). ``device``: the device you will train on; it sets
    the default optimizer implementation (``optimizer_impl="auto"``) and, where this torch
    has CUDA, the fake tensors' device. ``config_overrides`` change fields of a preset / config
    (e.g. ``num_hidden_layers=2``).

    Nothing is allocated: a Llama-2-70B step at seq_len 4096 takes seconds and well under a GB
    of host memory.
    """
    builder, name = _resolve_model(model, config_overrides)
    return _run(
        builder, name=name, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
        optimizer=optimizer, checkpointing=checkpointing, warmup_steps=warmup_steps, device=device,
        optimizer_impl=optimizer_impl, optimizer_kwargs=optimizer_kwargs, fake=True, seed=seed,
    )


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
) -> MemoryEstimate:
    """The same step as :func:`estimate_training_memory`, run for real on ``device`` and
    tracked with :class:`memlab.profiler.MemoryTracker` (for models that fit)."""
    builder, name = _resolve_model(model, config_overrides)
    return _run(
        builder, name=name, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
        optimizer=optimizer, checkpointing=checkpointing, warmup_steps=warmup_steps, device=device,
        optimizer_impl=optimizer_impl, optimizer_kwargs=optimizer_kwargs, fake=False, seed=seed,
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

    def saving(self, base: MemoryEstimate) -> int:
        return base.peak_bytes - self.peak_bytes


# QLoRA (Dettmers et al. 2023, section 3): NF4 weights take 4 bits per parameter; double
# quantization brings the quantization constants to 0.127 bits per parameter.
QLORA_BITS_PER_PARAM = 4 + 0.127


def suggestions(base: MemoryEstimate, model: Any, *, config_overrides: Mapping[str, Any] | None = None,
                **run_kwargs: Any) -> list[Suggestion]:
    """Techniques that lower ``base``'s peak, each with its estimated peak.

    Options the estimator has (checkpointing, 8-bit AdamW, pure bf16, a smaller batch or
    sequence) are re-estimated ("traced"); the others use a byte formula ("formula"):
    CPU-offloaded AdamW (chapter 04) removes the optimizer state and the fp32 master copy from
    the GPU; LoRA (chapter 06) keeps the frozen weights in 16 bits with no gradients or
    optimizer state for them; QLoRA stores them in NF4 (4.127 bits per parameter).
    """
    common = dict(batch_size=base.batch_size, seq_len=base.seq_len, dtype=base.dtype,
                  optimizer=base.optimizer, checkpointing=base.checkpointing,
                  config_overrides=config_overrides, **run_kwargs)
    out: list[Suggestion] = []

    def traced(technique: str, chapter: str, **change: Any) -> MemoryEstimate:
        est = estimate_training_memory(model, **{**common, **change})
        out.append(Suggestion(technique, est.peak_bytes, "traced", chapter,
                              ", ".join(f"{k}={v}" for k, v in change.items())))
        return est

    if not base.checkpointing:
        traced("gradient checkpointing", "02", checkpointing=True)
    if base.optimizer == "adamw":
        traced("8-bit AdamW (bitsandbytes)", "06", optimizer="adamw8bit")
    pure = base
    if base.dtype != "bf16-pure":
        pure = traced("pure bf16 weights and AdamW state (no fp32 master copy)", "03", dtype="bf16-pure")
    if not base.checkpointing and base.optimizer == "adamw":
        traced("gradient checkpointing + 8-bit AdamW", "02+06", checkpointing=True, optimizer="adamw8bit")
    if base.batch_size > 1:
        traced(f"batch size {base.batch_size // 2} (x2 gradient accumulation)", "", batch_size=base.batch_size // 2)
    if base.seq_len > 1:
        traced(f"sequence length {base.seq_len // 2}", "", seq_len=base.seq_len // 2)

    # Formulas, from the traced breakdowns.
    P = base.n_params
    opt_at_peak = base.breakdown.get("optimizer", 0)
    master = 2 * P if base.dtype in ("bf16", "fp16") else 0  # fp32 weights that become 16-bit on the GPU
    out.append(Suggestion("CPU-offloaded AdamW (optimizer state and fp32 master weights in CPU RAM)",
                          max(base.peak_bytes - opt_at_peak - master, 0), "formula", "04",
                          "peak - optimizer state at peak" + (" - 2 bytes/param (fp32 weights kept as 16-bit)" if master else "")))
    # Activations of a 16-bit model without autocast's weight copies: the pure-bf16 trace's.
    act = pure.max_activation_bytes
    out.append(Suggestion("LoRA on 16-bit frozen weights", 2 * P + act, "formula", "06",
                          "2 bytes/param + the activations of the pure-bf16 trace (adapters neglected)"))
    out.append(Suggestion("QLoRA (NF4 frozen weights)", int(QLORA_BITS_PER_PARAM / 8 * P) + act, "formula", "06",
                          "4.127 bits/param + the activations of the pure-bf16 trace (adapters neglected)"))
    return out


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


# The order in which to try techniques: least change to the training run first.
_TRY_ORDER = ("gradient checkpointing", "8-bit AdamW", "gradient checkpointing + 8-bit AdamW",
              "CPU-offloaded AdamW", "pure bf16", "LoRA", "QLoRA", "batch size", "sequence length")


def _intrusiveness(technique: str) -> int:
    ranks = [i for i, prefix in enumerate(_TRY_ORDER) if technique.startswith(prefix)]
    return max(ranks) if ranks else len(_TRY_ORDER)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit code 2, message on stderr (argparse's own)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int; allowed: a positive int") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: a positive int")
    return v


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``memlab estimate MODEL [options]``: the breakdown, the verdict for a GPU, and what
    would make it fit."""
    from memlab.models import PRESETS

    parser = _Parser(
        prog="memlab estimate",
        description="Estimate the peak memory of a training step without a GPU (fake tensors).",
        epilog="models: " + ", ".join(sorted(PRESETS)) + ", or the path of a transformers config.json",
    )
    parser.add_argument("model", help="a preset name or the path of a config.json")
    parser.add_argument("--batch-size", type=_positive_int, default=1)
    parser.add_argument("--seq-len", type=_positive_int, default=2048)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    parser.add_argument("--optimizer-impl", choices=list(OPTIMIZER_IMPLS), default="auto",
                        help="torch optimizer implementation (auto: PyTorch's default on CUDA, foreach)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--gpu", type=_size, default=None,
                        help="GPU memory, e.g. 24GB (10**9), 80GiB (2**30), 24e9")
    parser.add_argument("--no-suggest", action="store_true", help="skip what-would-make-it-fit")
    args = parser.parse_args(list(argv or []))

    try:
        est = estimate_training_memory(
            args.model, batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
            optimizer=args.optimizer, checkpointing=args.checkpointing,
            optimizer_impl=args.optimizer_impl, device="cuda",
        )
    except (KeyError, ValueError, TypeError, FileNotFoundError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"memlab estimate: error: {msg}", file=sys.stderr)
        return 2

    print(est.table())
    print(f"estimated in {est.seconds:.1f} s on fake tensors (nothing allocated)")
    if args.gpu is None:
        return 0
    gpu = args.gpu
    print()
    if est.fits(gpu):
        print(f"verdict: FITS in {format_bytes(gpu)} with {format_bytes(est.headroom(gpu))} to spare "
              f"(leave room for the CUDA context and fragmentation)")
        return 0
    print(f"verdict: DOES NOT FIT in {format_bytes(gpu)}: over by {format_bytes(-est.headroom(gpu))}")
    if args.no_suggest:
        return 0
    print("\nwhat would make it fit (estimated peak; 'traced' = re-estimated, 'formula' = byte formula):")
    sug = suggestions(est, args.model, optimizer_impl=args.optimizer_impl, device="cuda")
    sug.sort(key=lambda s: s.peak_bytes)
    rows = [("technique", "chapter", "peak", "saving", "how", "fits")]
    for s in sug:
        rows.append((s.technique, s.chapter or "-", format_bytes(s.peak_bytes), format_bytes(s.saving(est)),
                     s.how, "yes" if s.peak_bytes <= gpu else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  " + "  ".join(c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))
    fitting = [s for s in sug if s.peak_bytes <= gpu]
    if fitting:
        first = min(fitting, key=lambda s: _intrusiveness(s.technique))
        print(f"\nnext to try: {first.technique} ({first.how}): {format_bytes(first.peak_bytes)}, "
              f"saves {format_bytes(first.saving(est))}")
    else:
        print("\nno single technique above fits: combine them (chapter 07 plans the stack) or use more GPUs (chapter 08)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
