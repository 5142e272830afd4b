"""Attention in a traced step: which kernel the target runs (PyTorch's ``sdp_utils`` rules), what it
keeps for backward, and the tracker that counts it (with CUDA softmax backward's scratch rule)."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from memlab.estimate.model import ModelSpec
from memlab.estimate.recipes import SIXTEEN_BIT


def attention_plan(model: nn.Module, spec: ModelSpec, requested: str, dtype: str, target: torch.device,
                    traced_on: str, rules: Any = None) -> tuple[str, Any, bool]:
    """(description, context manager for the traced step, softmax-scratch rule on?).

    On a CUDA target traced on CPU fake tensors, SDPA picks its CUDA kernel as PyTorch does
    (``sdp_utils``): flash for fp16/bf16 inputs (keeps output + logsumexp, as the CPU flash kernel
    does, bytes measured equal on an H100); memory-efficient for fp32 without grouped KV heads
    (output + a logsumexp padded to 32 positions: the padding, < 128 B per head and sequence, is
    not modelled); math for fp32 with grouped KV heads (no fused kernel takes fp32 GQA: it keeps
    the b x h x s x s probabilities, measured on an H100), so the step is traced with the math
    kernel forced. Eager attention's softmax backward on CUDA copies its incoming gradient
    (results/h100/diag2.log): a transient rule adds those bytes while the op runs. ``rules``: the
    trace's :func:`memlab.estimate.cuda_rules.cuda_semantics` mode on a CPU trace for a CUDA card; where
    the CUDA kernel is a fused one its ``fused_attention`` is set, so attention dropout is traced as the
    fused kernel keeps it (rule 5 there: the CPU flash kernel refuses dropout and would fall back to math).
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
    cfg = spec.config if spec.config is not None else getattr(model, "config", None)  # a callable's: its model's
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    gqa = bool(heads and kv and kv < heads)
    sixteen = dtype in SIXTEEN_BIT
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
    if rules is not None:
        rules.fused_attention = kernel != "math"
    return (f"{label}: {what}; modelled on CPU with the {'math' if kernel == 'math' else 'CPU flash'} kernel "
            f"(same saved tensors)"), sdpa_kernel(backends), False


class UnpackedPositions:
    """Within a fake trace, tell transformers that the batch's sequences are not packed.

    With no attention mask and no cache (a training step), transformers reads the position ids to
    detect packed sequences (``masking_utils.find_packed_sequence_indices``); a fake tensor has no
    values to read, so it assumes packing, builds a full ``b x 1 x s x s`` mask and, for grouped-query
    attention, repeats K and V to every head (``repeat_kv``) instead of SDPA's ``enable_gqa``: more
    than the real step keeps (measured: the fake trace of a GQA Llama kept repeated K/V and a mask
    the real CPU step does not). The trace's own batches are unpacked (positions 0..s-1), which is
    what the real step finds; a padding mask the step passes still builds the masked path, as on a
    real run. ``calls`` counts the fake position ids answered this way (for the estimate's notes).
    """

    def __init__(self) -> None:
        self.calls = 0
        self._module: Any = None
        self._orig: Any = None

    def __enter__(self) -> "UnpackedPositions":
        try:
            from transformers import masking_utils
        except Exception:  # pragma: no cover - transformers absent
            return self
        orig = getattr(masking_utils, "find_packed_sequence_indices", None)
        if orig is None:  # pragma: no cover - a transformers without packed-sequence detection
            return self
        from torch._subclasses.fake_tensor import FakeTensor

        def unpacked(position_ids: torch.Tensor) -> Any:
            if isinstance(position_ids, FakeTensor):
                self.calls += 1
                return None
            return orig(position_ids)

        self._module, self._orig = masking_utils, orig
        masking_utils.find_packed_sequence_indices = unpacked
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._module is not None:
            self._module.find_packed_sequence_indices = self._orig
            self._module = None


def make_tracker(model: nn.Module, opt: torch.optim.Optimizer, softmax_rule: bool, per_rank: bool = False,
                 device: str | None = None, log_allocations: bool = False):
    """A MemoryTracker that also notes which attention ops ran, with the per-op rule for CUDA
    softmax backward's scratch when asked. ``per_rank`` (a model sharded by FSDP2): the tracker of
    :func:`memlab.distributed.rank_tracker`, which counts a DTensor's local shard and FSDP2's storage
    resizes. ``device``: count only storages on that device type (a real CUDA step whose host copies
    are not device memory); None counts all. ``log_allocations``: the tracker's ``allocation_log`` (a
    :class:`memlab.estimate.allocator_replay.AllocationLog`) notes every storage allocated and freed, for the
    caching allocator's replay; otherwise it is None."""
    from memlab.estimate.allocator_replay import AllocationLog
    from memlab.profiler import MemoryTracker

    base: type = MemoryTracker
    if per_rank:
        from memlab.distributed import rank_tracker

        base = type(rank_tracker(model, opt, resizes=True))

    softmax_bwd = torch.ops.aten._softmax_backward_data.default
    prim_device = torch.ops.prim.device.default
    flash_ops_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    flash_ops = {flash_ops_cpu}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            flash_ops.add(op.default)

    class _Tracker(base):  # type: ignore[valid-type, misc]
        scratch_bytes = 0
        fused_attention_calls = 0
        masked_attention_calls = 0  # fused calls given a mask (a padded batch): see the estimate's attention
        softmax_calls = 0
        allocation_log: AllocationLog | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is prim_device:  # a fake tensor's device asked for (two ops in three): no storage, no attention
                return out
            if self.allocation_log is not None:
                self.allocation_log.see(out, args, kwargs)
            if func in flash_ops:
                self.fused_attention_calls += 1
                mask = (kwargs or {}).get("attn_mask")  # the CPU flash kernel; CUDA's efficient one: attn_bias
                if mask is None and func is not flash_ops_cpu and len(args) > 3 and isinstance(args[3], torch.Tensor):
                    mask = args[3]
                self.masked_attention_calls += mask is not None
            elif func is softmax_bwd:
                self.softmax_calls += 1
            if softmax_rule and func is softmax_bwd and isinstance(args[0], torch.Tensor) and args[0].dim() >= 3:
                g = args[0]
                extra = self.allocated_bytes(g.numel() * g.element_size(), g.device)
                # alive while the kernel runs, with its output: count it at that moment only
                self.add_transient(extra)
                self.scratch_bytes = max(self.scratch_bytes, extra)
            return out

        def add_transient(self, nbytes: int, category: str = "activations") -> None:
            super().add_transient(nbytes, category)
            if self.allocation_log is not None and nbytes:
                self.allocation_log.transient(nbytes)

    tracker = _Tracker(model=model, optimizer=opt, resizes=per_rank, device=device)
    if log_allocations:
        tracker.allocation_log = AllocationLog()
    return tracker


