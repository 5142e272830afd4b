"""BudgetTrainer's CUDA accounting, played on the CPU: the caching allocator's counters are faked by a
tracker that sees every storage the process makes, plus bytes of other owners that were already allocated
(another test's tensors, the cuBLAS workspaces: 64 MiB on an H200). The trainer must count what the CPU
path counts -- its own tensors -- and back off when that exceeds the budget, whatever the allocator's
reserved-bytes limit lets through (on an H200 the old trainer committed steps with a "peak" of 108,147,712 B
under a 64 MiB budget, and no back-off: its peak was the whole process's, its only limit that cap)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from memlab.profiler import MemoryTracker
from memlab.train import BudgetTrainer, back_off_chain
from memlab.train import trainer as trainer_module

sys.path.insert(0, str(Path(__file__).parent))
from test_train import A, B, C, E, T, model  # noqa: E402

OUTSIDE = 100 * 2**20  # allocated before the trainer starts and not its own
TOTAL = 141 * 2**30  # an H200's memory


class FakeCudaAllocator(MemoryTracker):
    """``torch.cuda``'s allocator counters on the CPU: ``memory_allocated`` is ``outside`` plus every storage
    this tracker holds (the model's from the start, everything created while it is entered), its peak is
    reset by ``reset_peak_memory_stats``; ``memory_snapshot`` lists those storages as allocated blocks.
    Nothing is ever refused (the per-process fraction is only recorded), as when cached blocks serve a step."""

    def __init__(self, model: torch.nn.Module, outside: int = OUTSIDE) -> None:
        super().__init__(model, timeline=False)
        self.outside, self.top = outside, 0
        self.calls: list[tuple] = []

    def after_op(self):
        self.top = max(self.top, self.current_bytes)

    # the torch.cuda functions the trainer calls
    def memory_allocated(self, device=None) -> int:
        return self.outside + self.current_bytes

    def max_memory_allocated(self, device=None) -> int:
        return self.outside + max(self.top, self.current_bytes)

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append(("reset_peak",))
        self.top = self.current_bytes

    def memory_snapshot(self) -> list[dict]:
        blocks = [{"address": s.storage.data_ptr(), "size": s.nbytes, "state": "active_allocated"}
                  for s in self.live_storages()]
        return [{"device": 0, "blocks": blocks}]

    def memory_reserved(self, device=None) -> int:
        return self.memory_allocated() + 2 * 2**20

    def set_per_process_memory_fraction(self, fraction, device=None) -> None:
        self.calls.append(("fraction", fraction))

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))

    def install(self, monkeypatch) -> "FakeCudaAllocator":
        for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "memory_snapshot",
                     "memory_reserved", "set_per_process_memory_fraction", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": TOTAL}))
        monkeypatch.setattr(BudgetTrainer, "_cuda_counts", property(lambda self: True))
        monkeypatch.setattr(trainer_module, "_warm_up_cuda_matmuls",
                            lambda device, precisions: self.calls.append(("warm_up", tuple(sorted(precisions)))))
        return self


def _train_on_fake_cuda(monkeypatch, stacks, budget, steps, tmp_path):
    m = model()
    fake = FakeCudaAllocator(m).install(monkeypatch)
    t = BudgetTrainer(m, budget, stacks=stacks, effective_batch=E, seq_len=T, ckpt_dir=tmp_path)
    with fake:
        t.train(steps)
    return t, fake


@pytest.fixture(scope="module")
def cpu_runs():
    """Each stack alone on the CPU path, no budget: its per-step tracked peaks and losses."""
    out = {}
    for s in (A, B, C):
        t = BudgetTrainer(model(), None, stacks=[s], effective_batch=E, seq_len=T)
        t.train(3)
        out[s] = t
    return out


def test_cuda_peaks_count_what_the_cpu_counts(cpu_runs, monkeypatch, tmp_path):
    """No budget: the allocator-counted peaks, 100 MiB of other owners beside them, are the CPU tracker's."""
    for s in (A, C):
        t, fake = _train_on_fake_cuda(monkeypatch, [s], None, 3, tmp_path / f"mb{s.micro_batch}-{s.checkpointing}")
        assert t.step_peaks == cpu_runs[s].step_peaks, (s, t.step_peaks, cpu_runs[s].step_peaks)
        assert t.losses == cpu_runs[s].losses
        assert ("warm_up", ("fp32",)) in fake.calls
        assert fake.calls.index(("warm_up", ("fp32",))) < fake.calls.index(("reset_peak",))


def test_cuda_over_budget_backs_off_as_the_cpu_does(cpu_runs, monkeypatch, tmp_path):
    """A budget A's steps exceed and B's meet: the allocator refuses nothing (cached blocks), the trainer
    backs off by its own count at step 0, and then runs B's steps bitwise."""
    budget = (cpu_runs[A].step_peaks[0] + max(cpu_runs[B].step_peaks)) // 2
    assert max(cpu_runs[B].step_peaks) < budget < cpu_runs[A].step_peaks[0]
    t, fake = _train_on_fake_cuda(monkeypatch, [A, B, C], budget, 3, tmp_path)
    assert [(e.step, e.from_stack, e.to_stack, e.restored) for e in t.backoffs] == [(0, A, B, 0)]
    assert "exceeded" in t.backoffs[0].reason and "CUDA allocator" in t.backoffs[0].reason
    assert str(cpu_runs[A].step_peaks[0]) in t.backoffs[0].reason  # A's step 0, counted as the CPU counts it
    assert t.peak_bytes <= budget
    assert t.step_peaks == cpu_runs[B].step_peaks
    assert t.losses == cpu_runs[B].losses  # bitwise: the step that did not fit was rolled back
    # the allocator's backstop: set above what was reserved when training started, lifted at the end
    fractions = [c[1] for c in fake.calls if c[0] == "fraction"]
    assert fractions[-1] == 1.0 and len(fractions) == 2
    assert fractions[0] * TOTAL >= OUTSIDE + budget


def test_no_stack_fits_on_cuda_is_the_clear_error(cpu_runs, monkeypatch, tmp_path):
    budget = min(cpu_runs[C].step_peaks) // 2
    with pytest.raises(torch.OutOfMemoryError, match="does not fit the budget.*CUDA allocator's counter"):
        _train_on_fake_cuda(monkeypatch, back_off_chain(A), budget, 2, tmp_path)
