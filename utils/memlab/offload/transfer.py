"""What crosses between device and host for :class:`memlab.offload.OffloadedAdamW`.

Gradients go to the host as backward finishes them (a post-accumulate-grad hook, a side CUDA
stream, pinned staging buffers); updated weights come back, cast on the host; a worker thread runs
updates while the device computes. ZeRO-Offload: Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training" (USENIX ATC).
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any

import torch

__all__: list[str] = []


class _HostTransfer:
    """The copy machinery of :class:`memlab.offload.OffloadedAdamW` (a mixin: it uses the optimizer's
    ``_flats``, ``_slot``, ``_ready``, ``_count``, ``_pending``, ``traffic`` and ``_update_one``)."""

    # -- gradients to the host
    def _log(self, what: str, p: torch.Tensor) -> None:
        gi, i = self._slot[p]
        self.timeline.append((what, gi, i, time.perf_counter()))

    def _count_copy(self, direction: str, t: torch.Tensor) -> None:
        with self._lock:
            self.traffic[f"{direction}_bytes"] += t.numel() * t.element_size()
            self.traffic[f"{direction}_copies"] += 1

    def _on_grad(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook: send ``p.grad`` to the host when it is final for this step."""
        if p.grad is None:
            return
        if not self._cycle_open:
            self.timeline = []
            self._cycle_open = True
        self._count[p] += 1
        self._log("grad", p)
        if self.offload_gradients:
            self._to_host(p)  # every micro-batch: the device keeps no gradient
        elif self._count[p] == self.accumulation_steps:
            if not self.cuda and not self.step_in_backward:
                return  # host == device: nothing to hide, step() makes the one copy (the tracker sees it there)
            self._to_host(p)  # the last micro-batch: the sum autograd accumulated on the device
        elif self._count[p] > self.accumulation_steps:
            self._ready[p], self._pending[p] = 0, None  # more micro-batches than declared: step() copies again
            return
        else:
            return
        if self.step_in_backward and self._count[p] == self.accumulation_steps:
            self._start_worker()
            self._queue.put(p)

    def _to_host(self, p: torch.Tensor) -> None:
        """Copy (or, with offload_gradients, add) ``p.grad`` into its fp32 host slot; free it if offloading."""
        gi, i = self._slot[p]
        grad = p.grad
        self._count_copy("to_host", grad)
        self._copied[p] = (id(grad), grad._version)
        if not self.cuda:
            slot = self._flats[gi]["grad"].views[i]
            if self._ready[p] and self.offload_gradients:
                slot.add_(grad)
            else:
                slot.copy_(grad)
            self._ready[p] += 1
        else:
            if self.offload_gradients:
                self._fold(p)  # an earlier micro-batch's copy joins the fp32 host slot first
            stream = self._d2h_stream
            stream.wait_stream(torch.cuda.current_stream(p.device))
            staging = self._flats[gi]["staging"][i]
            with torch.cuda.stream(stream):
                staging.copy_(grad, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            grad.record_stream(stream)  # the caching allocator must not hand grad's memory out before the copy ran
            self._pending[p] = event
        if self.offload_gradients:
            p.grad = None

    def _fold(self, p: torch.Tensor) -> None:
        """Wait for ``p``'s grad copy and add it to (or write it into) the fp32 host slot."""
        event = self._pending[p]
        if event is None:
            return
        event.synchronize()
        gi, i = self._slot[p]
        slot = self._flats[gi]["grad"].views[i]
        staging = self._flats[gi]["staging"][i]
        if self._ready[p] and self.offload_gradients:
            slot.add_(staging)
        else:
            slot.copy_(staging)
        self._ready[p] += 1
        self._pending[p] = None

    def _gather(self, p: torch.Tensor) -> bool:
        """Make ``p``'s host gradient ready; False when ``p`` has no gradient this step.

        Without offloaded gradients ``p.grad`` stays the truth: if it changed in place since a
        hook sent it (a loss scaler's ``unscale_``, another micro-batch), it is sent again.
        """
        if self._pending.get(p) is not None:
            self._fold(p)
        if not self.offload_gradients and p.grad is None:
            return False  # the gradient stays on the device: none there (or set to None since), no update, like torch
        if p.grad is not None and not self.offload_gradients and (
                not self._ready[p] or self._copied.get(p) != (id(p.grad), p.grad._version)):
            gi, i = self._slot[p]
            self._count_copy("to_host", p.grad)
            self._copied[p] = (id(p.grad), p.grad._version)
            self._flats[gi]["grad"].views[i].copy_(p.grad)  # synchronous: no hook sent it, or it went stale
            self._ready[p] = 1
        return bool(self._ready[p])


    # -- the worker thread: updates during backward (step_in_backward) or the next step (delay_update)
    def _start_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            return
        self._queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, args=(self._queue,), name="OffloadedAdamW-step", daemon=True)
        self._worker.start()

    def _work(self, q: Any) -> None:
        while True:
            p = q.get()
            try:
                if p is None:
                    return
                if callable(p):  # delay_update: a whole step's update
                    if self._worker_error is None:
                        with torch.no_grad():
                            p()
                elif self._worker_error is None:
                    self._fold(p)
                    self._log("update_start", p)
                    with torch.no_grad():
                        self._update_one(p)
                    self._log("update_end", p)
                    self._stepped[p] = True
            except BaseException as exc:  # reported by step()
                self._worker_error = exc
            finally:
                q.task_done()

    def _drain(self) -> None:
        """Wait until the worker has finished every update it was given."""
        if self._queue is not None:
            self._queue.join()
        if self._worker_error is not None:
            exc, self._worker_error = self._worker_error, None
            raise RuntimeError(f"OffloadedAdamW: a parameter update in the worker thread failed: {exc!r}") from exc


    # -- updated weights back to the device
    def _copy_back_delayed(self) -> None:
        self._drain()
        if self.cuda and self._delayed:
            self._h2d_stream.wait_stream(torch.cuda.current_stream(self._device))  # backward has read the old weights
        for gi, i in self._delayed:
            self._copy_back(self.param_groups[gi]["params"][i], gi, i)
        self._delayed = []


    def _copy_back(self, p: torch.Tensor, gi: int, i: int) -> None:
        master = self._flats[gi]["master"].views[i]
        self._count_copy("to_device", p)
        if not self.cuda:
            p.data.copy_(master)  # cast to p's dtype (round to nearest even)
            return
        staging = self._flats[gi]["staging"][i]
        src = master
        if p.dtype != torch.float32:
            staging.copy_(master)  # cast on the host: half the bytes cross PCIe
            src = staging
        with torch.cuda.stream(self._h2d_stream):
            p.data.copy_(src, non_blocking=True)



def _grad_hook(opt: Any) -> Any:
    """The post-accumulate-grad hook of ``opt``; a weak reference, so the hook does not keep the optimizer alive."""
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        o = ref()
        if o is not None:
            o._on_grad(p)

    return hook
