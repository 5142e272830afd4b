"""Pick the training stack that fits a model into a memory budget (chapter 07).

Work in progress: only :class:`Stack` is defined so far; the planner comes next.
"""
from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
CHECKPOINTING = ("none", "every-k", "selective", "full")
OPTIMIZERS = ("adamw", "adamw-fused", "adam8bit", "offload-adamw")
ADAPTERS = ("full", "lora", "qlora")
ATTENTIONS = ("eager", "sdpa", "flash")


@dataclass(frozen=True)
class Stack:
    """One choice of every memory knob for a training run.

    ``micro_batch * grad_accum`` is the effective batch; ``ckpt_every`` is k for
    ``checkpointing="every-k"`` (checkpoint every k-th block).
    """

    precision: str = "fp32"
    checkpointing: str = "none"
    ckpt_every: int = 1
    optimizer: str = "adamw"
    adapter: str = "full"
    attention: str = "sdpa"
    micro_batch: int = 1
    grad_accum: int = 1

    def __post_init__(self) -> None:
        for name, allowed in (("precision", PRECISIONS), ("checkpointing", CHECKPOINTING),
                              ("optimizer", OPTIMIZERS), ("adapter", ADAPTERS), ("attention", ATTENTIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: allowed {', '.join(map(repr, allowed))}")
        for name in ("ckpt_every", "micro_batch", "grad_accum"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum
