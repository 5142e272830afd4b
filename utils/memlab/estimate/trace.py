"""Tracing one training step on fake tensors (``FakeTensorMode``) under
:class:`memlab.profiler.MemoryTracker`: build the model, warm the optimizer state up, track one
step, read the peak, its breakdown and each phase's peak. Also runs the same step for real
(``fake=False``: :func:`memlab.estimate.measure_training_memory`)."""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from memlab.core.units import format_bytes
from memlab.core.validation import check_choice
from memlab.core.vocab import CATEGORIES, Recipe
from memlab.estimate.attention import UnpackedPositions, attention_plan, make_tracker
from memlab.estimate.fake_mode import fake_mode, no_weight_init
from memlab.estimate.model import (ModelSpec, enable_checkpointing, largest_layer_params, untraceable,
                                   vocab_size)
from memlab.estimate.optim import bnb_state_bytes, import_bitsandbytes, paged_state_bytes, step_optimizer
from memlab.estimate.recipes import (ATTN_IMPLEMENTATIONS, CUBLAS_THREADS, LOSSES, MIXED, OPTIMIZER_IMPLS,
                                     cublas_workspace)
from memlab.estimate.result import MemoryEstimate
from memlab.estimate.step import StepSpec, enable_chunked_loss, load_step, training_step

# The untracked warm-up of a fake trace: an optimizer step on zero gradients (with the optimizer in backward, each
# parameter's own step), the same state as a full step (tests compare both ways). False runs a full step.
_FAST_WARMUP = True

_SCRATCH_NOTE = "; CUDA softmax backward's copy of its incoming gradient added while it runs"


@dataclass
class _Setup:
    """What a trace decides before it builds the model."""

    step_fn: Callable[[nn.Module, dict], torch.Tensor] | None
    attn: str
    target: torch.device
    traced_on: str
    opt_name: str
    modelled_8bit: bool = False
    paged: str = ""  # a paged bitsandbytes AdamW: its state modelled (memlab.estimate.optim.paged_state_bytes)
    cuda_rules: Any = None
    notes: list[str] = field(default_factory=list)
    offload: Any = None  # the OffloadedCheckpoints handle of offload_checkpoints=True


class _CudaToTraced(torch.overrides.TorchFunctionMode):
    """Inside a fake build on a machine without CUDA: ``.to("cuda")``, ``.cuda()`` and ``device="cuda"`` go to the
    device the trace runs on (a CPU-only torch cannot make CUDA tensors, not even fake ones); the target's CUDA
    rules are applied by the trace itself (memlab.estimate.cuda_rules)."""

    def __init__(self, traced_on: str) -> None:
        super().__init__()
        self.traced_on = torch.device(traced_on)

    def _map(self, v: Any) -> Any:
        if isinstance(v, (str, torch.device)) and not isinstance(v, bool):
            try:
                d = torch.device(v)
            except (RuntimeError, TypeError):
                return v
            return self.traced_on if d.type == "cuda" else v
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        return v

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(self.traced_on, **{k: v for k, v in kwargs.items() if k == "non_blocking"})
        if "device" in kwargs:
            kwargs["device"] = self._map(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], self._map(args[1]), *args[2:])
        return func(*args, **kwargs)


def _swap_or_set(original: Callable) -> Callable:
    """``torch.utils.swap_tensors`` for a fake build: a fake parameter that the fake mode's converter memoises (a
    weak reference) cannot be swapped, so ``nn.Module._apply`` (``.to(device/dtype)``, ``.half()``, peft moving its
    adapters to the base layer's device) would fail with "Couldn't swap Linear.weight"; it gets ``.data`` set
    instead, as ``_apply`` does for real tensors (the same Parameter object, so tied weights stay tied)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            return original(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
                raise
            with torch.no_grad():
                t1.data = t2.detach()
            t1.requires_grad_(t2.requires_grad)
            return None

    return swap


@contextlib.contextmanager
def traceable_build(traced_on: str):
    """The context a model is built in for a fake trace (inside the fake mode): a builder as a user writes it runs
    there, ``.to(device/dtype)``, ``.cuda()``, ``peft.get_peft_model``, ``prepare_model_for_kbit_training`` and
    ``from_config(..., torch_dtype=...)`` included (see :func:`_swap_or_set` and :class:`_CudaToTraced`)."""
    original = torch.utils.swap_tensors
    torch.utils.swap_tensors = _swap_or_set(original)
    cuda = _CudaToTraced(traced_on) if (torch.device(traced_on).type != "cuda" and not torch.cuda.is_available()) \
        else contextlib.nullcontext()
    try:
        with cuda:
            yield
    finally:
        torch.utils.swap_tensors = original


def offload_inputs(model: nn.Module, s: _Setup, fake: bool) -> Any:
    """Put :func:`memlab.checkpoint.offload_checkpoints` on ``model``: memlab's checkpoint on every decoder
    layer, each one's input kept on the host. On a CUDA target traced on fake tensors the host copies are
    shapes only (host_device "meta": not device memory; their bytes go to the estimate's host bytes); on
    a CPU target the host is the device, so the copies are traced with the rest."""
    from memlab.checkpoint import offload_checkpoints

    on_host = s.target.type == "cuda"
    handle = offload_checkpoints(model, pin_memory=True, prefetch=True, host_device="meta" if (fake and on_host) else "cpu")
    s.notes.append("checkpointing: memlab.checkpoint on every decoder layer with each layer's input offloaded to host "
                   "memory (memlab.checkpoint.offload_checkpoints), the input of the layer before fetched while one is "
                   "recomputed in backward" + ("" if on_host else "; on a CPU the host is the device: the copies are "
                                               "in the traced bytes (nothing saved)"))
    return handle


def _check_step(step: StepSpec) -> tuple[Callable | None, str]:
    """Validate the settings a trace takes; return the step function and the attention asked for."""
    for arg, val, low in (("batch_size", step.batch_size, 1), ("seq_len", step.seq_len, 1),
                          ("warmup_steps", step.warmup_steps, 0), ("grad_accum", step.grad_accum, 1)):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"{arg}={val!r} is invalid; allowed: an int >= {low}")
    check_choice("optimizer_impl", step.optimizer_impl, OPTIMIZER_IMPLS)
    check_choice("loss", step.loss, LOSSES)
    attn = "auto" if step.attn_implementation is None else step.attn_implementation
    check_choice("attn_implementation", attn, ATTN_IMPLEMENTATIONS)
    fn = load_step(step.step) if isinstance(step.step, str) else step.step
    if fn is not None and not callable(fn):
        raise TypeError(f"step={fn!r} is invalid; allowed: a callable (model, batch) -> loss or 'module:function'")
    return fn, attn


def _setup(spec: ModelSpec, step: StepSpec, fake: bool) -> _Setup:
    """The target, where it is traced, CUDA's rules when traced on a CPU, the adapter and 8-bit notes."""
    fn, attn = _check_step(step)
    target = torch.device(step.device)
    if target.type == "cuda" and not torch.cuda.is_available():
        if not fake:
            raise ValueError("device='cuda' needs a CUDA GPU for a measurement; use device='cpu'")
        traced_on = "cpu"  # a CPU-only torch cannot even fake CUDA tensors: trace on CPU
    else:
        traced_on = str(target)
    if attn == "flash" and target.type != "cuda":
        raise ValueError("attn_implementation='flash' is a CUDA kernel; allowed on device='cpu': 'auto', 'eager', 'sdpa'")
    s = _Setup(fn, attn, target, traced_on, step.optimizer)
    if traced_on != str(target):
        from memlab.estimate import cuda_rules

        s.cuda_rules = cuda_rules.cuda_semantics()  # CUDA's dropout and autocast op lists (memlab.estimate.cuda_rules)
        s.notes.append(f"traced on {traced_on} fake tensors (no CUDA here): CUDA's dropout and autocast op lists are "
                       f"modelled (memlab.estimate.cuda_rules); the attention kernel is the CUDA one, modelled (see attention)")
    if spec.adapter is not None:
        s.notes.append(_adapter_note(spec, step.dtype))
    if step.optimizer in ("paged-adamw32bit", "paged-adamw8bit"):
        # its state lives in CUDA unified memory (cudaMallocManaged), which no CPU trace can make: modelled
        s.paged, s.opt_name = step.optimizer, "sgd"
        s.notes.append(f"{step.optimizer}: bitsandbytes' paged AdamW modelled, not traced (its fused update kernel "
                       f"allocates nothing; SGD stands in for the step); the moments of tensors of 100,000 elements or "
                       f"more live in CUDA unified memory, outside PyTorch's allocator: reported as paged bytes, not in "
                       f"max_memory_allocated/reserved (nvidia-smi shows them while they are on the card; the driver "
                       f"pages them to host memory under pressure); the rest of the state is in the allocated figure")
    if step.optimizer == "adamw8bit" and not fake:  # a fake trace runs memlab's layout of bitsandbytes' state
        try:  # (memlab.estimate.optim.AdamW8bitLayout: no import, bitsandbytes installed or not)
            import_bitsandbytes()
        except Exception as exc:  # pragma: no cover - depends on the install
            s.modelled_8bit, s.opt_name = True, "sgd"
            s.notes.append(f"bitsandbytes does not import ({type(exc).__name__}); 8-bit AdamW state modelled, not traced")
    if not spec.is_hf and attn != "auto":
        raise ValueError("attn_implementation applies to transformers models (a preset, a config); "
                         "a callable builds its own attention")
    return s


def _adapter_note(spec: ModelSpec, dtype: str) -> str:
    from memlab.estimate import adapters

    base = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[adapters.base_dtype(dtype)]
    amp = {Recipe.BF16_MIXED.value: "bf16", Recipe.FP16_MIXED.value: "fp16"}.get(dtype)
    return (f"{spec.adapter.describe()}; frozen base in {base}"
            + (" (NF4 linears)" if spec.adapter.kind == "qlora" else "")
            + (f", forward under autocast({amp})" if dtype in MIXED else "")
            + ": gradients and optimizer state for the adapters only (memlab.estimate.adapters)")


def _step_text(step_fn: Any, loss: str) -> str:
    if step_fn is not None:
        return (f"your step {getattr(step_fn, '__module__', '?')}.{getattr(step_fn, '__name__', '?')}(model, batch) "
                f"-> loss, then backward and optimizer.step()")
    if loss == "hf":
        return ("transformers' loss: model(input_ids=x, labels=x).loss (logits upcast to fp32, as the Trainer runs "
                "it), backward, optimizer.step()")
    if loss == "fused":
        return ("the fused linear cross-entropy: memlab.loss.enable(model), then model(input_ids=x, labels=x).loss "
                "(the logits never materialised; recomputed chunk by chunk in backward), backward, optimizer.step()")
    if loss == "chunked":
        return ("the chunked cross-entropy: memlab.loss.chunked_cross_entropy(final hidden states, head weight, x "
                "shifted) (the logits made a chunk at a time, each kept for backward), backward, optimizer.step()")
    return "memlab's loss: lm_loss(model, x, y) (cross entropy on the logits), backward, optimizer.step()"


def _track(model: nn.Module, vocab: int, opt: Any, params: list, step: StepSpec, s: _Setup, loss: str, mode: Any,
           attn_ctx: Any, softmax_rule: bool, fake: bool, per_rank: bool) -> Any:
    """Warm up (untracked), then track one step; returns the tracker."""

    fsdp1 = per_rank and step.fsdp_version == 1
    # FSDP1's no_sync: the micro-batches but the last keep their unsharded gradients; with 3 or more, the second
    # one (no_sync, the first one's gradients already there) is traced too, later ones repeat it
    micro = min(step.grad_accum, 3 if fsdp1 else 2)
    no_sync = model.no_sync if (fsdp1 and micro > 1) else None
    previous: list | None = [] if step.keep_previous_outputs else None
    kept = not step.zero_grad_set_to_none  # zero_grad(set_to_none=False): the gradients live from the first backward on

    def one_step() -> None:
        x = torch.randint(0, vocab, (step.batch_size, step.seq_len), device=s.traced_on)
        y = torch.randint(0, vocab, (step.batch_size, step.seq_len), device=s.traced_on)
        with s.cuda_rules if s.cuda_rules is not None else contextlib.nullcontext():
            training_step(model, opt, x, y, dtype=step.dtype, loss=loss, step=s.step_fn, micro_batches=micro,
                          no_sync=no_sync, previous=previous, set_to_none=step.zero_grad_set_to_none)

    unpacked = UnpackedPositions()
    # a step function of yours keeps its own state: warmed up by a full step (zero gradients and opt.step() would
    # leave it without the state a real step leaves)
    full = s.step_fn is not None
    in_backward = step.optimizer_in_backward
    quiet = warnings.catch_warnings()
    with quiet, mode, attn_ctx, unpacked:
        if fsdp1:  # FSDP1 reads its flat parameter's data_ptr (a no-op on fake tensors, warned about every step)
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        for _ in range(step.warmup_steps):  # untracked: afterwards the optimizer state exists
            if _FAST_WARMUP and fake and not full:
                # what a first step leaves behind is the optimizer's state (created lazily in its
                # first step()); zero gradients give it at a fraction of a forward/backward's cost
                for p in params:
                    p.grad = torch.zeros_like(p)
                    if in_backward:  # each parameter's own optimizer, stepped as its gradient arrives in backward
                        opt._step_one(p)
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                one_step()
        if kept:  # the run's first step has no gradients yet: its backward allocates them, where the allocator places them
            opt.zero_grad(set_to_none=True)
        # a real CUDA step with offloaded inputs: the pinned host copies are not device memory
        only = "cuda" if (s.offload is not None and s.target.type == "cuda" and not fake) else None
        log = s.target.type == "cuda" and not per_rank  # the caching allocator's replay (allocator_replay)
        tracker = make_tracker(model, opt, softmax_rule, per_rank=per_rank, device=only, log_allocations=log)
        hook = opt.register_step_pre_hook(lambda *_: tracker.allocation_log.mark("optimizer")) if log else None
        with tracker:
            if log:
                tracker.allocation_log.start((st.storage, st.category) for st in tracker.live_storages())
            if previous is not None or kept:  # the step before, whose outputs the loop keeps through this one's
                one_step()  # forward / whose backward allocated the gradients the loop then keeps
            one_step()
        if hook is not None:
            hook.remove()
    if step.grad_accum > 1 and fsdp1:
        s.notes.append(f"gradient accumulation over {step.grad_accum} micro-batches of {step.batch_size} under FSDP1: "
                       f"each but the last under model.no_sync(), which keeps every unit's UNSHARDED gradient (the "
                       f"flat parameter's .grad, full size) until the last backward reduce-scatters it; {micro} traced"
                       + (" (later ones repeat the second)" if step.grad_accum > micro else ""))
    elif step.grad_accum > 1:
        s.notes.append(f"gradient accumulation over {step.grad_accum} micro-batches of {step.batch_size}: "
                       f"{min(step.grad_accum, 2)} traced (the first one's gradients stay allocated through the next "
                       f"forward and backward; later micro-batches repeat the second)")
    if previous is not None:
        s.notes.append("keep_previous_outputs: the loop keeps what the forward returned ("
                       + ("transformers' output: loss and logits" if loss in ("hf", "chunked", "fused") and
                          s.step_fn is None else "the loss")
                       + ") until the next forward has returned; traced as two consecutive steps, the first one's "
                         "outputs alive through the second's forward (the peak is the second's)")
    if unpacked.calls:
        s.notes.append("batch traced as unpacked: transformers cannot read fake position ids and would assume packed "
                       "sequences (a full s x s mask, K/V repeated to every head); the trace answers as a real step "
                       "finds (memlab.estimate.attention.UnpackedPositions)")
    return tracker


def _read(tracker: Any, model: nn.Module, modelled_8bit: bool, paged: str = "") -> dict[str, Any]:
    """Peak, breakdowns and phase peaks of a tracked step (8-bit AdamW's state added when modelled, a paged
    AdamW's allocator-side state too; its paged bytes under ``paged_bytes``)."""
    peak = int(tracker.peak_bytes)
    at_peak = {k: int(v) for k, v in tracker.breakdown(at="peak").items()}
    at_end = {k: int(v) for k, v in tracker.breakdown(at="end").items()}
    timeline = tracker.timeline
    max_act = max(max((ev.bytes["activations"] for ev in timeline), default=0), at_peak["activations"])
    phases: dict[str, int] = {}
    phase_bd: dict[str, dict[str, int]] = {}
    for ev in timeline:  # each phase's first maximum, as the tracker picks its peak
        if ev.total > phases.get(ev.phase, -1):
            phases[ev.phase] = ev.total
            phase_bd[ev.phase] = {k: int(v) for k, v in ev.bytes.items()}
    state, paged_bytes = bnb_state_bytes(model) if modelled_8bit else 0, 0
    if paged:
        state, paged_bytes = paged_state_bytes(model, paged)
    if state:  # the state is alive during the whole second step
        peak += state
        at_peak["optimizer"] = at_peak.get("optimizer", 0) + state
        at_end["optimizer"] = at_end.get("optimizer", 0) + state
        phases = {k: v + state for k, v in phases.items()}
        for bd in phase_bd.values():
            bd["optimizer"] = bd.get("optimizer", 0) + state
    return dict(peak=peak, at_peak=at_peak, at_end=at_end, max_act=int(max_act), phases=phases, phase_bd=phase_bd,
                state=state, paged=paged_bytes)


def _after_notes(s: _Setup, tracker: Any, attention: str, softmax_rule: bool) -> str:
    """Notes only the tracked step can tell (a mask that forced the math kernel, the rules that fired)."""
    if ("flash kernel" in attention or "efficient kernel" in attention) and tracker.fused_attention_calls == 0:
        attention += ("; BUT the model passed an attention mask the CPU flash kernel does not take, so the trace ran the "
                      "math kernel (keeps b x h x s x s probabilities): an overestimate of the CUDA memory-efficient kernel")
        s.notes.append("attention traced with the math kernel (mask given): activations overestimated for a CUDA target")
    if getattr(tracker, "masked_attention_calls", 0):
        attention += ("; the step passed a padding mask: transformers repeats K/V to every head and SDPA keeps the "
                      "s x s additive mask per layer"
                      + (" (on CUDA the memory-efficient kernel, as flash takes no mask: same saved tensors; its "
                         "padding of the mask to a multiple of 16 columns is not modelled)" if s.target.type == "cuda"
                         else ""))
    if s.cuda_rules is not None:
        from memlab.estimate import cuda_rules

        s.notes.extend(cuda_rules.rule_notes(s.cuda_rules))
    if softmax_rule and getattr(tracker, "scratch_bytes", 0):
        s.notes.append(f"CUDA softmax backward's scratch copy of its incoming gradient "
                       f"({format_bytes(tracker.scratch_bytes)}) counted while it runs (per-op rule, measured on an H100)")
    return attention


class NoFSDPUnits(Exception):
    """The model has no decoder layers for ``fully_shard`` to wrap (memlab.distributed.fsdp2_shard)."""


def fully_shard_layers(model: nn.Module) -> None:
    """FSDP2 as :func:`memlab.distributed.fsdp2_shard` applies it (``fully_shard`` on every decoder layer,
    then the root), here on a model of fake tensors under the fake process group."""
    from memlab.distributed import fsdp2_shard
    from memlab.models import NoDecoderLayersError

    try:
        fsdp2_shard(model)
    except NoDecoderLayersError as exc:
        raise NoFSDPUnits(str(exc)) from None


def fsdp1_wrap(model: nn.Module, device: str, use_orig_params: bool = False) -> nn.Module:
    """FSDP1 as a user writes it for a decoder: ``FullyShardedDataParallel`` over the model with an auto-wrap
    policy that makes every decoder layer a unit, the rest (embedding, final norm, head) the root's unit, all
    its other arguments PyTorch's defaults (FULL_SHARD, BACKWARD_PRE prefetch, no forward prefetch,
    ``limit_all_gathers=True``, ``use_orig_params=False`` unless asked). Built inside the fake mode for a trace
    (FSDP1 makes its gathered buffers with ``torch.empty``), under the caller's process group."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import CustomPolicy

    from memlab.models import NoDecoderLayersError, decoder_layers

    try:
        units = {id(layer) for layer in decoder_layers(model)}
    except NoDecoderLayersError as exc:
        raise NoFSDPUnits(str(exc)) from None
    return FullyShardedDataParallel(model, auto_wrap_policy=CustomPolicy(lambda m: id(m) in units),
                                    device_id=torch.device(device), use_orig_params=use_orig_params)


def _build_model(spec: ModelSpec, step: StepSpec, s: _Setup, fake: bool, fsdp_world_size: int) -> tuple:
    """(model, fake mode or nullcontext, parameter count before sharding or None, vocabulary size)."""
    if fake:
        # Non-fake inputs are allowed for the few small real tensors an optimizer makes outside
        # the mode (bitsandbytes' quantization maps); they are not model memory. PyTorch's mode with a
        # cheaper dispatch-cache key (memlab.estimate.fake_mode): the same trace, about a quarter faster.
        mode: Any = fake_mode(allow_non_fake_inputs=True)
    else:
        mode = contextlib.nullcontext()
    build_attn = None if s.attn == "auto" else ("sdpa" if s.attn == "flash" else s.attn)
    with mode, torch.device(s.traced_on):
        ctx_fn = None
        if s.cuda_rules is not None:  # checkpointing's recompute runs under the same CUDA rules
            from memlab.estimate.cuda_rules import checkpoint_context_fn

            ctx_fn = checkpoint_context_fn(s.cuda_rules)
        with traceable_build(s.traced_on) if fake else contextlib.nullcontext(), \
                no_weight_init() if fake else contextlib.nullcontext():
            try:
                model = spec.build(step.dtype, build_attn).train()
            except (ValueError, TypeError, KeyboardInterrupt):
                raise
            except Exception as exc:  # a builder of yours that fake tensors cannot run: its line, and what works
                err = untraceable(spec.fn, exc) if (fake and spec.fn is not None) else None
                if err is None:
                    raise
                raise err from None
        if step.offload_checkpoints:
            s.offload = offload_inputs(model, s, fake)
        elif step.checkpointing:
            enable_checkpointing(model, ctx_fn)
        if step.loss == "fused" and s.step_fn is None and _is_hf_model(model):
            from memlab.loss import enable

            enable(model)  # the head and the loss fused: model(input_ids, labels=...).loss never makes the logits
        elif step.loss == "chunked" and s.step_fn is None and _is_hf_model(model):
            enable_chunked_loss(model)
        vocab = vocab_size(model)
        n_params = None
        if fsdp_world_size and step.fsdp_version == 1:  # inside the fake mode (FSDP1 makes tensors of its own)
            from memlab.models import count_parameters

            n_params = count_parameters(model)
            # frozen and trained parameters in one flat parameter need use_orig_params (peft's LoRA under FSDP1)
            with warnings.catch_warnings():  # FSDP1 warns of mixed frozen / trained units: said in the notes
                warnings.filterwarnings("ignore", message=".*has both parameters with requires_grad=True and False")
                model = fsdp1_wrap(model, s.traced_on, use_orig_params=spec.adapter is not None)
            return model, mode, n_params, vocab
    if fsdp_world_size:  # outside the fake mode: building the device mesh reads real values
        from memlab.models import count_parameters

        n_params = count_parameters(model)  # before sharding (then counted from the DTensors' storages)
        fully_shard_layers(model)
    return model, mode, n_params, vocab


def _is_hf_model(model: nn.Module) -> bool:
    """A transformers model, or peft's wrapper of one (``get_peft_model``: its forward takes ``labels`` too)."""
    if "transformers" not in sys.modules:  # nothing built by transformers in this process
        return False
    from transformers import PreTrainedModel

    if type(model).__name__ == "FullyShardedDataParallel":  # FSDP1's wrapper (fsdp1_wrap): the model inside
        model = model.module
    if type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    return isinstance(model, PreTrainedModel)


def _loss_kind(model: nn.Module, step: StepSpec, s: _Setup) -> str:
    loss = step.loss
    if loss == "auto":
        loss = "hf" if _is_hf_model(model) else "memlab"
    if s.step_fn is not None:
        return loss
    if loss in ("hf", "chunked", "fused") and not _is_hf_model(model):
        raise ValueError(f"loss={loss!r} needs a transformers model; {type(model).__name__} is not one: use "
                         f"loss='memlab' or step=")
    return loss


def trace_step(spec: ModelSpec, step: StepSpec, *, fake: bool = True, fsdp_world_size: int = 0) -> MemoryEstimate:
    """Run ``step`` on ``spec``'s model, on fake tensors (an estimate) or real ones (a measurement).

    Args:
        spec: the model (:func:`memlab.estimate.model.resolve_model`).
        step: the step's settings.
        fake: trace on fake tensors (nothing allocated) or run for real.
        fsdp_world_size: when > 0, shard the model with FSDP2 under the fake process group of that
            many ranks (the caller creates it) and track rank 0.

    Raises:
        ValueError, TypeError: a bad setting, named.
    """
    if spec.adapter is not None and spec.adapter.kind == "qlora":
        from memlab.estimate.adapters import warm_quant

        warm_quant()  # memlab.quant's codebooks built for real before the trace, or it would count them
    s = _setup(spec, step, fake)
    torch.manual_seed(step.seed)
    t0 = time.perf_counter()
    model, mode, n_params, vocab = _build_model(spec, step, s, fake, fsdp_world_size)
    loss = _loss_kind(model, step, s)
    attention, attn_ctx, softmax_rule = attention_plan(model, spec, s.attn, step.dtype, s.target, s.traced_on, s.cuda_rules)
    if softmax_rule and not step.kernel_scratch:
        softmax_rule = False
        attention = attention.replace(_SCRATCH_NOTE, "; kernel_scratch=False: CUDA softmax backward's scratch copy "
                                                     "not added")
    params = [p for p in model.parameters() if p.requires_grad]
    opt, impl, host_breakdown = step_optimizer(params, step, s.opt_name, s.target, fake, s.notes)
    tracker = _track(model, vocab, opt, params, step, s, loss, mode, attn_ctx, softmax_rule, fake, bool(fsdp_world_size))
    seconds = time.perf_counter() - t0
    if s.offload is not None and s.target.type == "cuda":
        host_breakdown["offloaded checkpoint inputs (pinned, at most)"] = s.offload.stats.peak_host_bytes
    r = _read(tracker, model, s.modelled_8bit, s.paged)
    attention = _after_notes(s, tracker, attention, softmax_rule)
    extras: dict[str, int] = {}
    if s.target.type == "cuda":
        ws, why = cublas_workspace(step.gpu)
        extras[f"cuBLAS workspaces ({format_bytes(ws)} x {CUBLAS_THREADS} threads: forward and autograd; "
               f"{why})"] = ws * CUBLAS_THREADS
        if step.gpu is None:
            s.notes.append("no card given (gpu=/--gpu): the cuBLAS workspace is Hopper's 32 MiB per thread (PyTorch's "
                           "default before compute capability 9.0 is 8.125 MiB)")
    from memlab.models import count_parameters

    reserved = _replay_reserved(tracker, extras, r["state"], steps=3 if step.zero_grad_set_to_none else 1)
    if reserved is not None:
        s.notes.append(reserved.note)
    return MemoryEstimate(
        model=spec.name, n_params=count_parameters(model) if n_params is None else n_params,
        batch_size=step.batch_size, seq_len=step.seq_len, dtype=step.dtype, optimizer=step.optimizer,
        checkpointing=step.checkpointing, peak_bytes=r["peak"],
        breakdown={k: r["at_peak"].get(k, 0) for k in CATEGORIES},
        breakdown_end={k: r["at_end"].get(k, 0) for k in CATEGORIES},
        max_activation_bytes=r["max_act"], largest_layer_params=largest_layer_params(model),
        device=str(s.target), traced_on=s.traced_on, fake=fake, seconds=seconds, notes=s.notes, tracker=tracker,
        peak_phase=tracker.peak_phase, phase_peaks=r["phases"], extras=extras, attention=attention,
        step=_step_text(s.step_fn, loss), optimizer_impl=impl, phase_breakdowns=r["phase_bd"],
        host_bytes=sum(host_breakdown.values()), host_breakdown=host_breakdown,
        adapter=spec.adapter.describe() if spec.adapter is not None else "",
        loss=loss if s.step_fn is None else "step", offload_checkpoints=step.offload_checkpoints,
        optimizer_in_backward=step.optimizer_in_backward,
        reserved_replay_bytes=reserved.reserved_bytes if reserved else 0, paged_bytes=r["paged"],
        fragmentation_bytes=reserved.fragmentation_bytes if reserved else 0,
    )


def _replay_reserved(tracker: Any, extras: dict[str, int], modelled_state: int = 0, steps: int = 3) -> Any:
    """The caching allocator's replay of the traced step (memlab.estimate.allocator_replay), or None where the
    tracker kept no allocation log (a CPU target, an FSDP2 rank). ``modelled_state``: optimizer state counted beside
    the trace, allocated with the model's storages; ``steps``: replays of the log (1 for a log of a run's first two
    steps whose gradients are kept: replayed again, its first step would free and remake them)."""
    log = getattr(tracker, "allocation_log", None)
    if log is None or not log.events:
        return None
    from memlab.estimate.allocator_replay import estimate_reserved, training_events

    lumps = [n // CUBLAS_THREADS for n in extras.values() for _ in range(CUBLAS_THREADS)]
    events = training_events(log, steps=steps, workspaces=lumps + ([modelled_state] if modelled_state else []))
    return estimate_reserved(events)
