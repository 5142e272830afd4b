"""Chapter 07's checks: a learner's copy of the reference earns points, the messages name what is wrong,
the prediction's formula is the measurement. memlab's own answers pass and the labs' stubs are todo:
tests/course/test_course.py."""
from __future__ import annotations

import dataclasses
import os

import pytest

from memlab import train
from memlab.train import state as ckpt
from memlab.course.grading import check
from memlab.plan import Stack


def test_a_copy_of_the_reference_passes_and_earns_points():
    def back_off(stack):
        eff = stack.effective_batch
        if stack.micro_batch > 1:
            mb = max(d for d in range(1, stack.micro_batch // 2 + 1) if eff % d == 0)
            return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
        return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing != "full" else None

    r = check("07.back_off", back_off, quiet=True)
    assert r.status == "pass" and r.points == 1.0 and "no points" not in (r.message or "")

    def atomic_write(path, chunks):  # a learner's own copy: not memlab's object, so it earns the point
        return ckpt.atomic_write(path, chunks)

    r = check("07.atomic_write", atomic_write, quiet=True)
    assert r.status == "pass", r.message


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_right_answers_written_another_way_pass():
    """The writer is judged by the file a crash leaves, not by the names of the calls it makes (issue 35)."""
    from os import replace  # noqa: PLC0415 - imported by name: the check must see this name too
    from pathlib import Path

    def with_fdatasync(path, chunks):  # fdatasync makes the data durable as well as fsync does
        path = Path(path)
        tmp = path.with_name(f".{path.name}.part")
        try:
            with open(tmp, "wb") as f:
                for c in chunks:
                    f.write(c)
                f.flush()
                os.fdatasync(f.fileno())
            replace(tmp, path)  # `from os import replace`
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    def with_tempfile_and_pathlib(path, chunks):  # tempfile in the target's folder, Path.replace, os.sync
        import tempfile

        path = Path(path)
        f = tempfile.NamedTemporaryFile(dir=path.parent, delete=False)
        try:
            with f:
                for c in chunks:
                    f.write(c)
                f.flush()
                os.fsync(f.fileno())
            Path(f.name).replace(path)
        except BaseException:
            Path(f.name).unlink(missing_ok=True)
            raise
        os.sync()

    for answer in (with_fdatasync, with_tempfile_and_pathlib):
        r = check("07.atomic_write", answer, quiet=True)
        assert r.status == "pass" and r.points == 1.0, (answer.__name__, r.message)

    def back_off(stack):  # under full checkpointing ckpt_every means nothing: reset to 1, the trainer runs the same
        nxt = train.back_off(stack)
        if nxt is not None and nxt.checkpointing == "full":
            nxt = dataclasses.replace(nxt, ckpt_every=1)
        return nxt

    r = check("07.back_off", back_off, quiet=True)
    assert r.status == "pass", r.message


def test_messages_name_the_problem():
    r = check("07.back_off", lambda s: dataclasses.replace(s, micro_batch=max(1, s.micro_batch // 2)), quiet=True)
    assert r.status == "fail" and "effective batch" in r.message
    r = check("07.cheapest_stack", lambda eb, budget, est, cost: Stack(micro_batch=eb), quiet=True)
    assert r.status == "fail" and "expected micro_batch=" in r.message
    r = check("07.predict_peak", lambda model_fn, stack, seq_len: 10**6, quiet=True)
    assert r.status == "fail" and "predicted 1,000,000 bytes; the step's peak is" in r.message and "outside" in r.message
    r = check("07.predict_peak", train.estimate_stack_peak, quiet=True)
    assert r.status == "fail" and "asks for a derivation" in r.message, r.message

    def in_place(path, chunks):
        with open(path, "wb") as f:
            for c in chunks:
                f.write(c)

    r = check("07.atomic_write", in_place, quiet=True)
    assert r.status == "fail" and "rename" in r.message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_writer_that_moves_the_good_file_away_fails():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "course" / "mutants" / "ch07.py"
    spec = importlib.util.spec_from_file_location("memlab_mutants_ch07_t", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = check("07.atomic_write", mod.write_move_old_away, quiet=True)  # between its two renames, no file at all
    assert r.status == "fail" and "no file at all" in r.message and "moving the old file away" in r.message, r.message


def test_predict_peak_reference_is_exact():
    from functools import partial

    from memlab.models import TinyGPT, TinyGPTConfig

    fn = partial(lambda: TinyGPT(TinyGPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)))
    s = Stack(micro_batch=2, grad_accum=2)
    assert train.estimate_stack_peak(fn, s, 16) == train.measure_stack_peak(fn, s, 16)


@pytest.mark.parametrize("cfg,mb,ga,seq_len", [
    (dict(block_size=32, n_layer=1, n_head=2, n_embd=32), 2, 2, 16),   # backward, accumulation
    (dict(block_size=48, n_layer=2, n_head=4, n_embd=48), 3, 3, 24),   # three micro-batches: 4 B more of losses
    (dict(block_size=32, n_layer=2, n_head=2, n_embd=64), 2, 1, 4),    # the optimizer step is the peak
])
def test_predict_peak_formula_is_the_measurement(cfg, mb, ga, seq_len):
    """The derived formula (the check's reference) equals the real step's tracked peak to the byte, on
    configurations the check does not grade."""
    from functools import partial

    from memlab.course.checks.ch07 import _tiny, predict_peak_formula

    fn, s = partial(_tiny, cfg), Stack(micro_batch=mb, grad_accum=ga)
    assert predict_peak_formula(fn, s, seq_len) == train.measure_stack_peak(fn, s, seq_len)
