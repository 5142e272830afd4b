"""Chapter 05 checks: the order of the exercises, the messages of wrong answers. memlab's own answers pass
and the labs' stubs are todo: tests/course/test_course.py; wrong answers: tests/course/mutants/ch05.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():  # 05.triton_forward runs in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memlab.course.grading import REGISTRY, check, load_chapter  # noqa: E402

load_chapter("05")

IDS = ["05.merge_partials", "05.chunked_forward", "05.flash_backward", "05.flash_function", "05.triton_forward",
       "05.predict_saved_bytes"]


def test_the_chapter_registers_its_exercises_in_order():
    assert [k for k in REGISTRY if k.startswith("05.")] == IDS


def test_wrong_return_type_is_a_fail_with_a_message():
    r = check("05.merge_partials", lambda o1, l1, o2, l2: o1, quiet=True)
    assert r.status == "fail" and "tuple" in r.message
    r = check("05.predict_saved_bytes", lambda b, h, s, d: (1.5, 2.5), quiet=True)
    assert r.status == "fail" and "predicted bytes naive_attention" in r.message
    r = check("05.flash_function", lambda q, k, v, causal=False: q, quiet=True)
    assert r.status == "fail" and "subclass of torch.autograd.Function" in r.message
    r = check("05.triton_forward", lambda *a: None, quiet=True)
    assert r.status == "fail" and "@triton.jit kernel" in r.message


def test_triton_check_names_the_missing_interpreter(monkeypatch):
    """On a CPU, a triton imported without TRITON_INTERPRET=1 cannot run the kernel: the check says what to do."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernel compiles")
    import memlab.course.checks.ch05 as ch05
    import triton.language as tl_

    monkeypatch.setattr(tl_, "zeros", object())  # what tl.zeros is when triton was imported in compiled mode
    with pytest.raises(AssertionError, match="TRITON_INTERPRET=1"):
        ch05._triton_device()


def test_chunked_forward_memory_is_measured_not_guessed():
    """The chunked check's peak grows with the chunk for memlab's own forward (inputs made inside the tracker)."""
    import memlab.course.checks.ch05 as ch05

    small = ch05._forward_extra_peak(ch05.chunked_forward_reference, 64, 1024, 16, 16)
    large = ch05._forward_extra_peak(ch05.chunked_forward_reference, 64, 1024, 16, 1024)
    assert 0 < small < 2 * 64 * 1024 * 4 // 8 and large > 2 * 64 * 1024 * 4  # < 1/8 of one score matrix; > one


def _mutants():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "course" / "mutants" / "ch05.py"
    spec = importlib.util.spec_from_file_location("memlab_mutants_ch05_t", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_triton_check_tries_rows_that_see_no_key():
    """Issue 36: the lab's old kernel (NaN where a query row sees no key: bottom-right, Lq > Lk) fails, and says
    why; the same kernel with the two guards passes (the check fails the mistake, not the route)."""
    mod = _mutants()
    old = check("05.triton_forward", mod.triton_nan_rows, quiet=True)
    assert old.status == "fail" and "NaN" in old.message and "see no key" in old.message
    fixed = check("05.triton_forward", mod.triton_fixed, quiet=True)
    assert fixed.status == "pass", fixed.message


def test_triton_reference_for_empty_rows_and_top_left():
    """The check's fp64 reference: rows that see no key are 0 with logsumexp -inf; top-left equals SDPA's is_causal."""
    import memlab.course.checks.ch05 as ch05

    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (53, 37, 37))
    o, lse = ch05._exact_masked(q, k, v, "bottom_right")
    assert torch.equal(o[..., :16, :], torch.zeros_like(o[..., :16, :])) and bool(torch.isinf(lse[..., :16]).all())
    assert not torch.isnan(o).any() and not torch.isinf(lse[..., 16:]).any()
    o, _ = ch05._exact_masked(q, k, v, "top_left")
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(o, sdpa)
