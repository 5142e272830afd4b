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


def test_exact_reference_of_exercises_2_to_4_for_rows_that_see_no_key():
    """Issue 36: the fp64 reference of exercises 2-4 gives a row that sees no key (bottom-right, Lq > Lk) output 0,
    logsumexp -inf and gradient 0, no NaN; it agrees with SDPA under a boolean bottom-right mask and with the Triton
    check's reference, and its top-left is SDPA's is_causal."""
    import memlab.course.checks.ch05 as ch05

    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True) for n in (45, 37, 37))
    o, lse = ch05._exact(q, k, v, True)
    assert torch.equal(o[..., :8, :].detach(), torch.zeros(1, 2, 8, 8, dtype=torch.float64))
    assert bool((lse[..., :8] == float("-inf")).all()) and not torch.isinf(lse[..., 8:]).any()
    want_o, want_l = ch05._exact_masked(q.detach(), k.detach(), v.detach(), "bottom_right")
    torch.testing.assert_close(o.detach(), want_o)
    torch.testing.assert_close(lse.detach(), want_l)
    seen = torch.ones(45, 37, dtype=torch.bool).tril(37 - 45)  # a boolean mask: SDPA gives an empty row 0
    torch.testing.assert_close(o, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen))
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert not any(bool(torch.isnan(g).any()) for g in (dq, dk, dv))
    assert torch.equal(dq[..., :8, :], torch.zeros_like(dq[..., :8, :]))
    torch.testing.assert_close(ch05._exact(q, k, v, "top_left")[0],
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("exercise,old,fixed", [
    ("05.chunked_forward", "NaN rows where a query sees no key (the lab's forward before issue 36)",
     "online softmax with the two guards"),
    ("05.flash_function", "NaN rows where a query sees no key (the lab's forward before issue 36)",
     "the Function over those two"),
])
def test_exercises_2_to_4_try_rows_that_see_no_key(exercise, old, fixed):
    """Issue 36: the lab's old forward (NaN where a query row sees no key) fails and says why; the same code with
    the two guards passes."""
    mod = _mutants()
    wrong = dict(mod.MUTANTS[exercise])[old]
    r = check(exercise, wrong, quiet=True)
    assert r.status == "fail" and "NaN" in r.message and "see no key" in r.message, r.message
    right = dict(mod.RIGHT_ANSWERS[exercise])[fixed]
    r = check(exercise, right, quiet=True)
    assert r.status == "pass", r.message


def test_top_left_composition_matches_sdpa():
    """The checks build SDPA's is_causal from the lab's bottom-right function; with memlab's answer it is SDPA's."""
    import memlab.course.checks.ch05 as ch05

    for lq, lk in ((29, 12), (12, 29), (16, 16)):
        q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (lq, lk, lk))
        o, lse = ch05._top_left_forward(ch05.chunked_forward_reference, q, k, v, 5)
        torch.testing.assert_close(o, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        torch.testing.assert_close(lse, ch05._exact(q, k, v, "top_left")[1])
        o, lse = ch05._exact(q, k, v, "top_left")
        do = torch.randn_like(o)
        got = ch05._top_left_backward(ch05.flash_backward_reference, q, k, v, o, lse, do, 8)
        for g, w in zip(got, ch05._grads(q, k, v, do, "top_left")):
            torch.testing.assert_close(g, w)
