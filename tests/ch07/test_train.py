"""memlab.train: BudgetTrainer keeps its measured peak under the budget, backs off on OOM without
changing the losses, resumes after kill -9 with nothing lost or repeated; length bucketing."""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import sys
import time
import warnings

import pytest
import torch

from memlab.models import TinyGPT, TinyGPTConfig
from memlab.plan import Stack
from memlab.train import (BudgetTracker, BudgetTrainer, back_off, back_off_chain, bucket_batches, pad_batch,
                          padding_stats, random_batches)

CFG = dict(block_size=32, n_layer=2, n_head=2, n_embd=32)
E, T = 8, 32
A = Stack(micro_batch=8, grad_accum=1)
B = Stack(micro_batch=4, grad_accum=2)
C = Stack(micro_batch=1, grad_accum=8, checkpointing="full")


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(**CFG))


def run(stacks, steps=4, budget=None, **kw) -> BudgetTrainer:
    t = BudgetTrainer(model(), budget, stacks=stacks, effective_batch=E, seq_len=T, **kw)
    t.train(steps)
    return t


@pytest.fixture(scope="module")
def solo():
    """Each stack alone, no budget: per-step peaks and losses (the uninterrupted runs)."""
    return {s: run([s]) for s in (A, B, C)}


def test_peaks_shrink_along_the_back_off_chain(solo):
    a, b, c = (solo[s].step_peaks for s in (A, B, C))
    assert a[1] > a[0]  # the steady state (optimizer state alive during forward) is the peak
    assert max(a) > max(b) > max(c)


def test_oom_in_the_first_step_gives_the_final_stacks_losses_bitwise(solo, tmp_path):
    # A's first step does not fit, B's steady state does
    budget = (solo[A].step_peaks[0] + max(solo[B].step_peaks)) // 2
    assert max(solo[B].step_peaks) < budget < solo[A].step_peaks[0]
    t = run([A, B, C], budget=budget, ckpt_dir=tmp_path)
    assert [(e.step, e.from_stack, e.to_stack, e.restored) for e in t.backoffs] == [(0, A, B, 0)]
    assert "exceeded" in t.backoffs[0].reason
    assert t.peak_bytes <= budget
    assert t.losses == solo[B].losses  # bitwise
    assert t.step_peaks == solo[B].step_peaks
    # a new trainer on the same directory resumes with the stack it backed off to, and its history
    again = BudgetTrainer(model(), budget, stacks=[A, B, C], effective_batch=E, seq_len=T, ckpt_dir=tmp_path)
    assert again.step == 4 and again.stack == B and again.backoffs == t.backoffs


def test_oom_in_mid_run_restores_the_last_checkpoint_and_loses_nothing(solo, tmp_path):
    # A's first step fits, its steady state does not: OOM at step 1, restore the checkpoint of step 1
    budget = max(solo[A].step_peaks[0], max(solo[B].step_peaks)) + 1024
    assert budget < max(solo[A].step_peaks)
    t = run([A, B, C], budget=budget, steps=5)
    assert [(e.step, e.from_stack, e.to_stack, e.restored) for e in t.backoffs] == [(1, A, B, 1)]
    assert t.peak_bytes <= budget and len(t.losses) == 5
    # the same run without OOM: A for step 0, then B from A's checkpoint (a new trainer on that directory)
    d = tmp_path / "ref"
    BudgetTrainer(model(), None, stacks=[A], effective_batch=E, seq_len=T, ckpt_dir=d).train(1)
    ref = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=d)
    assert ref.step == 1
    assert t.losses == ref.train(5)  # bitwise


def test_micro_batch_split_changes_losses_by_rounding_only():
    """Different splits of one effective batch add the same gradients in another order."""
    la = run([A], steps=12).losses
    lc = run([Stack(micro_batch=1, grad_accum=8)], steps=12).losses
    rel = max(abs(x - y) / abs(y) for x, y in zip(la, lc))
    print(f"micro-batch 8 vs 1 x 8: max relative loss difference over 12 steps {rel:.2e}")
    assert rel < 1e-5
    assert la[-1] < la[0] - 0.3  # and it does learn


def test_the_cpu_budget_is_enforced_by_the_tracker():
    m = model()
    x = torch.randint(0, 256, (8, 32))
    with pytest.raises(torch.OutOfMemoryError, match="budget .* exceeded"):
        with BudgetTracker(m, budget=300_000) as tr:
            m(x, x)[1].backward()
    assert tr.peak_bytes <= 300_000 < tr.refused_bytes
    with BudgetTracker(m, budget=10**9) as ok:
        m(x, x)[1].backward()
    assert 300_000 < ok.peak_bytes <= 10**9 and ok.refused_bytes == 0


def test_no_stack_fits_is_a_clear_error(solo):
    with pytest.raises(torch.OutOfMemoryError, match="does not fit the budget.*nothing left to back off"):
        run([A, B], budget=min(solo[C].step_peaks) // 2, steps=2)


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork (Linux)")
def test_resume_after_kill_9_loses_and_repeats_nothing(solo, tmp_path):
    """Training processes killed with SIGKILL at random instants (in a step or in a checkpoint
    write); a new trainer on the same directory continues bitwise as if nothing had happened."""
    steps = 12
    ref = solo[B].losses + run([B], steps=steps, ckpt_dir=tmp_path / "ref").losses[4:]
    rng = random.Random(3)
    killed_at, torn = [], 0
    for trial in range(5):
        d = tmp_path / f"run{trial}"
        pid = os.fork()
        if pid == 0:  # the child trains until it is killed
            try:
                torch.set_num_threads(1)  # no OpenMP pool inherited across fork
                BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=d).train(steps)
            finally:
                os._exit(0)
        # wait for a random checkpoint to appear, then a random instant more: inside a step or a write
        target = d / f"step-{rng.randrange(1, steps - 2):08d}.safetensors"
        deadline = time.monotonic() + 60
        while not target.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.05))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        t = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=d)
        resumed = t.step
        assert not list(d.glob(".*.tmp-*"))  # a write the kill interrupted left its temp file: removed
        assert 0 <= resumed <= steps
        assert t.losses == ref[:resumed]  # what was done before the kill is kept, bitwise
        assert t.train(steps) == ref  # and the rest continues as if nothing had happened
        if os.WIFSIGNALED(status):
            killed_at.append(resumed)
            torn += t.stale_temps_removed
    print(f"kill -9 of a training process: {len(killed_at)} of 5 killed before the end, resumed at steps {killed_at}, "
          f"{torn} killed in a checkpoint write")
    assert any(0 < s < steps for s in killed_at), "no kill landed in the middle of training"


def test_a_corrupted_newest_checkpoint_is_rejected_and_the_previous_used(solo, tmp_path):
    run([B], steps=3, ckpt_dir=tmp_path)
    files = sorted(tmp_path.glob("step-*.safetensors"))
    assert [f.name for f in files] == ["step-00000002.safetensors", "step-00000003.safetensors"]
    data = bytearray(files[-1].read_bytes())
    data[-5] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=tmp_path)
    assert t.step == 2 and t.rejected and "checksum" in t.rejected[0][1]
    assert any("step-00000003" in str(x.message) for x in w)
    assert t.train(4) == solo[B].losses


def test_back_off_rule():
    assert back_off(Stack(micro_batch=18)) == Stack(micro_batch=9, grad_accum=2)
    assert back_off(Stack(micro_batch=9, grad_accum=2)) == Stack(micro_batch=3, grad_accum=6)  # 4 does not divide 18
    s = Stack(precision="bf16-mixed", optimizer="adamw-fused", micro_batch=1, grad_accum=8)
    assert back_off(s) == dataclasses.replace(s, checkpointing="full")
    assert back_off(dataclasses.replace(s, checkpointing="full")) is None
    chain = back_off_chain(Stack(micro_batch=12))
    assert [c.micro_batch for c in chain] == [12, 6, 3, 1, 1] and {c.effective_batch for c in chain} == {12}
    with pytest.raises(TypeError, match="Stack"):
        back_off({"micro_batch": 2})


def test_bf16_and_checkpointing_every_k_run_and_stay_close():
    fp = run([B], steps=3).losses
    bf = run([dataclasses.replace(B, precision="bf16-mixed", checkpointing="every-k", ckpt_every=2)], steps=3).losses
    assert max(abs(x - y) for x, y in zip(fp, bf)) < 0.05


def test_a_transformers_model_trains_with_checkpointing():
    pytest.importorskip("transformers")
    from memlab.models import tiny_llama

    torch.manual_seed(0)
    m = tiny_llama(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1)
    s = Stack(micro_batch=2, grad_accum=2, checkpointing="full", attention="eager")
    t = BudgetTrainer(m, None, stacks=[s], effective_batch=4, seq_len=16)
    losses = t.train(2)
    assert len(losses) == 2 and all(0 < x < 10 for x in losses) and t.peak_bytes > 0


@pytest.mark.cuda
def test_cuda_budget_is_the_allocators():
    """On CUDA the budget is the caching allocator's count of the trainer's own tensors. The process's other
    allocations are not charged: a 32 MiB ballast, the cuBLAS workspaces (64 MiB on an H200, where the old
    64 MiB budget was met by them alone and a step from cached blocks "peaked" at 108,147,712 B unrefused).
    A budget between the chain's first two stacks' measured peaks makes the trainer back off from A."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    chain = back_off_chain(A)

    def cuda_run(stacks, budget=None):
        t = BudgetTrainer(model().cuda(), budget, stacks=stacks, effective_batch=E, seq_len=T)
        t.train(3)
        return t

    solo = {s: cuda_run([s]) for s in chain[:2]}
    a, b = (solo[s].step_peaks for s in chain[:2])
    ballast = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")
    with_ballast = cuda_run([A]).step_peaks
    del ballast
    print(f"CUDA step peaks: A {a}, {chain[1].micro_batch}x{chain[1].grad_accum} {b}; A beside 32 MiB: {with_ballast}")
    assert max(a) < 16 * 2**20  # the trainer's tensors (CPU: 2.3 MiB); two cuBLAS workspaces are >= 16.25 MiB
    assert all(abs(x - y) <= 2**20 for x, y in zip(with_ballast, a))  # the ballast is not the trainer's
    budget = (min(a) + max(b)) // 2
    assert max(b) < budget < min(a), "the chain's first back-off must save memory on CUDA too"
    t = cuda_run(chain, budget)
    assert [(e.step, e.from_stack, e.to_stack, e.restored) for e in t.backoffs] == [(0, A, chain[1], 0)]
    assert "CUDA allocator's counter" in t.backoffs[0].reason  # the counter decided, not the reserved-bytes cap
    assert t.peak_bytes <= budget and t.stack == chain[1]
    assert all(abs(x - y) <= 2**16 for x, y in zip(t.step_peaks, b))
    assert max(abs(x - y) / abs(y) for x, y in zip(t.losses, solo[chain[1]].losses)) < 1e-4


def test_bad_arguments():
    m = model()
    with pytest.raises(ValueError, match=r"stacks\[1\]: micro_batch=2 x grad_accum=2 = 4; allowed: effective_batch=8"):
        BudgetTrainer(m, None, stacks=[A, Stack(micro_batch=2, grad_accum=2)], effective_batch=8, seq_len=T)
    with pytest.raises(ValueError, match=r"stacks\[0\].optimizer='adamw8bit'"):
        BudgetTrainer(m, None, stacks=[Stack(optimizer="adam8bit", micro_batch=8)], effective_batch=8, seq_len=T)
    with pytest.raises(ValueError, match="budget=-1"):
        BudgetTrainer(m, -1, stacks=[A], effective_batch=8, seq_len=T)
    with pytest.raises(ValueError, match="budget='lots'"):
        BudgetTrainer(m, "lots", stacks=[A], effective_batch=8, seq_len=T)
    with pytest.raises(ValueError, match="stacks=\\[\\]"):
        BudgetTrainer(m, None, stacks=[], effective_batch=8, seq_len=T)
    with pytest.raises(ValueError, match="seq_len=0"):
        BudgetTrainer(m, None, stacks=[A], effective_batch=8, seq_len=0)
    t = BudgetTrainer(m, "1 GiB", stacks=A, effective_batch=8, seq_len=T)
    assert t.budget == 2**30 and len(t.stacks) == 5
    with pytest.raises(ValueError, match="steps=-1"):
        t.train(-1)
    with pytest.raises(ValueError, match=r"data\(0\) returned"):
        BudgetTrainer(m, None, stacks=[A], effective_batch=8, seq_len=T,
                      data=lambda i: (torch.zeros(2, 3, dtype=torch.long),) * 2).train(1)
    with pytest.raises(ValueError, match="lengths"):
        bucket_batches([3, 0], 2)
    with pytest.raises(ValueError, match="batch_size=0"):
        bucket_batches([3, 4], 0)
    with pytest.raises(ValueError, match="exactly once"):
        padding_stats([1, 2, 3], [[0, 1]])


def _line_lengths() -> list[int]:
    from memlab.models.corpus import stdlib_corpus

    text = bytes(stdlib_corpus(max_bytes=200_000).tolist()).decode("utf-8", "replace")
    return [len(line) + 1 for line in text.split("\n")]


def test_bucketing_saves_padding_on_real_lengths():
    lengths = _line_lengths()
    assert len(lengths) > 3000
    rnd = padding_stats(lengths, random_batches(lengths, 32, seed=0), bytes_per_token=8)
    buck = padding_stats(lengths, bucket_batches(lengths, 32, seed=0), bytes_per_token=8)
    pooled = padding_stats(lengths, bucket_batches(lengths, 32, pool=8, seed=0), bytes_per_token=8)
    assert rnd["tokens"] == buck["tokens"] == pooled["tokens"] == sum(lengths)
    print(f"padding: random {rnd['padding_fraction']:.1%}, pools of 8 batches {pooled['padding_fraction']:.1%}, "
          f"sorted {buck['padding_fraction']:.1%} of the padded slots")
    assert buck["padding"] < pooled["padding"] < rnd["padding"]
    assert buck["padding_fraction"] < 0.1 < rnd["padding_fraction"]
    assert buck["padding_bytes"] == 8 * buck["padding"]
    b = bucket_batches(lengths, 32, seed=1)
    assert sorted(i for x in b for i in x) == list(range(len(lengths)))
    assert b != bucket_batches(lengths, 32, seed=2)  # the batch order is shuffled


def test_pad_batch():
    ids, mask = pad_batch([torch.tensor([1, 2, 3]), torch.tensor([4])], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9]] and mask.tolist() == [[True] * 3, [True, False, False]]


def test_bucketing_saves_measured_activation_bytes():
    """The padding saved, measured: the tracked peak of forward + backward of each padded batch."""
    from memlab.models.corpus import stdlib_corpus
    from memlab.profiler import MemoryTracker

    raw = bytes(stdlib_corpus(max_bytes=20_000).tolist())
    seqs = [torch.tensor(list(line[:63] + b"\n")) for line in raw.split(b"\n")[:96] if line]
    lengths = [len(s) for s in seqs]
    torch.manual_seed(0)
    m = TinyGPT(TinyGPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32))

    def measured(batches) -> int:
        total = 0
        for b in batches:
            ids, _ = pad_batch([seqs[i] for i in b])
            with MemoryTracker(m, timeline=False) as tr:
                m(ids, ids)[1].backward()
            m.zero_grad(set_to_none=True)
            total += tr.peak_bytes
        return total

    rnd, buck = random_batches(lengths, 8, seed=0), bucket_batches(lengths, 8, seed=0)
    mr, mb = measured(rnd), measured(buck)
    saved = mr - mb
    stats = padding_stats(lengths, rnd), padding_stats(lengths, buck)
    print(f"{len(seqs)} lines, batches of 8: padded slots {stats[0]['slots']} random vs {stats[1]['slots']} bucketed; "
          f"sum of tracked step peaks {mr / 2**20:.2f} MiB random vs {mb / 2**20:.2f} MiB bucketed "
          f"({saved / 2**20:.2f} MiB, {saved / mr:.0%} saved)")
    assert stats[1]["slots"] < stats[0]["slots"] and saved > 0


# ----------------------------------------------------------------------------- corruption never costs progress
def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def test_all_checkpoints_corrupt_is_refused_unless_fresh(tmp_path):
    from memlab.train.state import CheckpointError

    run([B], steps=2, ckpt_dir=tmp_path)
    for f in tmp_path.glob("step-*.safetensors"):
        _corrupt(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"no checkpoint there verifies.*step-00000002.*fresh=True"):
            BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=tmp_path)
    assert len(list(tmp_path.glob("step-*.safetensors"))) == 2  # refusing touched nothing
    t = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=tmp_path, fresh=True)
    assert t.step == 0 and len(t.set_aside) == 2 and all(p.name.endswith(".set-aside") for p in t.set_aside)
    t.train(1)
    # the new run's checkpoints survive (they used to be deleted by the old files' higher names)
    assert sorted(f.name for f in tmp_path.glob("step-*.safetensors")) == ["step-00000000.safetensors",
                                                                          "step-00000001.safetensors"]


def test_keep_counts_steps_and_never_deletes_the_newest_valid(tmp_path):
    run([B], steps=2, ckpt_dir=tmp_path)  # step-1, step-2
    # a corrupt checkpoint of a later step, as a crash mid-copy leaves it
    (tmp_path / "step-00000009.safetensors").write_bytes(b"\0" * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=tmp_path)
    assert t.step == 2 and [p.name for p in t.set_aside] == ["step-00000009.safetensors.corrupt"]
    t.train(3)
    assert sorted(f.name for f in tmp_path.glob("step-*.safetensors")) == ["step-00000002.safetensors",
                                                                          "step-00000003.safetensors"]


def test_a_foreign_checkpoint_is_a_checkpoint_error_naming_the_file(tmp_path):
    from memlab.train import state as ckpt
    from memlab.train.state import CheckpointError

    def trainer(d, m=None):
        return BudgetTrainer(m or model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=d)

    run([B], steps=1, ckpt_dir=tmp_path / "a")
    torch.manual_seed(0)
    wider = TinyGPT(TinyGPTConfig(**{**CFG, "n_embd": 64}))
    with pytest.raises(CheckpointError, match=r"step-00000001\.safetensors: checkpoint of another model config: "
                                              r"n_embd=32 in the checkpoint, n_embd=64 in this model"):
        trainer(tmp_path / "a", wider)
    (tmp_path / "b").mkdir()
    ckpt.save({"weights": torch.zeros(3)}, tmp_path / "b" / "step-00000004.safetensors")  # valid, other content
    with pytest.raises(CheckpointError, match=r"step-00000004\.safetensors: not a BudgetTrainer checkpoint"):
        trainer(tmp_path / "b")
    (tmp_path / "c").mkdir()
    ckpt.save([1, 2], tmp_path / "c" / "step-00000004.safetensors")
    with pytest.raises(CheckpointError, match=r"step-00000004\.safetensors: not a BudgetTrainer checkpoint"):
        trainer(tmp_path / "c")
    (tmp_path / "d").mkdir()
    good = ckpt.load(tmp_path / "a" / "step-00000001.safetensors")
    del good["optimizer"]["param_groups"]
    ckpt.save(good, tmp_path / "d" / "step-00000001.safetensors")
    with warnings.catch_warnings():  # malformed: skipped like a corrupted file; with nothing older, refused
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"no checkpoint there verifies.*step-00000001\.safetensors: "
                                                  r"malformed BudgetTrainer checkpoint.*param_groups"):
            trainer(tmp_path / "d")


def test_resuming_with_another_lr_applies_it_and_says_so(tmp_path):
    run([B], steps=1, ckpt_dir=tmp_path, lr=1e-3)
    with pytest.warns(UserWarning, match=r"resumed with lr=0\.01 \(the checkpoint had 0\.001\): applied"):
        t = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=tmp_path, lr=1e-2)
    assert t.step == 1 and t.hparams_applied == {"lr": (1e-3, 1e-2)}
    assert all(g["lr"] == 1e-2 for g in t.optimizer.param_groups)
    t.train(2)
    assert t.optimizer.param_groups[0]["lr"] == 1e-2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same lr again: nothing to say
        u = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, ckpt_dir=tmp_path, lr=1e-2)
    assert u.hparams_applied == {} and u.step == 2


def test_a_checkpoint_that_does_not_verify_after_writing_deletes_nothing(tmp_path, monkeypatch):
    from memlab.train import state as ckpt

    t = run([B], steps=2, ckpt_dir=tmp_path)
    before = sorted(f.name for f in tmp_path.glob("step-*.safetensors"))
    real = ckpt.save

    def torn(state, path):  # the disk returns other bytes than were written
        out = real(state, path)
        data = bytearray(out.read_bytes())
        data[-3] ^= 0xFF
        out.write_bytes(bytes(data))
        return out

    monkeypatch.setattr(ckpt, "save", torn)
    with pytest.warns(UserWarning, match="does not verify.*keeping every older one"):
        t.train(3)
    assert sorted(f.name for f in tmp_path.glob("step-*.safetensors")) == before + ["step-00000003.safetensors"]


def test_precision_speaks_the_shared_vocabulary():
    """"bf16" is bf16 *mixed* precision (memlab.core.vocab), which the trainer runs as "bf16-mixed"."""
    assert Stack(precision="bf16", micro_batch=8) == Stack(precision="bf16-mixed", micro_batch=8)
    t = BudgetTrainer(model(), None, stacks=[Stack(precision="bf16", micro_batch=8)], effective_batch=8, seq_len=T)
    assert t.stack.precision == "bf16-mixed"
