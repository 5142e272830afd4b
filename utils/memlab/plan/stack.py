"""A training stack (:class:`Stack`: one choice of every memory knob), the values each knob takes,
and how far a stack's update is from the exact one (:func:`fidelity_tier`).

Precisions are :mod:`memlab.core.vocab`'s recipes (``"bf16"`` = ``"bf16-mixed"``; pure bf16 is
``"bf16-pure"``); optimizers ``adamw``, ``adamw-fused``, ``adamw8bit`` (``"adam8bit"`` accepted),
``offload-adamw``; losses ``default`` (the plan's ``loss``), ``chunked``, ``fused`` (chapter 09); the
optimizer step in backward on or off (chapter 09).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.core import vocab
from memlab.core.validation import check_bool, check_choice, check_positive_int

_R = vocab.Recipe
PRECISIONS = vocab.RECIPES
CHECKPOINTING = ("none", "every-k", "selective", "full")
OPTIMIZERS = ("adamw", "adamw-fused", "adamw8bit", "offload-adamw")
ADAPTERS = ("full", "lora", "qlora")
ATTENTIONS = ("eager", "sdpa", "flash")
#: the loss of a stack: "default" is the plan's ``loss`` (transformers' own unless told), "chunked" memlab.loss's
#: chunked cross-entropy, "fused" the fused linear cross-entropy (memlab.loss.enable: the logits never materialised)
LOSSES = ("default", "chunked", "fused")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def canonical_in_backward(value: Any, *, argument: str = "optimizer_in_backward") -> Any:
    """A bool of a spelling of one (True, False, 1, 0, "true", "false", "yes", "no", "on", "off"); anything
    else as it is (the caller's check names it)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    return value


def canonical_precision(value: Any, *, argument: str = "precision") -> str:
    """The canonical recipe of a precision spelling (``"bf16"`` -> ``"bf16-mixed"``): :mod:`memlab.core.vocab`'s.

    Raises:
        ValueError: an unknown precision, naming ``argument``, the recipes and their aliases.
    """
    return vocab.canonical_recipe(value, argument=argument)


def canonical_stack_optimizer(value: Any, *, argument: str = "optimizer") -> str:
    """The planner's name of an optimizer spelling (``"adam8bit"`` -> ``"adamw8bit"``): :mod:`memlab.core.vocab`'s
    aliases over the planner's :data:`OPTIMIZERS`.

    Raises:
        ValueError: an optimizer the planner does not enumerate, naming ``argument`` and :data:`OPTIMIZERS`.
    """
    return vocab.canonical_optimizer(value, argument=argument, allowed=OPTIMIZERS)


@dataclass(frozen=True)
class Stack:
    """One choice of every memory knob for a training run.

    ``micro_batch * grad_accum`` is the effective batch; ``ckpt_every`` is k for
    ``checkpointing="every-k"`` (checkpoint every k-th block). ``loss`` is one of :data:`LOSSES`;
    ``optimizer_in_backward`` steps each parameter in backward and frees its gradient at once
    (:func:`memlab.offload.optimizer_in_backward`): it rules out accumulation and offload-adamw.
    """

    precision: str = "fp32"
    checkpointing: str = "none"
    ckpt_every: int = 1
    optimizer: str = "adamw"
    adapter: str = "full"
    attention: str = "sdpa"
    micro_batch: int = 1
    grad_accum: int = 1
    loss: str = "default"
    optimizer_in_backward: bool = False

    def __post_init__(self) -> None:
        # one vocabulary: other spellings are stored canonical (frozen: set through object)
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        object.__setattr__(self, "optimizer", canonical_stack_optimizer(self.optimizer))
        object.__setattr__(self, "loss", "default" if self.loss == "auto" else self.loss)
        object.__setattr__(self, "optimizer_in_backward", canonical_in_backward(self.optimizer_in_backward))
        for name, allowed in (("checkpointing", CHECKPOINTING), ("adapter", ADAPTERS), ("attention", ATTENTIONS),
                              ("loss", LOSSES)):
            check_choice(name, getattr(self, name), allowed)
        for name in ("ckpt_every", "micro_batch", "grad_accum"):
            check_positive_int(name, getattr(self, name))
        check_bool("optimizer_in_backward", self.optimizer_in_backward)
        if self.optimizer_in_backward and (self.grad_accum > 1 or self.optimizer == "offload-adamw"):
            raise ValueError(f"optimizer_in_backward=True is invalid with grad_accum={self.grad_accum}, optimizer="
                             f"{self.optimizer!r}: the gradient is consumed in backward; allowed: grad_accum=1 and an "
                             f"optimizer other than offload-adamw")

    @property
    def effective_batch(self) -> int:
        """``micro_batch * grad_accum``: the sequences of one optimizer step."""
        return self.micro_batch * self.grad_accum


# What the planner enumerates by default (``allow=`` narrows or widens it)
DEFAULT_ALLOW: dict[str, tuple] = {
    "precision": ("fp32", "bf16-mixed", "bf16-pure"),
    "checkpointing": ("none", "every-k", "full"),
    "ckpt_every": (2,),  # allow={"ckpt_every": (2, 4)} for more (each k costs traces at depths k and 2k)
    "optimizer": ("adamw", "adamw-fused", "adamw8bit", "offload-adamw"),
    "adapter": ("full", "lora", "qlora"),
    "attention": ("sdpa",),
    "micro_batch": None,  # every divisor of batch_size
    # chapter 09's knobs are searched where allow names them (e.g. allow={"loss": ["default", "fused"],
    # "optimizer_in_backward": [False, True]}, CLI --allow loss=default,fused); memlab.train's BudgetTrainer runs
    # them too (on transformers causal LMs), but the default plan stays the course's stacks of chapters 02-08
    "loss": ("default",),
    "optimizer_in_backward": (False,),
}
# the values allow= may name for each enumerated knob
ALLOWED_VALUES: dict[str, tuple] = {
    "precision": PRECISIONS, "checkpointing": ("none", "every-k", "full"), "optimizer": OPTIMIZERS,
    "adapter": ADAPTERS, "attention": ATTENTIONS, "loss": LOSSES, "optimizer_in_backward": (False, True),
}

# Stack.optimizer -> (memlab.estimate optimizer, optimizer_impl, optimizer_kwargs)
ESTIMATOR_OPTIMIZER = {
    "adamw": ("adamw", "auto", None),  # PyTorch's default on CUDA: the foreach implementation
    "adamw-fused": ("adamw", "fused", None),
    "adamw8bit": ("adamw8bit", "auto", None),
    "offload-adamw": ("offload-adamw", "auto", {"offload_gradients": True}),
}
# Device memory by optimizer, at equal everything else, where it is ordered whatever the model:
# the foreach AdamW (PyTorch's CUDA default) holds at least what the fused one does (its step's
# moment-sized temporaries; the same on a CPU, where both loop), and every optimizer holds at least
# what the offloaded one does (state, master weights and gradients on the host). 8-bit AdamW is
# ordered against neither AdamW: tensors under 4,096 elements keep fp32 moments, and bf16 weights
# have 2-byte AdamW moments, so on a small model it can hold more.
# (a, b): optimizer a holds at least what b holds on the device
OPTIMIZER_GE = {("adamw", "adamw-fused")} | {(o, "offload-adamw") for o in OPTIMIZERS}


def fidelity_tier(stack: Stack) -> int:
    """How far the stack's update is from the fp32-master AdamW update of every weight.

    0: the same update (fp32, mixed precision, checkpointing, accumulation, CPU-offloaded AdamW --
    which keeps fp32 master weights on the host even for bf16 weights on the device, as ZeRO-Offload
    does; the chunked or fused loss, accumulated in fp32 -- the same loss up to the order of its sums;
    the optimizer step in backward, the same update per parameter); 1: the same parameters, a rounded update (pure bf16 weights and AdamW state without a
    master copy; 8-bit AdamW moments, Dettmers et al. 2022); 2: LoRA (other parameters are trained:
    Hu et al. 2021); 3: QLoRA (LoRA on an NF4-quantized base: Dettmers et al. 2023).
    """
    if stack.adapter == "qlora":
        return 3
    if stack.adapter == "lora":
        return 2
    if stack.optimizer == "adamw8bit" or (stack.precision == _R.BF16_PURE and stack.optimizer != "offload-adamw"):
        return 1
    return 0


TIER_TEXT = {0: "exact AdamW update", 1: "rounded update", 2: "LoRA", 3: "QLoRA"}


def stack_label(s: Stack) -> str:
    """A short name of a stack, e.g. ``"qlora bf16-mixed adamw-fused ckpt all mb 4x4"`` (micro-batch x accumulation;
    ``fused loss`` and ``opt-in-bwd`` where chapter 09's loss or optimizer step in backward is on)."""
    ck = {"none": "no ckpt", "full": "ckpt all"}.get(s.checkpointing, f"ckpt 1/{s.ckpt_every}")
    ad = "" if s.adapter == "full" else f"{s.adapter} "
    at = "" if s.attention == "sdpa" else f" {s.attention}"
    ch9 = ("" if s.loss == "default" else f" {s.loss} loss") + (" opt-in-bwd" if s.optimizer_in_backward else "")
    return f"{ad}{s.precision} {s.optimizer} {ck}{at}{ch9} mb {s.micro_batch}x{s.grad_accum}"
