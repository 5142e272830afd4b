"""The tracker's hooks outside the dispatcher: the optimizer step (the ``optimizer`` phase and its
state), gradient accumulation (the ``gradients`` category) and ``UntypedStorage.resize_``."""
from __future__ import annotations

import torch

from memlab.profiler.storage import _A, _BWD, _FWD, _G, _O, _OPT, _OTH, _X, optimizer_tensors


class _StepHooks:
    """A mixin of :class:`~memlab.profiler.MemoryTracker`: installs the hooks its ``__enter__``
    needs (it reads and updates the tracker's private state)."""

    def _install_hooks(self) -> None:
        """The optimizer step's global pre/post hooks, the model's module hooks and a post-accumulate
        hook on every trainable parameter; their handles go to ``self._handles``."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def opt_pre(optimizer, args, kwargs):
            self._in_opt += 1
            self._opt_before = {k for k, e in list(self._live.items()) if e.cat == _O}
            if self._phase != _OPT:
                self._set_phase(_OPT)

        def opt_post(optimizer, args, kwargs):
            self._in_opt -= 1
            if optimizer is self.optimizer or self.optimizer is None:
                self._track_optimizer(optimizer)
                # what the step allocated and still holds outside optimizer.state is not state
                state = {t.untyped_storage()._cdata for t in optimizer_tensors(optimizer)}
                for key, e in list(self._live.items()):  # a list: a weakref callback may fire meanwhile
                    if e.cat == _O and key not in state and key not in self._opt_before:
                        self._cur[_O] -= e.nbytes
                        self._cur[_X] += e.nbytes
                        e.cat = _X
                        self._dirty = True
                self._after_op()
            if not self._in_opt:
                self._set_phase(_OTH)

        self._handles += [register_optimizer_step_pre_hook(opt_pre), register_optimizer_step_post_hook(opt_post)]
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        if self.model is not None:
            self._handles += self._install_module_hooks(self.model)
            params.extend(self.model.parameters())
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                params.extend(p for p in group["params"] if isinstance(p, torch.Tensor))

        def on_grad(p: torch.Tensor) -> None:
            if p.grad is not None:
                self._track(p.grad, _G, relabel=True)

        for p in params:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            self._handles.append(p.register_post_accumulate_grad_hook(on_grad))

    def _watch_resize(self) -> None:
        """Wrap ``torch.UntypedStorage.resize_`` while the tracker is entered (``resizes=True``)."""
        # UntypedStorage.resize_ is a storage method, not an op: no dispatch mode sees it
        orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):  # type: ignore[no-untyped-def]
            old = st.nbytes()
            out = orig(st, size)
            if tracker._depth:
                tracker._on_resize(st, old)
            return out

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    def _on_resize(self, st: torch.UntypedStorage, old: int) -> None:
        """``UntypedStorage.resize_`` ran (with ``resizes``): charge the change now."""
        key = st._cdata
        e = self._live.get(key)
        if e is not None and e.ref() is st:
            self._resize_entry(e, st.nbytes())
            return
        dev = st.device.type
        if self._device_type is not None and dev != self._device_type:
            return
        cat = _O if self._in_opt else (_A if self._phase in (_FWD, _BWD) else _X)
        self._new_entry(st, key, dev, cat, self.allocated_bytes(old, dev))
