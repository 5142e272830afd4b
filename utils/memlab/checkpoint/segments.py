"""Segments (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174):
a chain of ``n`` layers cut into ``k`` checkpointed segments, the activation-memory model
``k * boundary + ceil(n / k) * layer``, and its prediction against a tracked measurement on TinyGPT.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from memlab.checkpoint.recompute import checkpoint
from memlab.core.validation import check_int, check_positive_int

__all__ = ["split_segments", "activation_memory_model", "sqrt_segments", "segments_for_budget",
           "checkpoint_sequential", "sequential_activation_peak", "measure_sequential_activation_peak"]


def _checked(where: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # run a memlab.core.validation check, its error message prefixed with the public function's name
    try:
        return check(*args, **kwargs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_layers(where: str, n_layers: Any) -> None:
    _checked(where, check_positive_int, "n_layers", n_layers)


def _check_segments(where: str, segments: Any, n_layers: int) -> None:
    _checked(where, check_int, "segments", segments, minimum=1, maximum=n_layers)  # at most one per layer


def split_segments(n_layers: int, segments: int) -> list[tuple[int, int]]:
    """``n_layers`` (>= 1) cut into ``segments`` (1 to ``n_layers``) contiguous runs whose sizes differ
    by at most one: ``[(start, stop), ...]``, the longer runs first."""
    _check_layers("split_segments", n_layers)
    _check_segments("split_segments", segments, n_layers)
    base, extra = divmod(n_layers, segments)
    out, start = [], 0
    for i in range(segments):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def activation_memory_model(n_layers: int, segments: int, layer_bytes: float = 1.0,
                            boundary_bytes: float | None = None) -> float:
    """Activation peak of ``n_layers`` checkpointed in ``segments`` segments (Chen et al. 2016):

        segments * boundary_bytes + ceil(n_layers / segments) * layer_bytes

    The first term is the segment inputs kept through the whole step; the second is one segment's
    activations, recomputed in backward (the last segment's in forward, where it is not
    recomputed). In layer units (``boundary_bytes = layer_bytes = 1``, the default) this is
    ``n/k + k``, smallest at ``k = sqrt(n)``. In a transformer a boundary (the hidden state,
    ``e*s*b*h`` bytes) is much smaller than a layer's activations: pass both measured sizes.
    ``segments = 1`` is no checkpointing: the input plus every layer's activations.

    Returns the modelled peak in the units of the byte arguments (``boundary_bytes`` defaults to
    ``layer_bytes``).
    """
    _check_layers("activation_memory_model", n_layers)
    _check_segments("activation_memory_model", segments, n_layers)
    if layer_bytes < 0:
        raise ValueError(f"activation_memory_model: layer_bytes={layer_bytes!r} must be >= 0")
    boundary = layer_bytes if boundary_bytes is None else boundary_bytes
    if boundary < 0:
        raise ValueError(f"activation_memory_model: boundary_bytes={boundary_bytes!r} must be >= 0")
    return segments * boundary + math.ceil(n_layers / segments) * layer_bytes


def sqrt_segments(n_layers: int) -> int:
    """The segment count that minimises ``k + ceil(n/k)`` (Chen et al.'s sqrt(n) rule).

    For a perfect square this is exactly ``sqrt(n)``; among ties the one closest to ``sqrt(n)``.
    """
    _check_layers("sqrt_segments", n_layers)
    root = math.sqrt(n_layers)
    return min(range(1, n_layers + 1), key=lambda k: (k + math.ceil(n_layers / k), abs(k - root), k))


def segments_for_budget(n_layers: int, budget_bytes: float, layer_bytes: float,
                        boundary_bytes: float) -> int:
    """The fewest segments whose modelled activation peak fits ``budget_bytes``.

    Fewer segments means less recomputation (``n - ceil(n/k)``-ish layers rerun, growing with k),
    so the first ``k`` that fits is the cheapest.

    Raises:
        ValueError: no segment count fits, or a bad argument.
    """
    _check_layers("segments_for_budget", n_layers)
    if budget_bytes < 0 or layer_bytes < 0 or boundary_bytes < 0:
        raise ValueError(f"segments_for_budget: budget_bytes={budget_bytes!r}, layer_bytes={layer_bytes!r}, "
                         f"boundary_bytes={boundary_bytes!r} must all be >= 0")
    for k in range(1, n_layers + 1):
        if activation_memory_model(n_layers, k, layer_bytes, boundary_bytes) <= budget_bytes:
            return k
    best = min(activation_memory_model(n_layers, k, layer_bytes, boundary_bytes) for k in range(1, n_layers + 1))
    raise ValueError(f"segments_for_budget: budget_bytes={budget_bytes:,.0f} is below the smallest modelled peak "
                     f"{best:,.0f} bytes for n_layers={n_layers}; allowed: a budget >= {best:,.0f}")


def checkpoint_sequential(modules: Sequence[Callable[..., Any]] | nn.Sequential, segments: int, x: Any, *,
                          preserve_rng_state: bool = True,
                          checkpoint_fn: Callable[..., Any] | None = None) -> Any:
    """Run ``modules`` one after the other on ``x``, checkpointing ``segments`` contiguous segments.

    Segments come from :func:`split_segments`. As in ``torch.utils.checkpoint.checkpoint_sequential``
    the last segment runs without a checkpoint: backward needs its activations straight away, so
    recomputing it would cost time and save nothing. ``segments=1`` is therefore no checkpointing.

    Args:
        segments: the number of segments, 1 to ``len(modules)``.
        checkpoint_fn: ``checkpoint_fn(fn, x)``; default :func:`checkpoint` (pass e.g.
            :func:`selective_checkpoint`).

    Raises:
        ValueError: ``modules`` is empty or holds something not callable, or a bad ``segments``.
    """
    mods = list(modules)
    if not mods:
        raise ValueError("checkpoint_sequential: modules is empty; allowed: a non-empty sequence of callables")
    for i, m in enumerate(mods):
        if not callable(m):
            raise ValueError(f"checkpoint_sequential: modules[{i}]={m!r} is not callable")
    _check_segments("checkpoint_sequential", segments, len(mods))
    if checkpoint_fn is None:
        def checkpoint_fn(f, inp):
            return checkpoint(f, inp, preserve_rng_state=preserve_rng_state)

    def run(chunk):
        def seg(inp):
            for m in chunk:
                inp = m(inp)
            return inp
        return seg

    bounds = split_segments(len(mods), segments)
    for j, (a, b) in enumerate(bounds):
        seg = run(mods[a:b])
        x = seg(x) if j == len(bounds) - 1 else checkpoint_fn(seg, x)
    return x


def _check_run_args(where: str, config: Any, batch_size: Any, seq_len: Any, segments: Any) -> None:
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        _checked(where, check_positive_int, name, v)
    n_layer = getattr(config, "n_layer", None)
    if not isinstance(n_layer, int) or not hasattr(config, "n_embd"):
        raise ValueError(f"{where}: config={config!r} must be a memlab.models.TinyGPTConfig")
    if seq_len > config.block_size:
        raise ValueError(f"{where}: seq_len={seq_len} exceeds config.block_size={config.block_size}; "
                         f"allowed: 1 to {config.block_size}")
    _check_segments(where, segments, n_layer)


def sequential_activation_peak(config: Any, batch_size: int, seq_len: int, segments: int) -> int:
    """Predicted activation peak (bytes) of :func:`checkpoint_sequential` over TinyGPT's blocks.

    The run is the one :func:`measure_sequential_activation_peak` measures: ``config.n_layer``
    training-mode blocks (fp32 on the CPU, dropout on: masks are 4-byte floats there), an input
    ``x`` of shape ``(batch_size, seq_len, n_embd)`` made before the step (so not counted), cut into
    ``segments`` segments and run forward and backward. With ``n`` layers, ``k`` segments,
    ``B = 4*b*s*h`` (one hidden state), ``L`` the bytes one block saves (the per-layer formula of
    chapter 00 with 4-byte activations, 4-byte masks and fp32 LayerNorm statistics) and ``r`` the
    MLP ratio::

        (k - 1) * B                 the segment boundaries kept through the step (Chen et al. 2016)
      + ceil(n / k) * L             the longest segment's activations, alive again when recomputed
      + r*h*b*s*4 + r*h*h*4 + h*4   the working set of that segment's top block in backward: the
                                    gradient of the MLP hidden and fresh gradients of the MLP output
                                    projection's weight and bias (allocations of backward until
                                    autograd stores them in .grad; the bias term is the 2,048 B a
                                    full-scale run, h=512, measured above the formula without it)

    The result predicts the peak of the tracker's ``activations`` category. ``config`` is a
    ``memlab.models.TinyGPTConfig``; ``seq_len`` is 1 to ``config.block_size``, ``segments`` 1 to
    ``config.n_layer``.

    Raises:
        ValueError: naming a bad argument.
    """
    from memlab.accounting import activation_bytes_per_layer

    _check_run_args("sequential_activation_peak", config, batch_size, seq_len, segments)
    n, k = config.n_layer, segments
    s, b, h, a, r = seq_len, batch_size, config.n_embd, config.n_head, config.mlp_ratio
    masks = 4 if config.dropout > 0 else 0
    layer = activation_bytes_per_layer(s, b, h, a, act_bytes=4, mask_bytes=masks, layernorm_stats_bytes=4)
    boundary = 4 * b * s * h
    working = r * h * b * s * 4 + r * h * h * 4 + h * 4
    return (k - 1) * boundary + math.ceil(n / k) * layer + working


class _Segments(nn.Module):
    # the blocks of a TinyGPT run by checkpoint_sequential (a root module for the tracker)

    def __init__(self, blocks: nn.ModuleList, segments: int, checkpoint_fn: Callable[..., Any] | None) -> None:
        super().__init__()
        self.blocks, self.segments, self.checkpoint_fn = blocks, segments, checkpoint_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(list(self.blocks), self.segments, x, checkpoint_fn=self.checkpoint_fn)


def measure_sequential_activation_peak(config: Any, batch_size: int, seq_len: int, segments: int, *,
                                       checkpoint_fn: Callable[..., Any] | None = None, seed: int = 0) -> int:
    """Measured activation peak (bytes) of :func:`checkpoint_sequential` over TinyGPT's blocks.

    Builds ``TinyGPT(config)`` on the CPU (seed ``seed``), takes its blocks in training mode, makes
    ``x`` (``(batch_size, seq_len, n_embd)``, requires grad) and an output gradient, then runs
    ``checkpoint_sequential(blocks, segments, x)`` forward and backward inside a
    :class:`memlab.profiler.MemoryTracker`.

    Arguments as :func:`sequential_activation_peak`; ``checkpoint_fn`` goes to
    :func:`checkpoint_sequential`, ``seed`` seeds the model and the input.

    Returns:
        The largest number of bytes the tracker's ``activations`` category held (saved and
        recomputed activations, the gradients flowing back, boundaries); parameters and their
        accumulated ``.grad`` are not in it.

    Raises:
        ValueError: naming a bad argument.
    """
    from memlab.models import TinyGPT
    from memlab.profiler import MemoryTracker

    _check_run_args("measure_sequential_activation_peak", config, batch_size, seq_len, segments)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        run = _Segments(TinyGPT(config).blocks, segments, checkpoint_fn).train()
        x = torch.randn(batch_size, seq_len, config.n_embd, requires_grad=True)
        grad = torch.randn(batch_size, seq_len, config.n_embd)
    with MemoryTracker(run) as tracker:
        run(x).backward(grad)
    return max(e.bytes["activations"] for e in tracker.timeline)

