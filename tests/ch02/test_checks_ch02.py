"""Chapter 02 checks: pass on memlab's own answers, todo on a stub (wrong answers: tests/course/mutants/ch02.py)."""
from __future__ import annotations

import pytest

import memlab.checkpoint as ck
from memlab.course.grading import check, load_chapter

load_chapter("02")

IDS = ["02.count_saved", "02.checkpoint_function", "02.rng_replay", "02.checkpoint_sequential", "02.choose_segments",
       "02.predict_ckpt_peak"]
REFERENCES = {
    "02.count_saved": ck.count_saved_tensors,
    "02.checkpoint_function": ck.checkpoint_reentrant,
    "02.rng_replay": ck.RNGState,
    "02.checkpoint_sequential": ck.checkpoint_sequential,
    "02.choose_segments": ck.segments_for_budget,
    "02.predict_ckpt_peak": ck.sequential_activation_peak,
}


@pytest.mark.parametrize("exercise_id", IDS)
def test_reference_passes(exercise_id):
    r = check(exercise_id, REFERENCES[exercise_id], quiet=True)
    assert r.status == "pass", r.message


# Plausible wrong answers live in tests/course/mutants/ch02.py (tests/course/test_mutants.py).


def test_stub_is_todo():
    def stub(*args):
        raise NotImplementedError("exercise 02.count_saved: replace this line with your code")

    assert check("02.count_saved", stub, quiet=True).status == "todo"


def test_predict_ckpt_peak_stub_is_todo():
    def stub(config, batch_size, seq_len, segments):
        raise NotImplementedError("exercise 02.predict_ckpt_peak: replace this line with your code")

    assert check("02.predict_ckpt_peak", stub, quiet=True).status == "todo"


def test_predict_ckpt_peak_accepts_a_prediction_within_tolerance():
    """The check grades on relative error: 0.1% off memlab's model passes, as a prediction should (the
    model is within 1.30% of the measurement and the check allows 1.5%: below one boundary's 1.72%)."""
    def close(config, batch_size, seq_len, segments):
        return 1.001 * ck.sequential_activation_peak(config, batch_size, seq_len, segments)

    assert check("02.predict_ckpt_peak", close, quiet=True).status == "pass"
