"""Train under a memory budget: back off on OOM, resume from a checkpoint, lose nothing (chapter 07).

Modules: :mod:`~memlab.train.trainer` (:class:`BudgetTrainer`), :mod:`~memlab.train.budget` (the
CPU budget, :class:`BudgetTracker`), :mod:`~memlab.train.stacks` (the knobs it runs and the
back-off), :mod:`~memlab.train.peaks` (a stack's peak, predicted and measured),
:mod:`~memlab.train.bucketing` (length bucketing), :mod:`~memlab.train.state` (checkpoint files, RNG states),
:mod:`~memlab.train.resume` (what a checkpoint must hold to be resumed, and whose it is),
:mod:`~memlab.train.lock` (one trainer per checkpoint directory), :mod:`~memlab.train.arguments` (the
trainer's arguments and data, checked before any work).
"""
from memlab.train.bucketing import bucket_batches, pad_batch, padding_stats, random_batches
from memlab.train.budget import BudgetTracker
from memlab.train.peaks import cheapest_stack, estimate_stack_peak, measure_stack_peak
from memlab.train.stacks import SUPPORTED, Backoff, back_off, back_off_chain
from memlab.train.trainer import BudgetTrainer

__all__ = ["BudgetTrainer", "BudgetTracker", "Backoff", "back_off", "bucket_batches", "random_batches",
           "padding_stats", "pad_batch", "measure_stack_peak", "estimate_stack_peak", "cheapest_stack",
           "back_off_chain", "SUPPORTED"]
