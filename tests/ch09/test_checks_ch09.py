"""Chapter 09 checks: the order of the exercises, the messages of wrong answers, the measurement the prediction
is graded against. memlab's own answers pass and the labs' stubs are todo: tests/course/test_course.py; wrong
answers: tests/course/mutants/ch09.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():  # 09.triton_lce_forward runs in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memlab.course.grading import REGISTRY, check, load_chapter  # noqa: E402

load_chapter("09")

IDS = ["09.predict_loss_bytes", "09.fused_linear_cross_entropy", "09.triton_lce_forward", "09.optimizer_in_backward"]


def test_the_chapter_registers_its_exercises_in_order():
    assert [k for k in REGISTRY if k.startswith("09.")] == IDS


def test_wrong_return_type_is_a_fail_with_a_message():
    r = check("09.predict_loss_bytes", lambda t, v, d: (1.5, 2.5), quiet=True)
    assert r.status == "fail" and "two ints" in r.message
    r = check("09.fused_linear_cross_entropy", lambda h, w, t, c, ii=-100: 0.0, quiet=True)
    assert r.status == "fail" and "Tensor" in r.message
    r = check("09.triton_lce_forward", lambda *a: None, quiet=True)
    assert r.status == "fail" and "@triton.jit kernel" in r.message
    r = check("09.optimizer_in_backward", lambda m, mk: None, quiet=True)
    assert r.status == "fail" and ".remove()" in r.message


def test_the_prediction_is_graded_against_the_allocator_and_the_hooks():
    """memlab's formula is the measurement to within the loss's scalars, at each graded size and dtype."""
    import memlab.course.checks.ch09 as ch09

    for tokens, vocab, dtype in ch09.LOSS_BYTES_CASES[:3]:
        saved, peak = ch09.measure_loss_bytes(tokens, vocab, dtype)
        want = ch09.predict_loss_bytes_reference(tokens, vocab, dtype)
        assert abs(saved - want[0]) <= ch09.BYTES_SLACK and abs(peak - want[1]) <= ch09.BYTES_SLACK, (saved, peak, want)


def test_a_non_function_answer_to_the_fused_loss_is_caught_by_the_memory_probe():
    """The chunked loss through autograd gives the right numbers in fp64 but keeps every chunk's log-softmax."""
    import memlab.course.checks.ch09 as ch09
    from memlab.loss import chunked_cross_entropy

    with pytest.raises(AssertionError, match="autograd keeps"):
        ch09._check_memory(lambda h, w, t, c, ii=-100: chunked_cross_entropy(h, w, t, chunk_size=c, ignore_index=ii))


def test_triton_check_names_the_missing_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernel compiles")
    import triton.language as tl_

    import memlab.course.checks.ch09 as ch09

    monkeypatch.setattr(tl_, "zeros", object())
    with pytest.raises(AssertionError, match="TRITON_INTERPRET=1"):
        ch09._triton_device()
