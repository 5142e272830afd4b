"""OffloadedAdamW: AdamW with fp32 master weights and moments in host memory, stepped on the CPU.

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
ATC): of the 16 bytes per parameter of mixed-precision AdamW, the 12 that only the optimizer step
reads (fp32 master and two moments) live on the host; gradients stream there during backward, the
CPU steps, and the updated 16-bit weights are copied back.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Iterable

import torch

from memlab.core.validation import check_bool, check_choice, check_positive_int, invalid
from memlab.offload.kernel import adamw_step_flat_
from memlab.offload.transfer import HostTransfer
from memlab.offload.update import FlatBuffer, adamw_step_, check_hparams, pack

__all__ = ["OffloadedAdamW"]


def _check_modes(overlap: bool, offload_gradients: bool, step_in_backward: bool, delay_update: bool,
                 grad_scaler: Any) -> None:
    # the option combinations that cannot work, each refused with the reason
    if step_in_backward and not (overlap or offload_gradients):
        raise ValueError("step_in_backward=True needs overlap=True: the update starts from the gradient hook")
    if step_in_backward and delay_update:
        raise ValueError("step_in_backward=True and delay_update=True: pick one way to overlap the CPU update "
                         "(during this backward, or during the next step's forward and backward)")
    if step_in_backward and grad_scaler is not None:
        raise ValueError("step_in_backward=True with grad_scaler: each parameter is updated during backward, before "
                         "the scaler could check every gradient for inf/NaN; use step_in_backward=False with a scaler")
    if grad_scaler is not None and not hasattr(grad_scaler, "_per_optimizer_states"):
        raise invalid("grad_scaler", type(grad_scaler).__name__,
                      "torch.amp.GradScaler or memlab.amp.DynamicLossScaler")


def _grad_hook(opt: OffloadedAdamW) -> Any:
    # the post-accumulate-grad hook of opt, holding it by a weak reference so that it does not keep it alive
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        o = ref()
        if o is not None:
            o._on_grad(p)

    return hook


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in host memory and the step on the CPU (ZeRO-Offload).

    Host (pinned when the parameters are on CUDA), per param group, flat fp32 buffers with a view
    per parameter: ``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``. Device: the model's
    parameters in their own dtype, and their gradients unless ``offload_gradients=True``.

    What crosses between device and host, per optimizer step of ``accumulation_steps`` micro-batches:

    * gradients, device to host, in the parameters' dtype: once per step (after the last
      micro-batch; the earlier ones accumulate in ``p.grad`` on the device), or every micro-batch
      with ``offload_gradients=True`` (the device gradient is freed at once and the micro-batches
      are summed on the host in fp32);
    * updated weights, host to device, in the parameters' dtype (cast on the host), once per step.

    :attr:`traffic` counts both (bytes and copies) since construction. The copies are made by a
    :class:`~memlab.offload.transfer.HostTransfer` the optimizer holds.

    * ``overlap=True``: a post-accumulate-grad hook sends each gradient to the host as soon as
      backward has finished it, on a side CUDA stream, so backward goes on meanwhile.
    * ``step_in_backward=True`` (needs ``overlap``): a worker thread updates each parameter on the
      CPU as soon as its gradient has arrived, in arrival order, while backward computes the rest;
      :meth:`step` only waits for the last updates. The parameters change during backward, before
      anything could look at all the gradients together: no gradient clipping and no loss scaler
      with it (both raise, saying why).
    * :meth:`step` (without ``step_in_backward``) steps every parameter on the CPU after backward.
    * ``delay_update=True``: DeepSpeed's one-step delayed parameter update (ZeRO-Offload paper, sec.
      4.2): :meth:`step` hands this step's update to the worker thread and returns; the device runs
      the next step's forward and backward on the weights it has while the CPU steps, and the
      result reaches the device at the next :meth:`step` (call :meth:`flush` after the last one).
      Every gradient is then computed on weights one update old: a different trajectory, traded for
      a CPU step that hides behind a whole step instead of the tail of backward. A second fp32
      gradient buffer (4 host bytes per parameter) holds the step's gradients while the hooks fill
      the other.
    * A loss scaler (``torch.amp.GradScaler`` or :class:`memlab.amp.DynamicLossScaler`) works:
      the optimizer unscales the host gradients itself and skips the step on inf/NaN. With
      ``offload_gradients=True`` the scaler finds no ``.grad`` on the device, so pass it as
      ``grad_scaler=`` for the optimizer to report its inf check back to it.
    * :meth:`clip_grad_norm_` clips the host gradients like ``torch.nn.utils.clip_grad_norm_``.

    ``kernel="fast"`` (default) steps with :func:`adamw_step_flat_`, which rounds like torch's
    fused CPU AdamW; ``kernel="exact"`` steps each parameter with :func:`adamw_step_`, so that
    with fp32 parameters on a CPU the trajectory is bitwise that of
    ``torch.optim.AdamW(foreach=False)`` (slower: one call per parameter). On a CPU-only machine host == device
    and the same code runs; there the one gradient copy per step is made in :meth:`step` (nothing
    to hide behind backward) unless ``step_in_backward`` needs it from the hook.

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``; all on one device.
        pin_memory: page-lock the host buffers; None pins them when the parameters are on CUDA.
        accumulation_steps: micro-batches (backward passes) per :meth:`step`.

    Raises:
        ValueError: a bad hyper-parameter or flag, or options that cannot work together (the message says why).
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf and lets step() decide

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, pin_memory: bool | None = None,
                 overlap: bool = True, offload_gradients: bool = False, kernel: str = "fast",
                 accumulation_steps: int = 1, step_in_backward: bool = False, grad_scaler: Any = None,
                 delay_update: bool = False) -> None:
        self.kernel = check_choice("kernel", kernel, ("fast", "exact"))
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise invalid("betas", betas, "a pair (beta1, beta2)")
        check_hparams(lr, betas[0], betas[1], eps, weight_decay)
        for name, flag in (("overlap", overlap), ("offload_gradients", offload_gradients),
                           ("step_in_backward", step_in_backward), ("delay_update", delay_update)):
            check_bool(name, flag)
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise invalid("pin_memory", pin_memory, "None (pin when CUDA is present), True or False")
        check_positive_int("accumulation_steps", accumulation_steps)
        _check_modes(overlap, offload_gradients, step_in_backward, delay_update, grad_scaler)
        self.overlap, self.offload_gradients = overlap, offload_gradients
        self.accumulation_steps, self.step_in_backward = accumulation_steps, step_in_backward
        self.grad_scaler = grad_scaler
        self.delay_update = delay_update
        self._delayed: list[tuple[int, int]] = []  # (group, index): updated on the host, not yet copied back
        self._pin_arg = pin_memory
        self._flats: list[dict[str, Any]] = []
        self._hooks: list[Any] = []
        self._device: torch.device | None = None
        self._transfer: HostTransfer | None = None  # made with the first param group, once the device is known
        self._reset_runtime()
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _reset_runtime(self) -> None:
        # per-parameter bookkeeping, keyed by parameter (rebuilt after deepcopy / unpickling)
        self._slot: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (group index, index in group)
        self._count: dict[torch.Tensor, int] = {}  # backward passes that finished p's gradient this step
        self._stepped: dict[torch.Tensor, bool] = {}  # updated by the worker during this backward
        self._unscaled_found: torch.Tensor | None = None  # host grads already unscaled (clip under a scaler)
        self._queue: Any = None
        self._worker: Any = None
        self._worker_error: BaseException | None = None
        self._cycle_open = False
        self.timeline: list[tuple[str, int, int, float]] = []  # (event, group, index, perf_counter) this step

    # -- set-up
    @property
    def cuda(self) -> bool:
        """Whether the parameters live on a CUDA device (host and device are then different memories)."""
        return self._device is not None and self._device.type == "cuda"

    @property
    def traffic(self) -> dict[str, int]:
        """Bytes and copies moved since construction: ``to_host_bytes``, ``to_host_copies``,
        ``to_device_bytes``, ``to_device_copies``."""
        return self._transfer.traffic

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (``{"params": [...], **hyper-parameters}``) and make its host buffers
        (master copy, gradient slots, moments).

        Raises:
            ValueError: a bad hyper-parameter, a non-floating-point parameter, or parameters on two devices.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_hparams(group["lr"], group["betas"][0], group["betas"][1], group["eps"], group["weight_decay"])
        params = group["params"]
        for p in params:
            if not p.is_floating_point():
                raise ValueError(f"a parameter of dtype {p.dtype}: OffloadedAdamW needs floating-point parameters")
            if self._device is None:
                self._device = p.device
            elif p.device != self._device:
                raise ValueError(f"parameters on {self._device} and {p.device}: put them all on one device")
        pin = self._pin_arg if self._pin_arg is not None else (self.cuda and torch.cuda.is_available())
        bufs: dict[str, Any] = {
            "master": pack(params, pin_memory=pin),
            "grad": FlatBuffer([p.shape for p in params], pin_memory=pin),
            "exp_avg": FlatBuffer([p.shape for p in params], pin_memory=pin),
            "exp_avg_sq": FlatBuffer([p.shape for p in params], pin_memory=pin),
        }
        if self._transfer is None:
            self._transfer = HostTransfer(self._device, pin, self.offload_gradients)
        self._flats.append(bufs)
        for i, p in enumerate(params):
            st = self.state[p]
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = bufs["exp_avg"].views[i]
            st["exp_avg_sq"] = bufs["exp_avg_sq"].views[i]
            st["master"] = bufs["master"].views[i]
        self._attach(len(self._flats) - 1)

    def _attach(self, gi: int) -> None:
        # bookkeeping, staging and gradient hooks for param group gi
        for i, p in enumerate(self.param_groups[gi]["params"]):
            self._slot[p] = (gi, i)
            self._transfer.add(p)
            self._count[p] = 0
            self._stepped[p] = False
            if p.requires_grad and (self.overlap or self.offload_gradients):
                self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(self)))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (the optimizer then gathers grads in step())."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- gradients to the host, from the post-accumulate-grad hook
    def _host_grad(self, p: torch.Tensor) -> torch.Tensor:
        gi, i = self._slot[p]
        return self._flats[gi]["grad"].views[i]

    def _log(self, what: str, p: torch.Tensor) -> None:
        gi, i = self._slot[p]
        self.timeline.append((what, gi, i, time.perf_counter()))

    def _on_grad(self, p: torch.Tensor) -> None:
        # the hook: send p.grad to the host when it is final for this step (every micro-batch if offloading)
        if p.grad is None:
            return
        if not self._cycle_open:
            self.timeline = []
            self._cycle_open = True
        self._count[p] += 1
        self._log("grad", p)
        if self.offload_gradients:
            self._transfer.send(p, self._host_grad(p))  # every micro-batch: the device keeps no gradient
        elif self._count[p] == self.accumulation_steps:
            if not self.cuda and not self.step_in_backward:
                return  # host == device: nothing to hide, step() makes the one copy (the tracker sees it there)
            self._transfer.send(p, self._host_grad(p))  # the last micro-batch: the sum autograd accumulated
        elif self._count[p] > self.accumulation_steps:
            self._transfer.forget(p)  # more micro-batches than declared: step() copies again
            return
        else:
            return
        if self.step_in_backward and self._count[p] == self.accumulation_steps:
            self._start_worker()
            self._queue.put(p)

    def _gather(self, p: torch.Tensor) -> bool:
        return self._transfer.gather(p, self._host_grad(p))

    # -- copies: pickling and deepcopy keep the buffers and rebuild hooks, streams and the worker
    def __getstate__(self) -> dict[str, Any]:
        self._drain()
        skip = {"_hooks", "_slot", "_count", "_stepped", "_unscaled_found", "_queue", "_worker", "_worker_error",
                "_cycle_open", "timeline"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._hooks = []
        self._reset_runtime()
        for gi, bufs in enumerate(self._flats):
            for i, p in enumerate(self.param_groups[gi]["params"]):
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    self.state[p][k] = bufs[k].views[i]  # the state is the buffers' views again (pickle split them)
            self._attach(gi)

    # -- the update, one parameter (worker thread) or a whole group
    def _hp(self, group: dict[str, Any]) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _update_one(self, p: torch.Tensor, grad: FlatBuffer | None = None, copy_back: bool = True) -> None:
        gi, i = self._slot[p]
        bufs = self._flats[gi]
        grad = grad if grad is not None else bufs["grad"]
        st = self.state[p]
        st["step"] += 1
        update = adamw_step_flat_ if self.kernel == "fast" else adamw_step_
        update(bufs["master"].views[i], grad.views[i], bufs["exp_avg"].views[i], bufs["exp_avg_sq"].views[i],
               int(st["step"].item()), **self._hp(self.param_groups[gi]))
        if copy_back:
            self._transfer.copy_back(p, bufs["master"].views[i])

    def _apply(self, todo: list[tuple[int, list[int]]], grads: list[FlatBuffer], copy_back: bool) -> None:
        # step the parameters todo lists, group by group, from the gradient buffers grads
        for (gi, idx), grad in zip(todo, grads):
            group = self.param_groups[gi]
            params = group["params"]
            bufs = self._flats[gi]
            steps = {int(self.state[params[i]]["step"].item()) for i in idx}
            if not self.cuda and self.kernel == "fast" and len(idx) == len(params) and len(steps) == 1 and idx:
                # CPU, every grad on the host: one fast call over the whole group
                for p in params:
                    self.state[p]["step"] += 1
                adamw_step_flat_(bufs["master"].flat, grad.flat, bufs["exp_avg"].flat, bufs["exp_avg_sq"].flat,
                                 steps.pop() + 1, **self._hp(group))
                if copy_back:
                    for i in idx:
                        self._transfer.copy_back(params[i], bufs["master"].views[i])
            else:
                for i in idx:
                    self._update_one(params[i], grad, copy_back)

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
                    self._transfer.fold(p, self._host_grad(p))
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
        # wait until the worker has finished every update it was given; raise its error
        if self._queue is not None:
            self._queue.join()
        if self._worker_error is not None:
            exc, self._worker_error = self._worker_error, None
            raise RuntimeError(f"OffloadedAdamW: a parameter update in the worker thread failed: {exc!r}") from exc

    def _copy_back_delayed(self) -> None:
        self._drain()
        if self._delayed:
            self._transfer.wait_for_compute()  # backward has read the old weights
        for gi, i in self._delayed:
            self._transfer.copy_back(self.param_groups[gi]["params"][i], self._flats[gi]["master"].views[i])
        self._delayed = []

    # -- clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the host gradients so their global norm is at most ``max_norm``; return the norm before.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_(foreach=False)``: the norm of the
        per-tensor norms, then ``g *= min(1, max_norm / (total + 1e-6))``.

        ``max_norm`` > 0 (inf: measure, clip nothing); ``norm_type`` 2.0 only. The norm is a 0-d tensor.

        Raises:
            ValueError: a bad ``max_norm`` or ``norm_type``.
            RuntimeError: with ``step_in_backward`` (the parameters were already updated).
        """
        # not check_number: max_norm=inf (measure the norm, clip nothing) is a common use
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise invalid("max_norm", max_norm, "a number > 0 (inf: clip nothing)")
        if norm_type != 2.0:
            raise invalid("norm_type", norm_type, "2.0")
        if self.step_in_backward:
            raise RuntimeError("clip_grad_norm_ with step_in_backward=True: the parameters were already updated during "
                               "backward, before the global norm of all gradients was known; use step_in_backward=False")
        grads = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if self._gather(p):
                    grads.append(self._flats[gi]["grad"].views[i])
        if self.offload_gradients and self.grad_scaler is not None and self._unscaled_found is None:
            # the scaler's unscale_ found no .grad on the device: the host grads are still scaled
            self._unscaled_found = self._unscale_host(grads)
        if not grads:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    # -- loss scaling
    def _unscale_host(self, host_grads: list[torch.Tensor]) -> torch.Tensor:
        # offloaded gradients under the attached scaler: unscale the host grads, report the inf check to the scaler
        scale = self.grad_scaler._scale
        found = torch.zeros((), dtype=torch.float32)
        if scale is not None and host_grads:
            inv = scale.double().reciprocal().float().cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(host_grads, found, inv)
        dev = scale.device if scale is not None else torch.device("cpu")
        self.grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {dev: found.to(dev)}
        return found

    def _unscale(self, host_grads: list[torch.Tensor]) -> bool:
        # under a loss scaler: unscale the host gradients in place; True when the step must be skipped
        scaler_found = getattr(self, "found_inf", 0)
        if self.offload_gradients:
            if self.grad_scaler is None:
                raise RuntimeError(
                    "OffloadedAdamW(offload_gradients=True) under a loss scaler: the gradients left the device during "
                    "backward, so the scaler finds no .grad to check for inf/NaN and its update() would fail ('No inf "
                    "checks were recorded'). Pass the scaler to the optimizer: OffloadedAdamW(..., grad_scaler=scaler)")
            if self._unscaled_found is None:  # the host grads are still scaled whatever the scaler's stage says
                self._unscaled_found = self._unscale_host(host_grads)
            return bool(self._unscaled_found.item())
        grad_scale = getattr(self, "grad_scale", None)
        found = torch.zeros((), dtype=torch.float32)
        if grad_scale is not None and host_grads:
            inv = grad_scale.double().reciprocal().float().cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(host_grads, found, inv)
        return bool(found.item()) or bool(float(scaler_found))

    # -- the step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Update every parameter that has a gradient (or, with ``delay_update``, start that update).

        Returns the closure's loss (as ``torch.optim.Optimizer``), or None.

        Raises:
            RuntimeError: with ``step_in_backward``, under a loss scaler or after a number of
                backward passes other than ``accumulation_steps``; or an update on the worker failed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaled = hasattr(self, "found_inf")  # a GradScaler / DynamicLossScaler is calling us
        if self.step_in_backward:
            self._drain()
            if scaled:
                raise RuntimeError("OffloadedAdamW(step_in_backward=True) under a loss scaler: each parameter was "
                                   "updated during backward with its still-scaled gradient, before the scaler could "
                                   "check for inf/NaN; use step_in_backward=False with a scaler")
            wrong = {self._count[p] for g in self.param_groups for p in g["params"] if self._stepped[p]} - {self.accumulation_steps}
            if wrong:
                raise RuntimeError(f"OffloadedAdamW(step_in_backward=True, accumulation_steps={self.accumulation_steps}): "
                                   f"a parameter got {sorted(wrong)} backward passes this step; the update ran after "
                                   f"micro-batch {self.accumulation_steps}, so call step() after exactly that many")
        if self.delay_update:
            self._copy_back_delayed()  # the previous step's update, computed during this step's forward/backward
        self._transfer.wait_staging_free()  # last step's copies back have left the staging buffers
        todo: list[tuple[int, list[int]]] = []
        host_grads = []
        for gi, group in enumerate(self.param_groups):
            idx = []
            for i, p in enumerate(group["params"]):
                if self._stepped[p]:
                    continue
                if self._gather(p):
                    idx.append(i)
                    host_grads.append(self._flats[gi]["grad"].views[i])
            todo.append((gi, idx))
        if scaled and self._unscale(host_grads):
            self._end_cycle()  # inf/NaN: skip the update, as GradScaler does
            return loss
        if not self.delay_update:
            self._apply(todo, [self._flats[gi]["grad"] for gi, _ in todo], copy_back=True)
        else:
            # one-step delayed update: the CPU steps on this step's gradients while the device runs the next
            # step's forward and backward on the weights it has; the result reaches the device at the next step()
            grads = []
            for gi, _ in todo:
                bufs = self._flats[gi]
                if "grad_next" not in bufs:
                    bufs["grad_next"] = FlatBuffer(bufs["grad"].shapes, pin_memory=bufs["grad"].flat.is_pinned())
                bufs["grad"], bufs["grad_next"] = bufs["grad_next"], bufs["grad"]  # the hooks fill the other one
                grads.append(bufs["grad_next"])
            self._delayed = [(gi, i) for gi, idx in todo for i in idx]
            self._start_worker()
            self._queue.put(lambda: self._apply(todo, grads, copy_back=False))
        self._transfer.end_copies_back()  # the next forward reads the weights
        self._end_cycle()
        return loss

    def extra_state_tensors(self) -> list[torch.Tensor]:
        """The host buffers kept outside ``self.state``, each once: the fp32 gradient slots (two with
        ``delay_update``) and, on CUDA, the pinned staging copies. ``memlab.profiler.MemoryTracker``
        counts them as optimizer memory (they are made with the optimizer, before any tracked step).
        """
        out: list[torch.Tensor] = []
        for bufs in self._flats:
            out += [bufs[k].flat for k in ("grad", "grad_next") if k in bufs]
        return out + self._transfer.staging()

    @torch.no_grad()
    def flush(self) -> None:
        """``delay_update=True``: wait for the update still running and copy its weights to the model (end of training)."""
        self._copy_back_delayed()
        self._transfer.end_copies_back()

    def _end_cycle(self) -> None:
        self._unscaled_found = None
        for p in self._count:
            self._count[p] = 0
            self._stepped[p] = False
        self._transfer.reset()
        self._cycle_open = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients (``set_to_none``: ``p.grad = None``) and this step's bookkeeping, waiting for
        updates running during backward."""
        if self.step_in_backward:
            self._drain()  # (a delayed update keeps running: it reads its own gradient buffer)
        super().zero_grad(set_to_none=set_to_none)
        self._end_cycle()

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Like torch's: ``{"state": {index: {step, exp_avg, exp_avg_sq, master}}, "param_groups": [...]}``.

        The tensors are the live host views (as torch returns live tensors); ``copy.deepcopy`` or
        ``torch.save`` them to keep a snapshot.
        """
        self._drain()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyper-parameters, steps, moments and master weights from :meth:`state_dict` (and copy
        the masters to the model).

        Raises:
            ValueError: not a dict with ``"state"`` and ``"param_groups"``.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise invalid("state_dict", state_dict, "a dict with 'state' and 'param_groups' (from OffloadedAdamW.state_dict())")
        self._drain()
        self._delayed = []  # the masters below replace whatever update was in flight
        saved = state_dict["state"]
        views = {id(p): {k: self.state[p][k] for k in ("exp_avg", "exp_avg_sq", "master")}
                 for g in self.param_groups for p in g["params"]}
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        index = 0
        with torch.no_grad():
            for gi, group in enumerate(self.param_groups):
                for i, p in enumerate(group["params"]):
                    st = self.state[p]
                    st.update(views[id(p)])
                    src = saved.get(index, saved.get(str(index), {}))
                    st["step"] = torch.tensor(float(src["step"])) if "step" in src else torch.tensor(0.0)
                    for k in ("exp_avg", "exp_avg_sq", "master"):
                        if k in src:
                            st[k].copy_(src[k])
                    if "master" in src:
                        p.data.copy_(st["master"])
                    index += 1
