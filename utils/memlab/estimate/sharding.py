"""Per rank (chapter 08): ZeRO stages 1-3 applied to a traced step (Rajbhandari et al. 2020), and
stage 3 traced with FSDP2 itself (``fully_shard`` on fake tensors under a fake process group, as
PyTorch's ``FSDPMemTracker`` does) or with FSDP1 (``fsdp_version=1``: ``FullyShardedDataParallel``).

FSDP1's memory, as its sources in torch 2.13 (torch/distributed/fsdp) have it, and why it differs from FSDP2's:

* ``_flat_param.py`` (``FlatParamHandle``): the parameters of a unit are one flat parameter, sharded in
  ``world_size`` chunks with the last padded (``_get_shard``: ``F.pad`` to ``chunks[0].numel()``); the
  gathered unit is one buffer of the padded size (``_full_param_padded``), freed by resizing its storage to 0.
* ``_runtime_utils.py`` ``_post_forward_reshard``: the root's unsharded flat parameter is not freed after the
  forward under FULL_SHARD (only non-root units are): the root's unit (what the auto-wrap policy leaves outside the decoder layers: embedding, final
  norm, head) stays gathered from the forward through the backward.
* ``_runtime_utils.py`` ``_post_backward_hook``: under ``no_sync()`` (``state._sync_gradients`` False) it
  returns before the reduce-scatter, so the flat parameter keeps its unsharded ``.grad``;
  ``_flat_param.py`` ``prepare_gradient_for_backward`` keeps it for the next backward to accumulate into:
  with gradient accumulation every unit's full gradient lives from the first micro-batch's backward to the
  last one's (``FullyShardedDataParallel.no_sync``'s docstring warns of the same: full gradients, not shards,
  accumulate until the synchronising pass). ``_should_free_in_backward`` still frees the
  gathered parameters in backward under FULL_SHARD.
* ``_get_reduce_scatter_tensors``: a gradient whose numel is not a multiple of ``world_size`` is padded by a
  copy (``F.pad``) before the reduce-scatter.

These are traced, not modelled: FSDP1 runs on the fake tensors (its init and collectives under the fake
process group), tracked as FSDP2 is (storage resizes watched).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Mapping

from memlab.core import vocab
from memlab.core.vocab import CATEGORIES, Recipe
from memlab.estimate.model import ModelSpec, resolve_model
from memlab.estimate.recipes import ZERO_STAGES
from memlab.estimate.result import MemoryEstimate, PhaseSummary
from memlab.estimate.step import StepSpec, check_fsdp_version
from memlab.estimate.extrapolate import estimate_one_rank


def check_zero(world_size: Any, zero_stage: Any, optimizer: str) -> None:
    """Refuse (ValueError, named) a world size, a ZeRO stage, or a stage with an optimizer, that the
    estimator cannot model."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid; allowed: an int >= 1")
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r} is invalid; allowed: 0 (data parallel), 1 (optimizer state "
                         f"sharded), 2 (and gradients), 3 (and parameters: FSDP)")
    if zero_stage and optimizer in ("offload-adamw", "paged-adamw32bit", "paged-adamw8bit"):
        raise ValueError(f"zero_stage={zero_stage} with optimizer={optimizer!r} is not modelled; allowed with ZeRO: "
                         f"'adamw', 'sgd', 'adamw8bit'")


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


def trace_fsdp(spec: ModelSpec, step: StepSpec, extrapolate: bool | str = "auto") -> tuple[MemoryEstimate | None, str]:
    """ZeRO stage 3 traced: (the estimate, "") or (None, why it cannot be traced).

    The model is built on fake tensors, sharded with FSDP2 (``fully_shard``) under a fake process group
    of ``world_size`` ranks, and one rank's step is tracked with the tracker of
    :func:`memlab.distributed.rank_tracker` (DTensors count their local shard; FSDP2's all-gathered
    parameters count from the all-gather until FSDP2 resizes their storage to 0 after the unit ran). The
    process group exists only during the trace. Not traced (the caller models FSDP's units instead):
    when ``torch.distributed`` is unavailable or already initialised in this process (a rank of a real
    run: a second default group cannot exist beside it), when the model has no decoder layers that
    ``fsdp2_shard`` finds, or when FSDP2 or the optimizer fails on fake DTensors (the reason is returned).

    ``spec`` is resolved with its adapters attached; ``step`` is one rank's, of ``step.world_size`` ranks.
    """
    world_size = step.world_size
    import torch.distributed as dist

    from memlab.estimate.trace import NoFSDPUnits

    if not dist.is_available():
        return None, "torch.distributed is not available in this torch build"
    if dist.is_initialized():
        return None, (f"torch.distributed is already initialised in this process (rank {dist.get_rank()} of "
                      f"{dist.get_world_size()}): the fake process group of the trace cannot be created beside it")
    try:
        with _fake_process_group(world_size):
            est = estimate_one_rank(spec, step, extrapolate, fsdp_world_size=world_size)
    except NoFSDPUnits as exc:
        return None, str(exc)
    except ValueError as exc:
        if step.fsdp_version == 1 and str(exc).startswith("Must flatten tensors with uniform dtype"):
            # (FSDP1 itself refuses it, in FlatParamHandle: a real run of these settings fails the same way)
            raise ValueError(f"fsdp_version=1 is invalid with parameters of two dtypes in one unit ({exc}): FSDP1 "
                             f"flattens each unit into one tensor of one dtype; allowed: adapter_dtype equal to the "
                             f"frozen base's dtype (e.g. adapter_dtype='bf16' with dtype='bf16-pure'), or "
                             f"fsdp_version=2") from None
        raise  # bad arguments: the same errors as without ZeRO
    except (TypeError, KeyError, FileNotFoundError):
        raise  # bad arguments: the same errors as without ZeRO
    except Exception as exc:  # FSDP2 / DTensor on fake tensors: fall back to the model of the units
        return None, f"tracing FSDP{step.fsdp_version} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    est.world_size, est.zero_stage = world_size, 3
    if step.fsdp_version == 1:  # (the extrapolation's note names FSDP2's trace; here it is FSDP1's)
        est.notes = [n.replace("FSDP2 per-rank trace", "FSDP1 per-rank trace") for n in est.notes]
        est.notes.append(fsdp1_note(world_size, adapters=spec.adapter is not None))
        return est, ""
    est.notes = list(est.notes) + [
        f"per rank of {world_size}, ZeRO stage 3: traced with FSDP2 (fully_shard on every decoder layer and the "
        f"root) on fake tensors under a fake process group, as rank 0; all-gathered units counted while alive"]
    return est, ""


def fsdp1_note(world_size: int, adapters: bool = False) -> str:
    """What an FSDP1 trace runs and what it shows (the facts read in torch/distributed/fsdp of torch 2.13)."""
    frozen = ("; with adapters (use_orig_params=True) a unit holds frozen and trained weights in one flat parameter, "
              "so its gradient before the reduce-scatter is the whole flat parameter's, frozen weights included "
              "(FSDP1 warns of it: _wrap_utils._validate_frozen_params; peft's fsdp_auto_wrap_policy, which makes every "
              "adapter module a unit of its own, avoids it: not what is traced here)") if adapters else ""
    return (f"per rank of {world_size}, ZeRO stage 3: traced with FSDP1 (FullyShardedDataParallel, an auto-wrap unit "
            f"per decoder layer, the rest the root's unit) on fake tensors under a fake process group, as rank 0, with "
            f"PyTorch's defaults: FULL_SHARD, backward_prefetch=BACKWARD_PRE, forward_prefetch=False, "
            f"limit_all_gathers=True, use_orig_params=False (True with adapters), no MixedPrecision policy (the "
            f"recipe's autocast on gathered parameters of the recipe's dtype). Each unit is one flat parameter padded "
            f"to a multiple of {world_size} (FlatParamHandle._get_shard); the root's unit is not freed after forward "
            f"(_post_forward_reshard frees only non-root units under FULL_SHARD), so "
            f"embedding, final norm and head stay gathered through forward and backward; a unit's gradient is its "
            f"flat parameter's, made whole (the views' gradients concatenated) before it is reduce-scattered; "
            f"SHARD_GRAD_OP, HYBRID_SHARD, forward prefetch or a MixedPrecision policy are other runs (not modelled)"
            + frozen)


def fsdp_units(model: Any, dtype: str = "bf16-mixed", config_overrides: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """FSDP2's units of a preset / config: the ``units`` of :func:`shard_estimate` for ``zero_stage=3``.

    ``fully_shard`` wraps every decoder layer and the root (memlab.distributed.fsdp2_shard): the model is
    built twice on the meta device (nothing allocated), at one and two layers.

    Args:
        model: a preset, a config.json path, a Hub id or a transformers config.
        dtype: the recipe, any spelling.
        config_overrides: config fields to change.

    Returns:
        (parameters of one decoder layer, parameters outside the layers).

    Raises:
        ValueError: a model without a decoder stack (a callable), an unknown recipe.
    """
    dtype = vocab.canonical_recipe(dtype, argument="dtype")
    spec = resolve_model(model, config_overrides)
    if not spec.is_hf or spec.layers() is None:
        raise ValueError("zero_stage=3 needs a decoder stack (a preset, a config.json or a transformers config) "
                         "to know FSDP's units; allowed for a callable model: zero_stage 0, 1, 2")
    import torch

    from memlab.models import count_parameters

    counts = []
    for depth in (1, 2):
        with torch.device("meta"):
            counts.append(count_parameters(spec.at_depth(depth).build(dtype, None)))
    layer = counts[1] - counts[0]
    return layer, counts[0] - layer


def _sharder(est: MemoryEstimate, world_size: int, zero_stage: int,
             units: tuple[int, int] | None, fsdp_version: int = 2, grad_accum: int = 1) -> Callable[..., dict[str, int]]:
    """The function that turns one traced breakdown into one rank's, for this stage."""
    N = world_size

    def S(x: int) -> int:
        return -(-int(x) // N)

    def padded(n: int) -> int:  # FSDP1's flat parameter of n elements, padded to a multiple of N (_get_shard)
        return S(n) * N

    bds = dict(est.phase_breakdowns) or {est.peak_phase or "other": dict(est.breakdown)}
    g_full = max((bd.get("gradients", 0) for bd in bds.values()), default=0)
    p_bytes = 2 if est.dtype == Recipe.BF16_PURE else 4
    extra_fwd = extra_bwd = 0
    if zero_stage == 3:
        if units is None:
            raise ValueError("zero_stage=3 needs units=(parameters of one decoder layer, parameters of the root)")
        layer, root = units
        if fsdp_version == 1:  # the root and the running layer (no forward prefetch); in backward also the layer
            extra_fwd = (padded(root) + padded(layer)) * p_bytes  # prefetched (BACKWARD_PRE) and one unit's gradient
            extra_bwd = (padded(root) + 2 * padded(layer) + padded(layer)) * p_bytes
        else:
            extra_fwd = (root + 2 * layer) * p_bytes
            extra_bwd = extra_fwd + layer * p_bytes
    no_sync = zero_stage == 3 and fsdp_version == 1 and grad_accum > 1

    def one(bd: Mapping[str, int], phase: str, end: bool = False) -> dict[str, int]:
        b = {k: int(bd.get(k, 0)) for k in CATEGORIES}
        if zero_stage >= 1:
            b["optimizer"] = S(b["optimizer"])
        if zero_stage == 1:
            b["gradients"] = g_full
        elif zero_stage == 2:
            b["gradients"] = S(g_full)
        elif zero_stage == 3:
            if not (no_sync and not end and phase != "optimizer"):  # no_sync: unsharded until the step
                b["gradients"] = S(b["gradients"])
            b["parameters"] = S(b["parameters"])
            if not end and phase == "forward":
                b["parameters"] += extra_fwd
            elif not end and phase == "backward":
                b["parameters"] += extra_bwd
        return b

    return one


def _shard_phases(est: MemoryEstimate, one: Callable[..., dict[str, int]]) -> tuple:
    """(phase breakdowns, phase peaks, peak, peak phase, breakdown at the peak) of one rank."""
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
        return phase_bd, phases, peak, peak_phase, at_peak
    # extrapolated: the phase peaks are all there is
    bds = dict(est.phase_breakdowns) or {est.peak_phase or "other": dict(est.breakdown)}
    phase_bd = {ph: one(bd, ph) for ph, bd in bds.items()}
    phases = {ph: sum(bd.values()) for ph, bd in phase_bd.items()}
    peak = max(phases.values())
    peak_phase = next(ph for ph, v in phases.items() if v == peak)
    return phase_bd, phases, peak, peak_phase, phase_bd[peak_phase]


def shard_estimate(est: MemoryEstimate, world_size: int, zero_stage: int, *,
                   units: tuple[int, int] | None = None, fsdp_version: int = 2, grad_accum: int = 1) -> MemoryEstimate:
    """One rank's share of a traced single-process step (``est``, traced with the batch of one rank).

    Traced: every phase's bytes by category. Sharded, per Rajbhandari et al. 2020 (ZeRO), with
    ``S(x) = ceil(x / world_size)``:

    * stage 0 (data parallelism): as traced (DDP's gradient buckets are not added);
    * stage 1: optimizer state ``S(optimizer)`` in every phase (its temporaries too); the gradients
      are the full gradient in every phase: one flat buffer that persists, as
      memlab.distributed.ZeroOptimizer and DDP keep it;
    * stage 2: the gradients ``S(full gradient)`` in every phase (each reduced to its owner and freed);
    * stage 3 (FSDP2; the fallback where FSDP2 cannot be traced): parameters, gradients and optimizer
      state sharded; in forward and backward the unsharded units are *modelled*: the root's
      parameters, the running layer and the one prefetched, and in backward one layer's unsharded
      gradients, in the parameters' dtype;
    * stage 3 with ``fsdp_version=1`` (the fallback where FSDP1 cannot be traced): the same shards, with FSDP1's
      units: the root's flat parameter (padded to a multiple of ``world_size``) gathered through forward and
      backward, the running layer (no forward prefetch), in backward the layer prefetched and one unit's unsharded
      gradient; with ``grad_accum`` > 1 the gradients stay unsharded (``no_sync``) until the optimizer step (an
      upper bound in the last backward, which reduce-scatters unit by unit).

    A full trace's timeline is sharded event by event; an extrapolated estimate has only its phase peaks.

    Args:
        est: the single-rank estimate (not changed: a copy is returned).
        world_size: the ranks.
        zero_stage: 0, 1, 2 or 3.
        units: for stage 3, (parameters of one decoder layer, of the root): :func:`fsdp_units`.
        fsdp_version: for stage 3, 2 (FSDP2) or 1 (FSDP1).
        grad_accum: micro-batches per step (FSDP1 keeps unsharded gradients between them).

    Raises:
        ValueError: a bad stage or world size, or stage 3 without ``units``.
    """
    check_zero(world_size, zero_stage, est.optimizer)
    check_fsdp_version("fsdp_version", fsdp_version)
    one = _sharder(est, world_size, zero_stage, units, fsdp_version, grad_accum)
    phase_bd, phases, peak, peak_phase, at_peak = _shard_phases(est, one)
    fsdp1 = zero_stage == 3 and fsdp_version == 1
    notes = list(est.notes) + [
        f"per rank of {world_size}, ZeRO stage {zero_stage}: the single-rank trace with parameters / gradients / "
        f"optimizer state sharded by stage (memlab.estimate.shard_estimate)"
        + ("; FSDP1's unsharded units modelled (FULL_SHARD defaults: the root gathered through forward and "
           "backward, the running layer, in backward the prefetched layer and one unit's gradient"
           + ("; no_sync: gradients unsharded until the optimizer step, an upper bound in the last backward)"
              if grad_accum > 1 else ")") if fsdp1 else
           "; FSDP's unsharded units in forward/backward modelled (root + 2 layers, + 1 layer of gradients)"
           if zero_stage == 3 else "")]
    out = copy.copy(est)
    out.peak_bytes, out.breakdown, out.breakdown_end = peak, at_peak, one(est.breakdown_end, "end", end=True)
    out.phase_breakdowns, out.phase_peaks, out.peak_phase = phase_bd, phases, peak_phase
    out.tracker = PhaseSummary(peak, peak_phase, phases)
    out.notes, out.world_size, out.zero_stage = notes, world_size, zero_stage
    if est.reserved_replay_bytes:  # the replay was of the unsharded step: keep what it cached beyond the peak
        cached = est.reserved_replay_bytes - est.allocated_bytes
        out.reserved_replay_bytes = -(-(out.allocated_bytes + cached) // (2 * 2**20)) * (2 * 2**20)
        out.notes = notes + [f"reserved: the bytes the caching allocator's model cached beyond the unsharded step's "
                             f"peak ({cached / 2**20:,.0f} MiB) added to this rank's"]
    return out
