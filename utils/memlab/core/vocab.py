"""The course's shared words: training recipes, optimizers, memory categories and step phases.

One spelling per idea across estimate, plan, train, amp and the profiler. The enums are ``str``
enums, so ``Category.ACTIVATIONS == "activations"`` and the old string spellings keep working.

"bf16" alone means bf16 *mixed* precision everywhere (fp32 master weights, gradients and
optimizer state; the forward under ``autocast(bfloat16)``), as in Lightning's ``"bf16-mixed"`` and
transformers' ``TrainingArguments(bf16=True)``. Pure bf16 (no fp32 copy anywhere) is ``"bf16-pure"``.
"""
from __future__ import annotations

from enum import Enum
from typing import Any

from memlab.core.validation import invalid

__all__ = ["Recipe", "Optimizer", "Category", "Phase", "CATEGORIES", "PHASES",
           "RECIPE_ALIASES", "OPTIMIZER_ALIASES", "recipe", "optimizer"]


class _Word(str, Enum):
    """A str enum that prints as its value (``f"{Recipe.FP32}" == "fp32"``)."""

    def __str__(self) -> str:
        return self.value


class Recipe(_Word):
    """How the weights, gradients, optimizer state and compute are typed."""

    FP32 = "fp32"              # everything fp32
    BF16_MIXED = "bf16-mixed"  # fp32 weights/grads/state, forward and backward under autocast(bfloat16)
    FP16_MIXED = "fp16-mixed"  # the same under autocast(float16), with loss scaling (chapter 03)
    BF16_PURE = "bf16-pure"    # bf16 weights, gradients and optimizer state, no fp32 master copy


class Optimizer(_Word):
    """The optimizers the estimator, the planner and the trainer know."""

    ADAMW = "adamw"                  # torch.optim.AdamW
    SGD = "sgd"                      # torch.optim.SGD, no momentum
    ADAMW8BIT = "adamw8bit"          # bitsandbytes.optim.AdamW8bit / memlab.quant's 8-bit Adam
    OFFLOAD_ADAMW = "offload-adamw"  # memlab.offload.OffloadedAdamW (chapter 04)


class Category(_Word):
    """What a byte of training memory holds."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    OTHER = "other"


class Phase(_Word):
    """Where in a training step an allocation happens."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"


#: the categories in the order tables and plots show them
CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)
#: the phases in step order
PHASES: tuple[str, ...] = tuple(p.value for p in Phase)

#: other spellings accepted for a recipe, and the recipe they mean
RECIPE_ALIASES: dict[str, str] = {
    "bf16": "bf16-mixed", "fp16": "fp16-mixed", "bf16-true": "bf16-pure", "fp32-true": "fp32",
}
#: other spellings accepted for an optimizer
OPTIMIZER_ALIASES: dict[str, str] = {"adam8bit": "adamw8bit", "adamw-8bit": "adamw8bit", "adamw_8bit": "adamw8bit"}


def _parse(cls: type[Enum], aliases: dict[str, str], name: Any, argument: str) -> Any:
    """The member of ``cls`` that ``name`` (a member, a value or an alias) means, else :func:`invalid`."""
    if isinstance(name, cls):
        return name
    if isinstance(name, str):
        key = aliases.get(name.strip().lower(), name.strip().lower())
        for member in cls:
            if member.value == key:
                return member
    raise invalid(argument, name, ", ".join(repr(m.value) for m in cls)
                  + " (aliases: " + ", ".join(f"{a!r}={b!r}" for a, b in aliases.items()) + ")")


def recipe(name: Any, *, argument: str = "recipe") -> Recipe:
    """The :class:`Recipe` a spelling means (``"bf16"`` is bf16 mixed precision).

    Args:
        name: a Recipe or one of its values or aliases (:data:`RECIPE_ALIASES`).
        argument: the argument's name in the error message.

    Returns:
        The Recipe.

    Raises:
        ValueError: naming ``argument``, the value and the allowed spellings.
    """
    return _parse(Recipe, RECIPE_ALIASES, name, argument)


def optimizer(name: Any, *, argument: str = "optimizer") -> Optimizer:
    """The :class:`Optimizer` a spelling means (``"adam8bit"`` is ``"adamw8bit"``).

    Args:
        name: an Optimizer or one of its values or aliases (:data:`OPTIMIZER_ALIASES`).
        argument: the argument's name in the error message.

    Returns:
        The Optimizer.

    Raises:
        ValueError: naming ``argument``, the value and the allowed spellings.
    """
    return _parse(Optimizer, OPTIMIZER_ALIASES, name, argument)
