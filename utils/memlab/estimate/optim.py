"""The optimizers a traced step runs: torch's AdamW / SGD in each implementation, bitsandbytes'
AdamW8bit (or its documented state layout when it does not import), and the device side of
:class:`memlab.offload.OffloadedAdamW` with its host bytes counted."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Sequence

import torch
from torch import nn

from memlab.core import vocab
from memlab.core.validation import check_choice
from memlab.core.vocab import Recipe
from memlab.estimate.recipes import BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE, BNB_MIN_PAGED_SIZE, OPTIMIZER_IMPLS
from memlab.estimate.step import StepSpec


def import_bitsandbytes():
    """bitsandbytes, imported without its warning about optional CPU kernels (ImportError and the like if absent)."""
    import io

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        import bitsandbytes  # noqa: F401  (prints a warning about optional CPU kernels)
    return bitsandbytes


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes can be imported, asked without importing it (``importlib.util.find_spec``: a
    millisecond, where the import takes about 2 s). A fake trace of 8-bit AdamW needs only its state layout
    (:class:`AdamW8bitLayout`), so it imports nothing."""
    import importlib.util

    try:
        return importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken install
        return False


# bitsandbytes' dynamic quantization maps (functional.create_dynamic_map, signed and unsigned): 256 fp32 values each
_QMAP_SIZE = 256


class AdamW8bitLayout(torch.optim.Optimizer):
    """bitsandbytes' ``AdamW8bit`` as a fake trace sees it, without importing bitsandbytes: the same keywords
    (refused as it refuses them), the same state tensors made in the same order in the first ``step()``, and an
    update that allocates nothing (its update kernel is fused: in place on the state; on fake tensors only the
    shapes exist). For fake traces only: it does not update the weights.

    The layout, per trainable parameter of ``n`` elements, in ``Optimizer2State.init_state``'s order (bitsandbytes
    0.45-0.50, ``optim/optimizer.py``): ``step`` (an int); below :data:`BNB_MIN_8BIT_SIZE` elements two fp32
    moments ``state1``, ``state2`` shaped as the parameter; from it on ``state1`` (uint8, the parameter's
    shape), ``qmap1`` (the signed dynamic map, 256 fp32, made once per optimizer and shared), ``state2`` (uint8),
    ``qmap2`` (the unsigned map), ``absmax1`` and ``absmax2`` (fp32, one per block of :data:`BNB_BLOCKSIZE`).
    ``tests/ch01/test_estimate_speed_paths.py`` checks it against bitsandbytes' own optimizer, state by state and
    estimate by estimate, to the byte.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, optim_bits: int = 32, args: Any = None,
                 min_8bit_size: int = BNB_MIN_8BIT_SIZE, is_paged: bool = False) -> None:
        if amsgrad:
            raise ValueError("AdamW8bit does not support amsgrad=True")
        if optim_bits != 32:
            raise ValueError("AdamW8bit only supports optim_bits=32 (default value for compatibility)")
        if is_paged:
            raise ValueError("is_paged=True is invalid for the 8-bit AdamW layout; allowed: optimizer='paged-adamw8bit'")
        if args is not None:
            raise ValueError("args is invalid for the 8-bit AdamW layout of a fake trace; allowed: None")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.min_8bit_size = min_8bit_size
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32, device=p.device)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32, device=p.device)
            return
        if self._qmaps is None:  # made once per optimizer, on the first 8-bit parameter's device
            self._qmaps = (torch.zeros(_QMAP_SIZE, dtype=torch.float32), torch.zeros(_QMAP_SIZE, dtype=torch.float32))
        self._qmaps = (self._qmaps[0].to(p.device), self._qmaps[1].to(p.device))
        blocks = -(-p.numel() // BNB_BLOCKSIZE)
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8, device=p.device)
        state["qmap1"] = self._qmaps[0]
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8, device=p.device)
        state["qmap2"] = self._qmaps[1]
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if len(self.state[p]) == 0:
                    self._init_state(p)
                state = self.state[p]
                state["step"] += 1
                # bitsandbytes' fused update is one op per parameter that writes its state in place and allocates
                # nothing: one such op here too (a step of the tracked timeline, as its kernel is one)
                state["state1"].add_(0)
        return loss


def _resolve_impl(impl: str, device: str) -> str:
    if impl == "auto":
        return "foreach" if torch.device(device).type == "cuda" else "for-loop"
    return impl


def make_optimizer(
    name: str, params: Any, *, impl: str = "auto", device: str = "cpu", fake: bool = False, **kwargs: Any
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params``, given its hyper-parameters ``kwargs``.

    Args:
        name: one of :data:`memlab.estimate.OPTIMIZERS`, any spelling (``"adam8bit"``).
        impl: torch's implementation: "auto" is what ``torch.optim.AdamW(params)`` picks on
            ``device`` (foreach on CUDA, the for-loop on CPU), or "for-loop" / "foreach" / "fused".
        fake: for a fake trace: ``"adamw8bit"`` is :class:`AdamW8bitLayout` (bitsandbytes' state, to the byte,
            without importing it); otherwise bitsandbytes' own ``AdamW8bit``.

    Raises:
        ValueError: an unknown ``name`` or ``impl``.
    """
    name = vocab.canonical_optimizer(name)
    check_choice("optimizer_impl", impl, OPTIMIZER_IMPLS)
    params = list(params)
    if name == "adamw8bit":
        return AdamW8bitLayout(params, **kwargs) if fake else import_bitsandbytes().optim.AdamW8bit(params, **kwargs)
    if name in ("paged-adamw32bit", "paged-adamw8bit"):
        bnb = import_bitsandbytes().optim
        return (bnb.PagedAdamW32bit if name == "paged-adamw32bit" else bnb.PagedAdamW8bit)(params, **kwargs)
    if name == "offload-adamw":
        from memlab.offload import OffloadedAdamW

        return OffloadedAdamW(params, **kwargs)
    impl = _resolve_impl(impl, device)
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    if name == "adamw":
        return torch.optim.AdamW(params, **{**flags, **kwargs})
    if impl == "fused":
        flags = dict(foreach=False)  # SGD without momentum: fused buys nothing
    return torch.optim.SGD(params, lr=kwargs.pop("lr", 1e-3), **{**flags, **kwargs})


class _OffloadDeviceSide(torch.optim.Optimizer):
    """What :class:`memlab.offload.OffloadedAdamW` does on the device, for a fake trace: nothing is
    allocated there. Gradients stay on the device until the step (or, with ``offload_gradients``,
    a post-accumulate-grad hook frees each one once copied to the host); the step runs on the host
    and copies the updated weights back into the parameters in place. The host side is counted
    (:func:`_offload_host_breakdown`)."""


    def __init__(self, params: Any, offload_gradients: bool = False, **hparams: Any) -> None:
        super().__init__(list(params), {})
        self.offload_gradients = offload_gradients
        if offload_gradients:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(_free_grad)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return None


def _free_grad(p: torch.Tensor) -> None:
    p.grad = None  # copied to its host slot (a device-to-host copy allocates nothing on the device)


def _offload_host_breakdown(params: Sequence[torch.Tensor], target: torch.device) -> dict[str, int]:
    """Host bytes of OffloadedAdamW over ``params``: what its constructor allocates on the host."""
    from memlab.offload import device_host_bytes

    n = sum(p.numel() for p in params)
    fp32 = device_host_bytes(n, "offload-adamw")["host"]  # 16 bytes/param: master + grad slot + 2 moments
    out = {"fp32 master weights": 4 * n, "fp32 grad slots": 4 * n, "fp32 moments": 8 * n}
    assert sum(out.values()) == fp32
    if target.type == "cuda":
        out["pinned staging (param dtype)"] = sum(p.numel() * p.element_size() for p in params)
    out["step counters"] = 4 * len(params)
    return out


def bnb_state_bytes(model: nn.Module) -> int:
    """Bytes of bitsandbytes AdamW8bit's state for ``model``'s trainable parameters (its documented layout)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        if n < BNB_MIN_8BIT_SIZE:
            total += 2 * n * 4  # two fp32 moments
        else:
            blocks = -(-n // BNB_BLOCKSIZE)
            total += 2 * n + 2 * blocks * 4  # two uint8 moments + two fp32 absmax per block
    return total


def paged_state_bytes(model: nn.Module, optimizer: str) -> tuple[int, int]:
    """bitsandbytes' paged AdamW state for ``model``'s trainable parameters: (bytes PyTorch's allocator holds,
    bytes in CUDA unified memory).

    ``Optimizer8bit.get_state_buffer`` pages a moment only for a tensor of at least 100,000 elements
    (:data:`memlab.estimate.recipes.BNB_MIN_PAGED_SIZE`; ``F.get_paged``: ``cudaMallocManaged``, which
    ``torch.cuda.memory_allocated`` never sees); a smaller one gets ``torch.zeros_like``. The moments are fp32 for
    ``"paged-adamw32bit"``; for ``"paged-adamw8bit"`` uint8 with an fp32 absmax per 256 elements (allocator
    memory), fp32 below 4,096 elements, as AdamW8bit (:func:`bnb_state_bytes`).

    Raises:
        ValueError: ``optimizer`` not one of the two paged ones.
    """
    check_choice("optimizer", optimizer, ("paged-adamw32bit", "paged-adamw8bit"))
    allocator = paged = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        if optimizer == "paged-adamw32bit" or n < BNB_MIN_8BIT_SIZE:
            moments, absmax = 2 * n * 4, 0
        else:
            moments, absmax = 2 * n, 2 * -(-n // BNB_BLOCKSIZE) * 4
        if n >= BNB_MIN_PAGED_SIZE:
            paged += moments
        else:
            allocator += moments
        allocator += absmax
    return allocator, paged


def step_optimizer(params: list, step: StepSpec, name: str, target: torch.device, fake: bool,
                   notes: list[str]) -> tuple[Any, str, dict[str, int]]:
    """The optimizer a traced step runs: (the optimizer, its implementation as the estimate names it, host
    bytes by kind).

    ``name`` is the optimizer built (SGD stands in for an 8-bit AdamW whose state is modelled); with
    ``optimizer="offload-adamw"`` a fake trace gets OffloadedAdamW's device side and its host buffers are
    counted. What is counted rather than traced is appended to ``notes``.

    Raises:
        ValueError: ``optimizer_kwargs`` the optimizer does not take.
    """
    if step.optimizer == "offload-adamw":
        return _offload_optimizer(params, step, name, target, fake, notes)
    impl = (_resolve_impl(step.optimizer_impl, str(target)) if step.optimizer not in ("adamw8bit", "paged-adamw32bit",
                                                                                       "paged-adamw8bit")
            else "bitsandbytes" + (", paged" if step.optimizer.startswith("paged") else ""))
    kwargs = dict(step.optimizer_kwargs or {})
    if step.optimizer_in_backward:
        from memlab.offload import optimizer_in_backward

        def one(ps: list) -> torch.optim.Optimizer:
            return make_optimizer(name, ps, impl=step.optimizer_impl, device=str(target), fake=fake, **kwargs)

        notes.append("optimizer in backward (memlab.offload.optimizer_in_backward): one optimizer per parameter, "
                     "stepped by a post-accumulate-grad hook and its gradient freed at once (a gradient lives in the "
                     "backward phase, counted with the activations); warmed up by a full step")
        return optimizer_in_backward(params, one), f"{impl}, per parameter in backward", {}
    opt = make_optimizer(name, params, impl=step.optimizer_impl, device=str(target), fake=fake, **kwargs)
    return opt, impl, {}


def _offload_optimizer(params: list, step: StepSpec, name: str, target: torch.device, fake: bool,
                       notes: list[str]) -> tuple[Any, str, dict[str, int]]:
    from memlab.offload import OffloadedAdamW

    okw = dict(step.optimizer_kwargs or {})
    og = okw.get("offload_gradients", False)
    if not isinstance(og, bool):
        raise ValueError(f"optimizer_kwargs['offload_gradients']={og!r} is invalid; allowed: True, False")
    impl = "memlab.offload, step on the CPU" + (", gradients offloaded during backward" if og else "")
    host = _offload_host_breakdown(params, target)
    try:
        inspect.signature(OffloadedAdamW.__init__).bind(None, params, **okw)
    except TypeError as exc:
        raise ValueError(f"optimizer_kwargs={okw!r} is invalid for OffloadedAdamW ({exc}); allowed: lr, betas, eps, "
                         f"weight_decay, pin_memory, overlap, offload_gradients, kernel") from None
    if fake:
        opt = _OffloadDeviceSide(params, **okw)
    else:
        opt = make_optimizer(name, params, device=str(target), **okw)
        if target.type == "cpu":
            notes.append("measured on the CPU, where host == device: OffloadedAdamW's host buffers (master weights, "
                         "moments, step counters; the fp32 grad slots once written) are in the tracked bytes too")
    notes.append("offload-adamw: host bytes counted from OffloadedAdamW's buffers, not traced; device bytes traced")
    if step.dtype == Recipe.BF16_PURE:
        notes.append("with offload-adamw the bf16 params have fp32 master weights on the host: "
                     "the update is not rounded to bf16 as plain bf16-pure AdamW's is")
    return opt, impl, host
