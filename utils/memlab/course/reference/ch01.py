"""Chapter 01's lab reference answers ("a memory profiler from scratch").

The exercises rebuild the tracker's pieces: a live-bytes counter on weakref finalizers
(:class:`LiveBytes`), the category rule (:func:`categorize`), per-phase peaks
(:func:`phase_peaks`, the tracker's own, re-exported), activations measured on fake tensors
(:func:`fake_activation_bytes`) and the leak-free training loop (:func:`train_losses`).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch

from memlab.core.validation import check_choice, check_positive_int
from memlab.core.vocab import CATEGORIES, PHASES, Category, Phase
from memlab.profiler import Event, MemoryTracker, phase_peaks, tensors_in

__all__ = ["LiveBytes", "categorize", "phase_peaks", "fake_activation_bytes", "train_losses",
           "CATEGORIES", "PHASES", "MemoryTracker", "Event"]


class LiveBytes:
    """The smallest live-bytes counter: ``track(t)`` each tensor; its storage is counted once
    and subtracted when it dies (a weakref callback on the untyped storage).

    >>> lb = LiveBytes(); x = torch.zeros(256); lb.track(x); lb.track(x[:10]); lb.current
    1024
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage in ``current`` and ``peak`` until it dies (a storage already counted,
        a view's included, is not counted again)."""
        st = t.untyped_storage()
        key = st._cdata
        if key in self._refs:
            return
        n = st.nbytes()

        def free(ref: weakref.ref, key: int = key, n: int = n) -> None:
            if self._refs.get(key) is ref:
                del self._refs[key]
                self.current -= n

        self._refs[key] = weakref.ref(st, free)
        self.current += n
        self.peak = max(self.peak, self.current)


def categorize(t: torch.Tensor, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, phase: str | None = None) -> str:
    """Which of ``CATEGORIES`` :class:`MemoryTracker` gives a live tensor's storage.

    The tracker's rule, owners first:

    * ``parameters``: the storage is shared with a parameter or buffer of ``model`` or a
      parameter of ``optimizer`` (a view or ``.detach()`` of one too: storages are compared,
      not tensor objects);
    * ``gradients``: shared with the ``.grad`` of one of those;
    * ``optimizer``: shared with a tensor in ``optimizer.state`` (moments, the step counter);

    else by ``phase``, the phase the storage was born in (one of ``PHASES``): ``"forward"`` or
    ``"backward"`` -> ``activations`` (saved tensors, dropout masks and normalisation statistics,
    which have no ``grad_fn``, and activation gradients), ``"optimizer"`` -> ``optimizer`` (the
    step's temporaries), ``"other"`` -> ``other`` (an input batch, anything made outside the three
    phases, even with a ``grad_fn``). Two caveats, both about time: when a step ends, the tracker
    moves what the step allocated and still holds outside ``optimizer.state`` to ``other`` (pass
    ``phase="other"`` for such a survivor); and its owner labels stick, so an old ``.grad`` that
    you still hold after autograd replaced it stays ``gradients`` there, while this function,
    which sees only the present, calls it by its birth phase.

    ``phase=None`` (the old two-argument call) falls back to a guess the tracker never makes:
    ``activations`` when ``t.grad_fn`` is set, else ``other``. It mislabels dropout masks, the
    statistics LayerNorm saves and activation gradients as ``other`` (lecture 01 shows it on a real
    step); pass the birth phase to get the tracker's label.

    Raises:
        ValueError: ``phase`` is not one of ``PHASES`` or None.
    """
    check_choice("phase", phase, (*PHASES, None))
    key = t.untyped_storage()._cdata

    def same(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage()._cdata == key

    params = list(model.parameters()) + list(model.buffers()) if model is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    if any(same(p) for p in params):
        return "parameters"
    if any(same(p.grad) for p in params if isinstance(p, torch.Tensor)):
        return "gradients"
    if optimizer is not None and any(same(v) for s in optimizer.state.values() for v in tensors_in(s)):
        return "optimizer"
    if phase is None:  # the grad_fn guess, kept for two-argument callers
        return "activations" if t.grad_fn is not None else "other"
    # the same mapping as MemoryTracker.__torch_dispatch__
    if phase in (Phase.FORWARD, Phase.BACKWARD):
        return Category.ACTIVATIONS.value
    return Category.OPTIMIZER.value if phase == Phase.OPTIMIZER else Category.OTHER.value



def fake_activation_bytes(config: Any, batch_size: int, seq_len: int) -> int:
    """Bytes one training forward of ``TinyGPT(config)`` (logits and loss) saves for backward,
    measured on fake tensors: the model and the batch are built under ``FakeTensorMode``, so a
    model far larger than the machine costs nothing. Storages count once (keyed by the storage
    object, since ``data_ptr()`` means nothing on a fake tensor); parameters and buffers are not
    activations.

    Raises:
        ValueError: naming a ``batch_size`` below 1 or a ``seq_len`` outside 1 to ``config.block_size``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab.models import TinyGPT

    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len, maximum=config.block_size)  # the model's context
    with FakeTensorMode():
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        y = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        skip = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}
        seen: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if id(st) not in skip:
                seen[id(st)] = st  # holding the storage keeps its id unique while we count
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(x, y)
        total = sum(st.nbytes() for st in seen.values())
        del loss
    return total


def train_losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[Any],
                 steps: int) -> list[float]:
    """``steps`` training steps on ``(x, y)`` pairs from ``batches``; the loss history as floats.

    The leak-free loop: ``loss.item()`` goes into the history, never the tensor (a kept tensor
    keeps its autograd graph, and with ``retain_graph=True`` every saved activation, alive).

    ``model`` is a language model ``memlab.models.lm_loss`` can call; ``batches`` holds at least ``steps`` batches.
    """
    from memlab.models import lm_loss

    history: list[float] = []
    it = iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(loss.item())
    return history
