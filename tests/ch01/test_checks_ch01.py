"""Chapter 01 checks: pass on memlab's own answers, todo on a stub (wrong answers: tests/course/mutants/ch01.py)."""
from __future__ import annotations

import pytest

import memlab.profiler as prof
from memlab.course.reference import ch01 as ch01_ref
from memlab.course.grading import check, load_chapter

load_chapter("01")

REFERENCES = {
    "01.live_bytes": ch01_ref.LiveBytes,
    "01.categorize": ch01_ref.categorize,
    "01.phase_peaks": prof.phase_peaks,
    "01.fake_activations": ch01_ref.fake_activation_bytes,
    "01.fix_the_leak": ch01_ref.train_losses,
}


@pytest.mark.parametrize("exercise_id", list(REFERENCES))
def test_reference_passes(exercise_id):
    r = check(exercise_id, REFERENCES[exercise_id], quiet=True)
    assert r.status == "pass", r.message


# Plausible wrong answers live in tests/course/mutants/ch01.py (tests/course/test_mutants.py).


class _StubLiveBytes:
    def __init__(self):
        raise NotImplementedError("exercise 01.live_bytes: replace this line with your code")


def _stub(*args, **kwargs):
    raise NotImplementedError("replace this line with your code")


STUBS = {
    "01.live_bytes": _StubLiveBytes,
    "01.categorize": _stub,
    "01.phase_peaks": _stub,
    "01.fake_activations": _stub,
    "01.fix_the_leak": _stub,
}


@pytest.mark.parametrize("exercise_id", list(STUBS))
def test_stub_is_todo(exercise_id):
    assert check(exercise_id, STUBS[exercise_id], quiet=True).status == "todo"


def test_an_exception_is_an_error_row_not_a_crash():
    def broken(timeline):
        raise KeyError("phase")

    r = check("01.phase_peaks", broken, quiet=True)
    assert r.status == "error" and "KeyError" in r.message
