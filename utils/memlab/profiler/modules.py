"""Which module is running: forward hooks push and pop module frames; in backward, the module whose
output gradient arrived last is running (with its parents) until the next one starts.

Backward attribution is by output-gradient arrival
(``torch.autograd.graph.register_multi_grad_hook(mode="any")`` on each module's outputs), exact for
sequential models and approximate where modules interleave.
"""
from __future__ import annotations

import torch

from memlab.profiler.storage import _FWD, tensors_in

_graph_task_id = torch._C._current_graph_task_id


class _ModuleFrames:
    """The module-attribution half of :class:`~memlab.profiler.MemoryTracker` (a mixin: it reads the
    tracker's ``_total``, ``_phase``, ``_in_opt``, ``_depth`` and ``_set_phase``).

    A frame is ``[qualified name, max total while active, is_backward_frame]``.
    """

    def _init_frames(self) -> None:
        self._stack: list[list] = []
        self._module_peaks: dict[str, int] = {}

    @property
    def module_peaks(self) -> dict[str, int]:
        """Qualified module name -> peak total bytes seen while it ran (forward or backward)."""
        peaks = dict(self._module_peaks)
        for name, peak, _ in self._stack:  # still running (inside the block)
            peaks[name] = max(peaks.get(name, 0), peak)
        return dict(sorted(peaks.items(), key=lambda kv: (-kv[1], kv[0])))

    def _install_module_hooks(self, model: torch.nn.Module) -> list:
        """Forward pre/post hooks on every submodule; returns their handles."""
        handles = []
        for name, mod in model.named_modules():
            handles.append(mod.register_forward_pre_hook(self._pre_forward(name)))
            handles.append(mod.register_forward_hook(self._post_forward(name), always_call=True))
        return handles

    def _push(self, name: str, backward: bool = False) -> None:
        self._stack.append([name, self._total, backward])

    def _pop_frame(self) -> None:
        name, peak, _ = self._stack.pop()
        if peak > self._module_peaks.get(name, -1):
            self._module_peaks[name] = peak
        if self._stack and peak > self._stack[-1][1]:
            self._stack[-1][1] = peak

    def _pop_to(self, depth: int, backward_only: bool = False) -> None:
        while len(self._stack) > depth and (not backward_only or self._stack[-1][2]):
            self._pop_frame()

    def _pre_forward(self, name: str):
        def hook(module, args):
            if name == "" and _graph_task_id() == -1 and not self._in_opt and self._phase != _FWD:
                self._set_phase(_FWD)
            self._push(name)

        return hook

    def _post_forward(self, name: str):
        def hook(module, args, output):
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i][0] == name and not self._stack[i][2]:
                    self._pop_to(i)
                    break
            if torch.is_grad_enabled() and _graph_task_id() == -1:
                ts = [t for t in tensors_in(output) if t.requires_grad]
                if ts:
                    torch.autograd.graph.register_multi_grad_hook(ts, self._pre_backward(name), mode="any")

        return hook

    def _pre_backward(self, name: str):
        chain = [name] if name == "" else [""] + [".".join(name.split(".")[: i + 1]) for i in range(name.count(".") + 1)]

        def hook(grad):
            if self._depth == 0:
                return
            # keep the longest common prefix of the backward frames, push the rest of the chain
            base = 0
            while base < len(self._stack) and not self._stack[base][2]:
                base += 1
            i = 0
            while i < len(chain) and base + i < len(self._stack) and self._stack[base + i][0] == chain[i]:
                i += 1
            self._pop_to(base + i)
            for n in chain[i:]:
                self._push(n, backward=True)

        return hook
