"""HostTransfer: the copies between device and host that :class:`memlab.offload.OffloadedAdamW` makes.

Gradients go to fp32 host slots as backward finishes them: on CUDA through a pinned staging copy in
the parameter's dtype, on a side stream, so that backward goes on meanwhile; updated weights come
back from the fp32 master, cast on the host so that half the bytes cross PCIe. ZeRO-Offload: Ren et
al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC).
"""
from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["HostTransfer"]


class HostTransfer:
    """The device <-> host copies of one optimizer, each counted in :attr:`traffic`.

    Per parameter it keeps how many micro-batches its host slot holds, the CUDA event of a copy still
    in flight, and (on CUDA) a pinned staging tensor in the parameter's dtype: gradients arrive there,
    updated weights leave from there. The optimizer owns the fp32 host slots and masters and passes
    them in. With ``offload_gradients`` each micro-batch's gradient is added to the slot and freed on
    the device. On a CPU host and device are one memory: the copies are plain ``copy_``.

    Thread-safe where the optimizer needs it: :meth:`fold` and :meth:`copy_back` also run on its
    worker thread (the traffic counts are locked).

    Args:
        device: the parameters' device.
        pin_memory: page-lock the staging tensors.
        offload_gradients: sum micro-batches in the host slot and free each device gradient.
    """

    def __init__(self, device: torch.device, pin_memory: bool, offload_gradients: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin_memory = pin_memory
        self.offload_gradients = offload_gradients
        self.traffic = {"to_host_bytes": 0, "to_host_copies": 0, "to_device_bytes": 0, "to_device_copies": 0}
        self._runtime()

    def _runtime(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[torch.Tensor, int] = {}  # micro-batches summed in the host slot (0: none)
        self._pending: dict[torch.Tensor, Any] = {}  # CUDA event of a grad copy still in flight
        self._copied: dict[torch.Tensor, tuple[int, int]] = {}  # (id, _version) of the p.grad last sent to the host
        self._staging: dict[torch.Tensor, torch.Tensor] = {}
        self._d2h: Any = None
        self._h2d: Any = None
        self._h2d_event: Any = None
        if self.cuda:
            self._d2h = torch.cuda.Stream(device=self.device)
            self._h2d = torch.cuda.Stream(device=self.device)

    # pickling and deepcopy keep the counts; streams, events, staging and the per-parameter maps are
    # rebuilt as the optimizer adds its parameters again
    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("device", "cuda", "pin_memory", "offload_gradients", "traffic")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._runtime()

    def add(self, p: torch.Tensor) -> None:
        """Start tracking ``p`` (on CUDA: allocate its staging tensor)."""
        self._ready[p] = 0
        self._pending[p] = None
        if self.cuda and p not in self._staging:
            self._staging[p] = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pin_memory)

    def staging(self) -> list[torch.Tensor]:
        """The pinned staging tensors (host memory the optimizer holds outside its state)."""
        return list(self._staging.values())

    def forget(self, p: torch.Tensor) -> None:
        """Mark ``p``'s host slot empty: the next :meth:`gather` copies its gradient again."""
        self._ready[p] = 0
        self._pending[p] = None

    def reset(self) -> None:
        """A new optimizer step: every host slot empty."""
        for p in self._ready:
            self.forget(p)

    def _count(self, direction: str, t: torch.Tensor) -> None:
        with self._lock:
            self.traffic[f"{direction}_bytes"] += t.numel() * t.element_size()
            self.traffic[f"{direction}_copies"] += 1

    # -- gradients to the host
    def send(self, p: torch.Tensor, slot: torch.Tensor) -> None:
        """Copy (with ``offload_gradients``: add) ``p.grad`` into the fp32 host ``slot``; asynchronous on CUDA."""
        grad = p.grad
        self._count("to_host", grad)
        self._copied[p] = (id(grad), grad._version)
        if not self.cuda:
            if self._ready[p] and self.offload_gradients:
                slot.add_(grad)
            else:
                slot.copy_(grad)
            self._ready[p] += 1
        else:
            if self.offload_gradients:
                self.fold(p, slot)  # an earlier micro-batch's copy joins the fp32 host slot first
            stream = self._d2h
            stream.wait_stream(torch.cuda.current_stream(p.device))
            staging = self._staging[p]
            with torch.cuda.stream(stream):
                staging.copy_(grad, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            grad.record_stream(stream)  # the caching allocator must not hand grad's memory out before the copy ran
            self._pending[p] = event
        if self.offload_gradients:
            p.grad = None

    def fold(self, p: torch.Tensor, slot: torch.Tensor) -> None:
        """Wait for ``p``'s copy in flight, if any, and add it to (or write it into) the host ``slot``."""
        event = self._pending[p]
        if event is None:
            return
        event.synchronize()
        staging = self._staging[p]
        if self._ready[p] and self.offload_gradients:
            slot.add_(staging)
        else:
            slot.copy_(staging)
        self._ready[p] += 1
        self._pending[p] = None

    def gather(self, p: torch.Tensor, slot: torch.Tensor) -> bool:
        """Make ``p``'s host gradient ready in ``slot``; False when ``p`` has no gradient this step.

        Without offloaded gradients ``p.grad`` stays the truth: if it changed in place since it was
        sent (a loss scaler's ``unscale_``, another micro-batch), it is copied again.
        """
        if self._pending.get(p) is not None:
            self.fold(p, slot)
        if not self.offload_gradients and p.grad is None:
            return False  # the gradient stays on the device: none there (or set to None since), no update, like torch
        if p.grad is not None and not self.offload_gradients and (
                not self._ready[p] or self._copied.get(p) != (id(p.grad), p.grad._version)):
            self._count("to_host", p.grad)
            self._copied[p] = (id(p.grad), p.grad._version)
            slot.copy_(p.grad)  # synchronous: nothing sent it, or it went stale
            self._ready[p] = 1
        return bool(self._ready[p])

    # -- updated weights back to the device
    def copy_back(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Copy the fp32 ``master`` into ``p`` in ``p``'s dtype (on CUDA on a side stream, cast on the host)."""
        self._count("to_device", p)
        if not self.cuda:
            p.data.copy_(master)  # cast to p's dtype (round to nearest even)
            return
        src = master
        if p.dtype != torch.float32:
            src = self._staging[p]
            src.copy_(master)  # cast on the host: half the bytes cross PCIe
        with torch.cuda.stream(self._h2d):
            p.data.copy_(src, non_blocking=True)

    def wait_for_compute(self) -> None:
        """Copies back issued from now on wait for the work queued on the compute stream (it reads the old weights)."""
        if self.cuda:
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))

    def wait_staging_free(self) -> None:
        """Block until the copies back before the last :meth:`end_copies_back` have left the staging tensors."""
        if self._h2d_event is not None:
            self._h2d_event.synchronize()

    def end_copies_back(self) -> None:
        """Make the compute stream wait for the copies back (the next forward reads the weights)."""
        if self.cuda:
            self._h2d_event = torch.cuda.Event()
            self._h2d_event.record(self._h2d)
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)
