"""Streaming between host and device: gradients to the host as backward makes them, layers to the device as inference needs them.

Gradients: ZeRO-Offload (Ren et al. 2021) moves each finished gradient off the device during
backward. Layers: the idea behind accelerate's ``device_map`` with offloaded modules, with the
next layer's copy prefetched on a side CUDA stream.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn

from memlab.core.validation import invalid

__all__ = ["install_grad_hooks", "StreamedSequential"]


# ----------------------------------------------------------------------------- gradients to the host
def install_grad_hooks(params: Iterable[torch.Tensor], slots: Sequence[torch.Tensor]) -> list[Any]:
    """Stage gradients as backward produces them: add each finished ``p.grad`` into its fp32 slot, then free it.

    ``slots[i]`` is parameter ``i``'s host buffer (same shape, float32). Uses
    ``Tensor.register_post_accumulate_grad_hook``, which fires once ``p.grad`` holds the whole
    gradient of this backward; setting ``p.grad = None`` there releases the device memory at
    once, so the device never holds all gradients together.

    Returns:
        The hook handles (``handle.remove()`` detaches one); frozen parameters get none.

    Raises:
        ValueError: a different number of slots, or a slot of the wrong shape or dtype.
    """
    params = list(params)
    slots = list(slots)
    if len(params) != len(slots):
        raise ValueError(f"{len(params)} params but {len(slots)} slots; give one slot per parameter")
    handles = []
    for p, slot in zip(params, slots):
        if slot.shape != p.shape or slot.dtype != torch.float32:
            raise ValueError(f"slot of shape {tuple(slot.shape)} and dtype {slot.dtype} for a parameter of shape "
                             f"{tuple(p.shape)}: slots must be float32 with the parameter's shape")

        def hook(param: torch.Tensor, slot: torch.Tensor = slot) -> None:
            slot.add_(param.grad)  # float32 += grad (cast up on the fly)
            param.grad = None

        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles


# ----------------------------------------------------------------------------- layer streaming
class StreamedSequential(nn.Module):
    """Inference through ``layers`` whose weights live on the host, streamed to ``device`` one layer at a time.

    While layer ``k`` computes, layer ``k+1``'s weights are already being copied on a side CUDA
    stream (prefetch), so the device holds at most two layers' weights. The idea behind
    accelerate's ``device_map`` with offloaded modules. On CPU host == device and the copies
    are plain clones, so the same code runs (and is tested) everywhere.

    Args:
        layers: the modules, run in order (their weights move to host memory).
        device: where each layer computes; None is CUDA when present, else the CPU.
        prefetch: copy layer ``k+1`` while layer ``k`` computes.
        pin_memory: page-lock the host copies; None pins them for a CUDA device.

    Raises:
        ValueError: no layers, a layer that is not an ``nn.Module``, or a CUDA device without CUDA.
    """

    def __init__(self, layers: Sequence[nn.Module], device: torch.device | str | None = None, *,
                 prefetch: bool = True, pin_memory: bool | None = None) -> None:
        super().__init__()
        layers = list(layers)
        if not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise invalid("layers", [type(m).__name__ for m in layers], "a non-empty sequence of nn.Module")
        self.layers = nn.ModuleList(layers)
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise invalid("device", device, "a device this machine has (torch.cuda.is_available() is False)")
        self.prefetch = prefetch
        pin = pin_memory if pin_memory is not None else self.device.type == "cuda"
        self._host: list[list[torch.Tensor]] = []
        with torch.no_grad():
            for m in self.layers:
                tensors = []
                for t in self._tensors(m):
                    h = t.data.to("cpu")
                    if pin:
                        h = h.pin_memory()
                    t.data = h
                    tensors.append(h)
                self._host.append(tensors)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.max_resident_layers = 0

    @staticmethod
    def _tensors(m: nn.Module) -> list[torch.Tensor]:
        return list(m.parameters()) + list(m.buffers())

    def _fetch(self, k: int) -> tuple[list[torch.Tensor], Any]:
        # start copying layer k to the device; return the device tensors and an event (CUDA)
        if self._stream is None:
            return [h.to(self.device, copy=True) for h in self._host[k]], None
        with torch.cuda.stream(self._stream):
            dev = [h.to(self.device, non_blocking=True) for h in self._host[k]]
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return dev, ev

    @torch.no_grad()
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run the layers in order, each with its weights on the device only while it runs; ``args`` and
        ``kwargs`` go to every layer. Returns the last layer's output (the first element when a layer
        returns a tuple)."""
        n = len(self.layers)
        nxt = self._fetch(0)
        resident = 0
        for k, layer in enumerate(self.layers):
            dev, ev = nxt
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
                for t in dev:
                    t.record_stream(torch.cuda.current_stream(self.device))
            if self.prefetch and k + 1 < n:
                nxt = self._fetch(k + 1)
                resident = 2
            else:
                resident = max(resident, 1)
            tensors = self._tensors(layer)
            for t, d in zip(tensors, dev):
                t.data = d
            out = layer(x, *args, **kwargs)
            x = out[0] if isinstance(out, tuple) else out
            for t, h in zip(tensors, self._host[k]):
                t.data = h
            del dev
            if not self.prefetch and k + 1 < n:
                nxt = self._fetch(k + 1)
            self.max_resident_layers = max(self.max_resident_layers, resident)
        return x
