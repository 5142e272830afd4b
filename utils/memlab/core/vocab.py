"""The course's shared words: training recipes, optimizers, memory categories and step phases.

One spelling per idea across estimate, plan, train, amp and the profiler. The enums are ``str``
enums, so ``Category.ACTIVATIONS == "activations"`` and the old string spellings keep working.

"bf16" alone means bf16 *mixed* precision everywhere (fp32 master weights, gradients and
optimizer state; the forward under ``autocast(bfloat16)``), as in Lightning's ``"bf16-mixed"`` and
transformers' ``TrainingArguments(bf16=True)``. Pure bf16 (no fp32 copy anywhere) is ``"bf16-pure"``.

This is the one canonicaliser: estimate, plan, train and amp read a recipe or an optimizer through
:func:`canonical_recipe` / :func:`canonical_optimizer` (or the enum forms :func:`recipe`,
:func:`optimizer`), so a spelling means the same everywhere and an unknown one is refused with the
same message, naming the argument, the value, the canonical names and their aliases.
"""
from __future__ import annotations

from enum import Enum
from typing import Any

from memlab.core.validation import invalid

__all__ = ["Recipe", "Optimizer", "Category", "Phase", "CATEGORIES", "PHASES", "RECIPES", "OPTIMIZERS",
           "RECIPE_ALIASES", "OPTIMIZER_ALIASES", "canonical_recipe", "canonical_optimizer", "recipe", "optimizer"]


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
    PAGED_ADAMW32BIT = "paged-adamw32bit"  # bitsandbytes.optim.PagedAdamW32bit (state in CUDA unified memory)
    PAGED_ADAMW8BIT = "paged-adamw8bit"    # bitsandbytes.optim.PagedAdamW8bit


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
OPTIMIZER_ALIASES: dict[str, str] = {"adam8bit": "adamw8bit", "adamw-8bit": "adamw8bit", "adamw_8bit": "adamw8bit",
                                     # transformers' TrainingArguments(optim=...) spellings
                                     "paged_adamw_32bit": "paged-adamw32bit", "paged_adamw_8bit": "paged-adamw8bit"}


#: the canonical spellings, in table order
RECIPES: tuple[str, ...] = tuple(r.value for r in Recipe)
OPTIMIZERS: tuple[str, ...] = tuple(o.value for o in Optimizer)


def _canonical(value: Any, aliases: dict[str, str], allowed: tuple[str, ...], argument: str) -> str:
    if isinstance(value, str):  # a member of a str enum too
        key = value.strip().lower()
        key = aliases.get(key, key)
        if key in allowed:
            return key
    shown = {a: b for a, b in aliases.items() if b in allowed}
    raise invalid(argument, value, ", ".join(map(repr, allowed))
                  + " (aliases: " + ", ".join(f"{a!r}={b!r}" for a, b in shown.items()) + ")")


def canonical_recipe(value: Any, *, argument: str = "recipe") -> str:
    """The canonical spelling of a recipe (``"bf16"`` -> ``"bf16-mixed"``, case and spaces ignored).

    Raises:
        ValueError: ``argument=value is invalid; allowed:`` the recipes and their aliases.
    """
    return _canonical(value, RECIPE_ALIASES, RECIPES, argument)


def canonical_optimizer(value: Any, *, argument: str = "optimizer", allowed: tuple[str, ...] = OPTIMIZERS) -> str:
    """The canonical spelling of an optimizer (``"adam8bit"`` -> ``"adamw8bit"``).

    ``allowed`` is the caller's set of canonical names (the planner adds ``"adamw-fused"`` and has no SGD);
    the aliases map the same way for every caller.

    Raises:
        ValueError: ``argument=value is invalid; allowed:`` ``allowed`` and the aliases that lead into it.
    """
    return _canonical(value, OPTIMIZER_ALIASES, tuple(allowed), argument)


def recipe(name: Any, *, argument: str = "recipe") -> Recipe:
    """The :class:`Recipe` a spelling means (:func:`canonical_recipe`, as the enum)."""
    return Recipe(canonical_recipe(name, argument=argument))


def optimizer(name: Any, *, argument: str = "optimizer") -> Optimizer:
    """The :class:`Optimizer` a spelling means (:func:`canonical_optimizer`, as the enum)."""
    return Optimizer(canonical_optimizer(name, argument=argument))
