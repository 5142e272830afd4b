"""Chapter 01 checks: a learner's exception is a row. memlab's own answers pass and the labs' stubs are
todo: tests/course/test_course.py; wrong answers: tests/course/mutants/ch01.py (tests/course/test_mutants.py)."""
from __future__ import annotations

from memlab.course.grading import check


def test_an_exception_is_an_error_row_not_a_crash():
    def broken(timeline):
        raise KeyError("phase")

    r = check("01.phase_peaks", broken, quiet=True)
    assert r.status == "error" and "KeyError" in r.message
