"""ZeRO stages 1 and 2 from scratch on a flat buffer, and the paper's per-rank arithmetic.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
sec. 5: data parallelism keeps the whole model state on each of N ranks; ZeRO partitions it. With
P parameters and mixed-precision Adam (2 bytes of weights, 2 of gradients, K = 12 of fp32 master
weights and moments per parameter) the per-rank model-state bytes are::

    stage 0 (DP)       (2 + 2 + K) P
    stage 1 (P_os)     (2 + 2) P + K P / N          optimizer state sharded
    stage 2 (P_os+g)   2 P + (2 + K) P / N          ... and gradients
    stage 3 (P_os+g+p) (2 + 2 + K) P / N            ... and parameters (FSDP: memlab.distributed.fsdp)

Layout: the P parameters are copied into one flat buffer padded to ``N * S`` elements,
``S = ceil(P / N)`` (:mod:`memlab.distributed.collectives`); every parameter becomes a view into
it, so the model runs unchanged. Rank ``r`` owns the slice ``[r S, (r + 1) S)``, and the inner
optimizer (any ``torch.optim`` class) sees that slice as its only parameter, so its state is 1/N.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from memlab.core.validation import check_choice, check_positive_int, invalid
from memlab.distributed.collectives import all_gather_flat, padded_size, reduce_scatter_flat, shard_range

__all__ = ["STAGES", "ZeroOptimizer", "zero_model_state_bytes"]

#: ZeRO's stages: 0 data parallelism, 1 optimizer state sharded, 2 and gradients, 3 and parameters
STAGES = (0, 1, 2, 3)


class ZeroOptimizer:
    """ZeRO stage 1 (optimizer state sharded) or 2 (and gradients) over the data-parallel ``process_group``.

    ``ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-3)`` after
    ``init_process_group``: every rank builds the same model, then each step runs forward and
    backward on its own part of the global batch and calls ``step()`` (which averages the
    gradients over the ranks, as DDP does) and ``zero_grad()``. Rank 0's parameters are broadcast
    at construction, so every rank starts from the same weights.

    * Stage 1 keeps one persistent flat gradient buffer (as DDP's buckets); ``step()``
      reduce-scatters it, the inner optimizer steps on the rank's slice, and an all-gather of the
      updated slices refreshes every parameter: 2 ring passes per step, the volume of data
      parallelism's all-reduce (paper sec. 5.1, 7.2.1).
    * Stage 2 keeps only the rank's ``S``-element gradient slice: as soon as autograd has
      accumulated a parameter's gradient, each piece of it is reduced to the rank that owns that
      piece and the full gradient is freed, so the model's full gradient never exists (DeepSpeed
      does the same with buckets of many parameters, overlapped with backward).

    With the same seed and global batch, the weights equal single-process training that
    accumulates each rank's micro-batch gradient scaled by 1/N, bit for bit: a sum of two
    gradients is the same in either order and a division by a power of two is exact.

    Attributes: ``optim`` the inner optimizer over this rank's slice (``shard``); ``flat_param``
    the flat parameter buffer (the model's parameters are views into it); ``flat_grad`` the flat
    gradient buffer (stage 1; None at stage 2); ``shard_grad`` this rank's gradient slice, which
    ``step()`` overwrites with the average over the ranks (stage 1: a view of ``flat_grad``).

    Args:
        params: the model's parameters (one dtype on one device; no parameter groups).
        optimizer_cls: a ``torch.optim.Optimizer`` class, e.g. ``torch.optim.AdamW``.
        **optimizer_kwargs: passed to ``optimizer_cls`` (lr, betas ...).

    Raises:
        ValueError: a stage other than 1 or 2; no parameter, or several dtypes or devices.
        TypeError: ``optimizer_cls`` is not an optimizer class; parameter groups.
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_cls: type, stage: int = 1,
                 process_group: Any = None, **optimizer_kwargs: Any) -> None:
        if stage not in (1, 2):
            raise invalid("stage", stage, "1 (optimizer state sharded), 2 (and gradients); stage 3 (parameters "
                                          "too) is FSDP: memlab.distributed.fsdp2_shard")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls={optimizer_cls!r} is invalid; allowed: a torch.optim.Optimizer class such "
                            f"as torch.optim.AdamW")
        if not dist.is_initialized():
            raise RuntimeError("ZeroOptimizer needs torch.distributed initialised: run it under "
                               "memlab.distributed.launch (or torchrun, then init_process_group)")
        seen: set[int] = set()
        self.params: list[torch.Tensor] = []
        for p in params:
            if isinstance(p, dict):
                raise TypeError("params: parameter groups (dicts) are not supported; allowed: an iterable of tensors")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("params is empty (no tensor requires grad); allowed: the model's parameters")
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"params have dtypes {sorted(map(str, dtypes))} on devices {sorted(map(str, devices))}; "
                             f"allowed: one dtype on one device (one flat buffer)")
        self.stage = stage
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.numel = sum(p.numel() for p in self.params)
        self.padded_numel = padded_size(self.numel, self.world_size)
        self.shard_start, self.shard_stop = shard_range(self.numel, self.rank, self.world_size)
        dtype, device = self.params[0].dtype, self.params[0].device
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
            self._slices: list[tuple[int, int]] = []
            off = 0
            for p in self.params:
                n = p.numel()
                flat[off:off + n].copy_(p.reshape(-1))
                self._slices.append((off, n))
                off += n
            dist.broadcast(flat, src=dist.get_global_rank(process_group, 0) if process_group is not None else 0,
                           group=process_group)
            for p, (o, n) in zip(self.params, self._slices):
                p.data = flat[o:o + n].view_as(p)  # the parameter now lives in the flat buffer
        self.flat_param = flat
        self.shard = nn.Parameter(flat[self.shard_start:self.shard_stop])  # a view: no copy
        self.optim = optimizer_cls([self.shard], **optimizer_kwargs)
        S = self.shard_stop - self.shard_start
        if stage == 1:
            # the full gradient, one flat buffer (as DDP's buckets); the parameters' .grad are views into it
            self.flat_grad: torch.Tensor | None = torch.zeros(self.padded_numel, dtype=dtype, device=device)
            self.shard_grad = self.flat_grad[self.shard_start:self.shard_stop]
        else:
            # only this rank's slice of the gradient lives on: 1/N of the gradient bytes
            self.flat_grad = None
            self.shard_grad = torch.zeros(S, dtype=dtype, device=device)
        self.shard.grad = self.shard_grad
        self._arrived: set[int] = set()  # parameters whose gradient arrived since the last step
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(self.params)]

    def _owner_pieces(self, o: int, n: int) -> list[tuple[int, int, int]]:
        # (rank, start, stop) of the pieces of flat range [o, o + n) that each rank owns
        S = self.shard_stop - self.shard_start
        out = []
        for r in range(o // S, min((o + n - 1) // S, self.world_size - 1) + 1):
            lo, hi = max(o, r * S), min(o + n, (r + 1) * S)
            if lo < hi:
                out.append((r, lo, hi))
        return out

    def _grad_hook(self, i: int):
        o, n = self._slices[i]
        pieces = self._owner_pieces(o, n)

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            self._arrived.add(i)
            with torch.no_grad():
                if self.stage == 1:
                    view = self.flat_grad[o:o + n]
                    if g.data_ptr() != view.data_ptr():  # autograd's new gradient: into the flat buffer
                        view.copy_(g.reshape(-1))
                        p.grad = view.view_as(p)  # frees it; a second backward accumulates in place
                    return
                # stage 2: reduce this gradient now, each piece to the rank that owns it (a reduce-scatter,
                # one parameter at a time), keep our piece, free the full gradient. dist.reduce, because a
                # parameter's range does not split into the equal per-rank pieces reduce_scatter_tensor needs
                flat = g.reshape(-1)
                sent = []
                for r, lo, hi in pieces:
                    piece = flat[lo - o:hi - o].contiguous()
                    dst = dist.get_global_rank(self.group, r) if self.group is not None else r
                    dist.reduce(piece, dst=dst, op=dist.ReduceOp.SUM, group=self.group)
                    if r == self.rank:
                        self.shard_grad[lo - self.shard_start:hi - self.shard_start].add_(piece)
                    sent.append(weakref.ref(piece))
                    del piece
                if g.device.type == "cpu":
                    _until_released(sent)
            p.grad = None  # the full gradient is freed here, on this thread
        return hook

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients over the ranks into this rank's slice, step on it, all-gather the slices.

        Stage 1: a reduce-scatter of the flat gradient, in place (:func:`reduce_scatter_flat`: one
        ``dist.reduce`` of each ``S``-element piece to the rank that owns it), then / N.
        Stage 2: the slice already holds the sum (reduced during backward), / N.
        Then the all-gather, in place (:func:`all_gather_flat`: each owner's slice broadcast into
        its view of the flat buffer). Neither allocates: the step's peak is the inner optimizer's.

        Raises:
            RuntimeError: stage 2 and a parameter got no gradient on this rank. Each gradient is
                reduced as it is made, so the ranks' collectives must pair one to one: the error
                names the parameter instead of the peers waiting for its reduce until the timeout.
        """
        if self.stage == 2:
            missing = [i for i in range(len(self.params)) if i not in self._arrived]
            if missing:
                i = missing[0]
                raise RuntimeError(
                    f"ZeroOptimizer(stage=2): parameter {i} (shape {tuple(self.params[i].shape)}) got no gradient on "
                    f"rank {self.rank} this step ({len(missing)} of {len(self.params)} without one); stage 2 reduces "
                    f"each gradient during backward, so every rank must make a gradient for every parameter: use it "
                    f"in the loss on every rank, or freeze it (requires_grad=False) before building the optimizer")
        self._arrived.clear()
        if self.stage == 1:
            # the reduce-scatter of the flat gradient, in place: piece r summed on rank r by one dist.reduce
            # into its view (nothing allocated), then / N (gloo has no AVG). Not gloo's reduce_scatter_tensor:
            # it clones the whole input and all-reduces the clone
            reduce_scatter_flat(self.flat_grad, self.group, average=True, in_place=True)  # shard_grad is that view
        else:
            self.shard_grad.div_(self.world_size)
        self.optim.step()
        # the all-gather, in place: each owner's slice broadcast into its view of the flat buffer. Not gloo's
        # all_gather_into_tensor: it allocates a whole flat copy inside the op, which lifted ZeRO-1's peak
        # above plain data parallelism's by the allocator's count
        all_gather_flat(self.flat_param[self.shard_start:self.shard_stop], self.group, out=self.flat_param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers in place and set the parameters' ``.grad`` to None.

        The flat buffers persist. Autograd's next gradient of each parameter is copied into the
        flat buffer by the hook and freed; a second backward before ``step()`` accumulates into the
        buffer in place. ``set_to_none`` is accepted for the ``torch.optim`` API; the buffers are
        zeroed either way.
        """
        for p in self.params:
            p.grad = None
        if self.flat_grad is not None:
            self.flat_grad.zero_()  # a parameter without a gradient in the next step contributes zeros
        else:
            self.shard_grad.zero_()
            for p in self.params:
                p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict (this rank's shard of the state)."""
        return self.optim.state_dict()

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, rank {self.rank}/{self.world_size}, {self.numel:,} params in a flat "
                f"buffer of {self.padded_numel:,}, this rank's slice [{self.shard_start}, {self.shard_stop}), "
                f"inner {type(self.optim).__name__})")


def _until_released(refs: list, timeout: float = 30.0) -> None:
    # gloo's worker thread drops its reference to a collective's tensors just after the collective
    # completes, which may be a moment after dist.reduce has returned here. A gradient whose last
    # reference goes on that thread is freed there, where torch.profiler records no event (it records
    # only the threads it profiles): wait until gloo let go of the pieces, so that the
    # gradient is freed on this thread, now, as the allocator's events then show. The wait ends as soon as
    # gloo lets go (microseconds on an idle machine); the long deadline is for a loaded one, where gloo's
    # thread may wait for a core or the GIL (with a 1 s deadline, one CI run on a loaded 2-core runner saw
    # one step of five keep a 40 KiB gradient: the deadline running out is the likely cause)
    deadline = time.monotonic() + timeout
    pause = 0.0
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(pause)  # 0 first (yield the GIL), then up to 1 ms so a long wait does not spin a core
        pause = min(0.001, pause * 2 + 1e-5)


def zero_model_state_bytes(n_params: int, world_size: int, stage: int, *, param_bytes: int = 2,
                           grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict[str, float]:
    """Per-rank model-state bytes of ZeRO ``stage`` (Rajbhandari et al. 2020, section 5.1, Figure 1).

    Defaults: mixed-precision Adam as in the paper (fp16 weights and gradients, K = 12 bytes of
    fp32 master weights, momentum and variance per parameter). For fp32 Adam pass
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``.

    Args:
        n_params: P, the model's parameters.
        world_size: N, the data-parallel ranks.
        stage: 0 to 3 (:data:`STAGES`).
        optimizer_bytes: K, bytes of optimizer state (and master weights) per parameter.

    Returns:
        ``parameters``, ``gradients``, ``optimizer`` and ``total`` (unpadded: a real shard rounds
        up to a multiple of the world size).

    Raises:
        ValueError: an unknown stage or a world size < 1.
    """
    check_choice("stage", stage, STAGES)
    check_positive_int("world_size", world_size)
    P, N = float(n_params), float(world_size)
    out = {
        "parameters": param_bytes * P / (N if stage >= 3 else 1),
        "gradients": grad_bytes * P / (N if stage >= 2 else 1),
        "optimizer": optimizer_bytes * P / (N if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out
