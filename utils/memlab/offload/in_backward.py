"""The optimizer step fused into the backward pass (chapter 09): one optimizer per parameter, stepped
by a post-accumulate-grad hook the moment that parameter's gradient is complete, which then frees the
gradient. The whole gradient of the model never exists at once: the step's gradient memory drops from
``sum(p.numel() * p.element_size())`` to the largest parameter's.

This is PyTorch's recipe (tutorial "How to save memory by fusing the optimizer step into the backward
pass", https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html, built on
``Tensor.register_post_accumulate_grad_hook``, PyTorch >= 2.1) and torchtune's ``optimizer_in_bwd``
(``torchtune.training.create_optim_in_bwd_wrapper`` and ``register_optim_in_bwd_hooks``). For any
optimizer whose update of a parameter reads only that parameter's state and gradient (SGD, Adam,
AdamW, 8-bit AdamW) the update is the same as one optimizer over all parameters.

What it rules out, because the gradient is consumed as soon as it exists:

* gradient accumulation: the second micro-batch's backward would step again with its own gradient
  (the first one's update is already applied and its gradient freed). :class:`OptimizerInBackward`
  raises a RuntimeError on it once the training loop calls ``step()`` or ``zero_grad()`` (torchtune
  refuses ``gradient_accumulation_steps > 1`` with ``optimizer_in_bwd`` the same way);
* clipping by the global norm: ``clip_grad_norm_`` after ``backward()`` finds no gradient (every
  ``.grad`` is None: it returns 0 and clips nothing), and during backward the norm of the gradients
  not yet computed is unknown. Per-parameter clipping inside ``make_optimizer``'s optimizer is possible;
  the global norm is not (torchtune refuses ``clip_grad_norm`` with ``optimizer_in_bwd``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

__all__ = ["OptimizerInBackward", "optimizer_in_backward"]


class _States(Mapping):
    # optimizer.state of the wrapper: each parameter's state, read from its own optimizer
    def __init__(self, owner: "OptimizerInBackward") -> None:
        self._owner = owner

    def __getitem__(self, p: Any) -> Any:
        opt = self._owner.optimizers.get(p)
        if opt is None or p not in opt.state:
            raise KeyError(p)
        return opt.state[p]

    def __iter__(self):
        return (p for p, opt in self._owner.optimizers.items() if p in opt.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per trainable parameter, stepped in backward; made by :func:`optimizer_in_backward`.

    It is a ``torch.optim.Optimizer`` so that a training loop, an LR scheduler and memlab's tracker
    take it as one: ``param_groups`` are the per-parameter optimizers' own groups (a scheduler that
    sets ``lr`` sets theirs), ``state`` maps each parameter to its optimizer's state, ``step()`` does
    nothing (the steps ran in backward) and marks the end of a step, as ``zero_grad()`` does.

    Attributes:
        optimizers: parameter -> its optimizer.
        names: parameter -> its name (``model.named_parameters()``) or ``"param<i>"``.
        steps: how many per-parameter steps ran in backward since construction.
    """

    def __init__(self, params: list[torch.Tensor], names: list[str],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self.names: dict[torch.Tensor, str] = dict(zip(params, names))
        for p in params:
            opt = make_optimizer([p])
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"make_optimizer([p]) returned {type(opt).__name__}; allowed: a torch.optim.Optimizer "
                                f"over exactly [p] (e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-4))")
            owned = [q for g in opt.param_groups for q in g["params"]]
            if len(owned) != 1 or owned[0] is not p:
                raise ValueError(f"make_optimizer([p]) for {self.names[p]!r} holds {len(owned)} parameters; allowed: "
                                 f"an optimizer over exactly the one parameter it is given")
            self.optimizers[p] = opt
        super().__init__(params, {})
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        self.state = _States(self)  # type: ignore[assignment]
        self.steps = 0
        self._done: set[int] = set()  # parameters stepped since the loop's last step() / zero_grad()
        self._loop_marks = False      # the loop calls step() or zero_grad(): accumulation is detectable
        self._hooks = [p.register_post_accumulate_grad_hook(self._step_one) for p in params]

    def _step_one(self, p: torch.Tensor) -> None:
        # runs once per backward for p, after every contribution to p.grad was summed (tied weights too)
        if self._loop_marks and id(p) in self._done:
            raise RuntimeError(
                f"optimizer in backward: parameter {self.names[p]!r} got a second gradient before step(): gradient "
                f"accumulation is impossible when the optimizer steps in backward (the first micro-batch's update "
                f"is applied and its gradient freed); use grad_accum=1 (a larger micro-batch) or a normal optimizer")
        self._done.add(id(p))
        opt = self.optimizers[p]
        opt.step()
        opt.zero_grad(set_to_none=True)  # the gradient is freed here: it never coexists with the others
        self.steps += 1

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Nothing to do (each parameter was stepped in backward); ends the step. Runs ``closure`` if given."""
        out = None
        if closure is not None:
            with torch.enable_grad():
                out = closure()
        self._loop_marks = True
        self._done.clear()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are freed in backward already; this clears any left and ends the step."""
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)
        self._loop_marks = True
        self._done.clear()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{parameter name: that parameter's optimizer's state_dict()}``."""
        return {self.names[p]: opt.state_dict() for p, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` returned (the same parameter names).

        Raises:
            ValueError: names missing or unexpected, each named.
        """
        have = {self.names[p]: p for p in self.optimizers}
        missing, unexpected = sorted(set(have) - set(state_dict)), sorted(set(state_dict) - set(have))
        if missing or unexpected:
            raise ValueError(f"state_dict does not match these parameters: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}; allowed: the dict OptimizerInBackward.state_dict() returned")
        for name, p in have.items():
            self.optimizers[p].load_state_dict(state_dict[name])
        # torch's load_state_dict gives each optimizer new group dicts: share them again
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]

    def remove(self) -> None:
        """Remove the hooks: backward accumulates ``.grad`` again and no optimizer steps in it."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _named_trainable(model_or_params: nn.Module | Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[str]]:
    # the distinct trainable parameters (a tied weight once) and their names
    if isinstance(model_or_params, nn.Module):
        pairs = list(model_or_params.named_parameters())  # named_parameters drops tied duplicates
    elif isinstance(model_or_params, torch.Tensor):
        raise TypeError("model_or_params: got one tensor; allowed: a module or an iterable of parameters ([p])")
    else:
        try:
            pairs = [(f"param{i}", p) for i, p in enumerate(model_or_params)]
        except TypeError:
            raise TypeError(f"model_or_params: expected a torch.nn.Module or an iterable of parameters, got "
                            f"{type(model_or_params).__name__}") from None
    params, names, seen = [], [], set()
    for name, p in pairs:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"model_or_params: {name} is a {type(p).__name__}; allowed: tensors (parameters)")
        if not p.requires_grad or id(p) in seen:  # frozen: no gradient, no step; tied: stepped once
            continue
        if not p.is_leaf:
            raise ValueError(f"model_or_params: {name} is not a leaf tensor; allowed: parameters (leaves that "
                             f"require grad)")
        seen.add(id(p))
        params.append(p)
        names.append(name)
    return params, names


def optimizer_in_backward(model_or_params: nn.Module | Iterable[torch.Tensor],
                          make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> OptimizerInBackward:
    """Step each trainable parameter's own optimizer in backward, as soon as its gradient is complete,
    and free that gradient right away.

    ``make_optimizer([p])`` builds the optimizer of one parameter (e.g.
    ``lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False)``); it is called once per distinct
    trainable parameter: frozen ones (``requires_grad=False``) are skipped, a tied weight (one
    ``Parameter`` used twice, as tied embeddings) gets one optimizer and one step, after both uses'
    gradients were summed. A post-accumulate-grad hook on each parameter runs its optimizer's
    ``step()`` then ``zero_grad(set_to_none=True)``. Gradient accumulation and clipping by the global
    norm are ruled out (module docstring); a second backward between two ``step()`` calls raises.

    Returns:
        An :class:`OptimizerInBackward` (a ``torch.optim.Optimizer``): call ``step()`` and ``zero_grad()``
        as usual (they do nothing but mark the step), ``state_dict()`` / ``load_state_dict()``,
        ``remove()``.

    Raises:
        TypeError: ``model_or_params`` is neither a module nor parameters, ``make_optimizer`` is not
            callable or returns no optimizer.
        ValueError: no trainable parameter, a parameter that is not a leaf, an optimizer over other parameters.
    """
    if not callable(make_optimizer):
        raise TypeError(f"make_optimizer={make_optimizer!r} is invalid; allowed: a callable [p] -> torch.optim.Optimizer")
    params, names = _named_trainable(model_or_params)
    if not params:
        raise ValueError("model_or_params has no trainable parameter (all frozen or empty); allowed: at least one "
                         "parameter with requires_grad=True")
    return OptimizerInBackward(params, names, make_optimizer)
