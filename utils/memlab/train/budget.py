"""The budget on the CPU: a memory tracker that refuses, as the CUDA allocator does past its limit."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlab.core.units import format_bytes
from memlab.core.validation import check_positive_int
from memlab.profiler import MemoryTracker

__all__ = ["BudgetTracker"]


class BudgetTracker(MemoryTracker):
    """A :class:`~memlab.profiler.MemoryTracker` that raises ``torch.OutOfMemoryError`` when the
    live tracked bytes would exceed ``budget``, the CPU stand-in for the CUDA allocator's refusal.

    The check runs after every dispatched op (and when entering the block, where the model and
    the optimizer state alone may be too big). A total over the budget raises before it can
    become the peak, so ``peak_bytes <= budget`` always holds; ``refused_bytes`` is the total
    that was refused (0 if none).
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                 budget: int, device: str | torch.device | None = None, timeline: bool = False) -> None:
        super().__init__(model, optimizer, device=device, timeline=timeline)
        check_positive_int("budget", budget)
        self.budget = budget
        self.refused_bytes = 0
        self._enforce = True

    def after_op(self) -> bool | None:
        """Refuse the op that takes the live bytes over the budget; ``False`` (leave this moment out of
        the peak) while unwinding after a refusal.

        Raises:
            torch.OutOfMemoryError: the live bytes exceed ``budget``.
        """
        total = self.current_bytes
        if total > self.budget:
            if not self._enforce:  # unwinding after a refusal: the refused bytes never become the peak
                return False
            self.refused_bytes = total
            self._enforce = False  # the unwinding that follows must not raise again
            raise torch.OutOfMemoryError(
                f"budget {format_bytes(self.budget)} ({self.budget} B) exceeded: live tensors would hold "
                f"{format_bytes(total)} ({total} B) (memlab.train.BudgetTracker, CPU)")
        return None

    def __enter__(self) -> "BudgetTracker":
        self._enforce = True
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        self._enforce = False
        super().__exit__(*exc)

