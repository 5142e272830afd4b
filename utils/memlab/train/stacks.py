"""Training stacks for the trainer: the knobs it runs, the vocabulary, and the back-off on OOM."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memlab.core.vocab import Recipe
from memlab.plan import Stack

__all__ = ["SUPPORTED", "Backoff", "back_off", "back_off_chain"]

SUPPORTED: dict[str, tuple[str, ...]] = {
    "precision": (Recipe.FP32.value, Recipe.BF16_MIXED.value),
    "checkpointing": ("none", "every-k", "full"),
    "optimizer": ("adamw", "adamw-fused"),
    "adapter": ("full",),
    "attention": ("eager", "sdpa"),
    # chapter 09: the loss without its logits (transformers causal LMs: memlab.loss) and the step in backward
    "loss": ("default", "chunked", "fused"),
    "optimizer_in_backward": (False, True),
}


# ----------------------------------------------------------------------------- back-off
@dataclass(frozen=True)
class Backoff:
    """One OOM back-off: at optimizer step ``step`` stack ``from_stack`` ran out of memory
    (``reason``), the trainer moved to ``to_stack`` and restored the checkpoint of step ``restored``."""

    step: int
    from_stack: Stack
    to_stack: Stack
    reason: str
    restored: int

    def to_json(self) -> dict[str, Any]:
        """This event as plain JSON-able values (the stacks as dicts), for a checkpoint; :meth:`from_json` reads it back."""
        return {"step": self.step, "from_stack": dataclasses.asdict(self.from_stack),
                "to_stack": dataclasses.asdict(self.to_stack), "reason": self.reason, "restored": self.restored}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Backoff":
        """The event :meth:`to_json` wrote (an old checkpoint's pure-bf16 "bf16" is respelled)."""
        return cls(d["step"], Stack(**d["from_stack"]), Stack(**d["to_stack"]), d["reason"],
                   d["restored"])


def back_off(stack: Stack) -> Stack | None:
    """The next stack to try after ``stack`` ran out of memory, keeping the effective batch.

    The rule: first shrink the micro-batch to the largest divisor of the effective batch that is
    at most half the current one (activations scale with the micro-batch; gradient accumulation
    keeps ``micro_batch * grad_accum`` equal); once the micro-batch is 1, turn on full
    checkpointing; after that, ``None`` (nothing left to give). Every other knob is kept.

    >>> back_off(Stack(micro_batch=18, grad_accum=1)).micro_batch, back_off(Stack(micro_batch=9, grad_accum=2)).micro_batch
    (9, 3)

    Raises:
        TypeError: ``stack`` is not a :class:`memlab.plan.Stack`.
    """
    if not isinstance(stack, Stack):
        raise TypeError(f"stack: expected a memlab.plan.Stack, got {type(stack).__name__}")
    eff = stack.effective_batch
    if stack.micro_batch > 1:
        mb = max(d for d in range(1, stack.micro_batch // 2 + 1) if eff % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    if stack.checkpointing != "full":
        return dataclasses.replace(stack, checkpointing="full")
    return None


def back_off_chain(stack: Stack) -> list[Stack]:
    """Every stack :func:`back_off` leads to from ``stack``: ``[stack, back_off(stack),
    back_off(back_off(stack)), ...]`` until nothing is left."""
    out = [stack]
    while (nxt := back_off(out[-1])) is not None:
        out.append(nxt)
    return out
