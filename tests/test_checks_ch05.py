"""Chapter 05 checks: pass on memlab's own answers (wrong answers: tests/test_mutants.py), todo on stubs."""
from __future__ import annotations

import pytest

from memlab.grading import REGISTRY, check, load_chapter

load_chapter("05")

IDS = ["05.merge_partials", "05.chunked_forward", "05.flash_backward", "05.causal_mask", "05.predict_saved_bytes"]


def test_the_chapter_registers_its_exercises_in_order():
    assert [k for k in REGISTRY if k.startswith("05.")] == IDS


@pytest.mark.parametrize("exercise_id", IDS)
def test_reference_passes(exercise_id):
    r = check(exercise_id, REGISTRY[exercise_id].reference(), quiet=True)
    assert r.status == "pass", r.message


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_is_todo(exercise_id):
    def stub(*args):
        raise NotImplementedError(f"exercise {exercise_id}: replace this line with your code")

    assert check(exercise_id, stub, quiet=True).status == "todo"


def test_wrong_return_type_is_a_fail_with_a_message():
    r = check("05.merge_partials", lambda o1, l1, o2, l2: o1, quiet=True)
    assert r.status == "fail" and "tuple" in r.message
    r = check("05.predict_saved_bytes", lambda b, h, s, d: (1.5, 2.5), quiet=True)
    assert r.status == "fail" and "predicted bytes naive_attention" in r.message
